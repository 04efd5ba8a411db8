"""The test tiers: which tests CI leaves out (the *extended* tier), and what still proves
their path in CI.

CI (``.ci/run``, ``launch/run_tests.sh``) runs every test but these (the counts and times:
docs/testing.md, the one place they are written). The extended tier is the rest of the suite: variants of a path a CI test
already proves end to end (another TP/PP layout, another transport, a second failure of the same
kind), long learning curves, and the test harness's own tests. Each entry names the CI tests
that cover its path; a test is moved here only when such a test exists.
``MEGATRON_GRPO_TEST_EXTENDED=1 bash launch/run_tests.sh`` runs both tiers, as an engineer does
before a change to the code an extended test proves; a test named on the command line
(``FILE::NAME``) always runs. The extended tests carry the ``extended`` mark (``-m extended``).

A key is a test's node id, or its id without the parameters (all of them). tests/conftest.py
refuses a key that matches no test when the whole suite is collected (a renamed test).
"""

EXTENDED: dict[str, str] = {
    "tests/test_checkpoint_integrity.py::test_train_falls_back_and_fails_in_one_line":
        "test_checkpoint_integrity::test_a_damaged_newest_checkpoint_is_skipped_in_one_line, "
        "::test_an_explicit_damaged_checkpoint_is_a_user_error and ::test_ranks_resume_the_older_checkpoint_and_load_it "
        "(the same fallback and refusal on the trainer's own load, in ranks); test_kill_resume::"
        "test_kill_minus_9_and_resume (a resume through train)",
    "tests/test_distillation.py::test_teacher_scores_at_the_sampling_temperature_and_gets_no_gradient[dp2]":
        "test_distillation::test_teacher_scores_at_the_sampling_temperature_and_gets_no_gradient[tp2|pp2] (the "
        "same teacher pass and update, sharded); test_smollm2_pipeline::test_two_distillation_steps_with_the_teacher_"
        "checked (DP2)",
    "tests/test_context_parallel_e2e.py::test_a_checkpoint_resumes_at_another_cp[cp1_to_cp2]":
        "test_context_parallel_e2e::test_a_checkpoint_resumes_at_another_cp[cp2_to_cp1] (the other direction "
        "of the same load); test_context_parallel_e2e::test_cp2_run_is_the_cp1_run",
    "tests/test_context_parallel.py::test_virtual_pipeline_with_cp_equals_cp1":
        "test_context_parallel::test_cp2_step_equals_cp1 (the CP path); test_vpp (the interleaved schedule)",
    "tests/test_context_parallel.py::test_four_rank_layouts_equal_cp1":
        "test_context_parallel::test_cp2_step_equals_cp1 (the same CP path at 2 ranks, every case); "
        "test_trainer_step_equivalence (TP2, PP2, DP2 steps)",
    "tests/test_smollm2_pipeline.py::test_export_of_the_pp2_checkpoint_is_the_original_bitwise":
        "test_models_equivalence::test_multi_rank_logits_and_round_trip[pp2] (HF weights back bitwise at PP2); "
        "non-slow test_models_moe::test_convert_cli_both_ways_with_self_check",
    "tests/test_smollm2_pipeline.py::test_eval_cli_on_the_export_matches_transformers_greedy":
        "test_two_grpo_steps_with_the_inprocess_engine (engine eval of the same greedy set at step 0); non-slow "
        "test_rollout_client::test_greedy_matches_hf_generate[embedded|sglang]",
    "tests/test_async_e2e.py::test_async_on_the_real_sglang_keeps_the_bound_with_its_token_versions":
        "test_async_rollouts::test_sglang_tokens_carry_the_version_and_log_prob_of_the_weights_that_drew_them "
        "(SGLang retract/label/continue vs HF); "
        "test_async_inprocess::test_async_training_on_the_inprocess_engine_keeps_the_bound",
    "tests/test_async_e2e.py::test_kill_minus_9_mid_flight_and_resume_trains_each_prompt_once":
        "test_kill_resume::test_kill_minus_9_and_resume (kill/resume path); non-slow "
        "test_async_rollouts::test_the_checkpoint_lists_every_settled_group_from_the_oldest_unsettled_draw_on, "
        "::test_the_resume_note_counts_what_the_checkpoint_restores_and_names_what_it_cannot",
    "tests/test_async_e2e.py::test_multi_turn_groups_past_the_bound_are_regenerated_and_never_trained":
        "test_async_rollouts::test_the_scheduler_drops_stale_groups_whose_episodes_span_weight_updates (launched "
        "embedded, multi-turn, past the bound); non-slow "
        "test_async_rollouts::test_no_group_past_the_bound_is_taken[1|2|4]",
    "tests/test_async_e2e.py::test_engine_killed_mid_flight_is_restarted_and_its_groups_regenerated":
        "test_lora_http_sync (engine SIGKILLed mid-run, restarted, run completes); "
        "test_rollout_manager::test_killed_engine_is_detected_and_restarted; test_async_inprocess (bound)",
    "tests/test_sglang_e2e.py::test_external_sglang_in_rollout_urls":
        "test_multi_turn_engines::test_train_on_the_real_sglang_one_step_off_policy_with_an_environment (same "
        "engine.urls path, syncs verified)",
    "tests/test_sglang_e2e.py::"
    "test_two_launched_servers_train_at_tp2_share_the_work_survive_a_death_and_die_with_the_launcher":
        "test_multi_turn_engines::test_train_on_the_real_sglang_one_step_off_policy_with_an_environment "
        "(trainer->SGLang sync verified each step); shared servers are launched by RolloutServerManager (same "
        "launch code) and their teardown fails on a survivor. Not covered in CI: the trainer launching SGLang "
        "itself, two servers, a relaunch (a one-server version of this test would bring the first back)",
    "tests/test_process_lifetime.py::test_nothing_outlives_a_killed_launcher[torchrun started-True]":
        "test_process_lifetime::test_nothing_outlives_a_killed_launcher[ranks importing-False] (the launcher "
        "alone killed at start-up), "
        "test_process_lifetime::test_sigterm_during_start_up_stops_in_one_line_and_leaves_nothing",
    "tests/test_process_lifetime.py::test_nothing_outlives_a_killed_launcher[ranks importing-True]":
        "test_process_lifetime::test_nothing_outlives_a_killed_launcher[ranks importing-False] (the harder "
        "launcher-only kill at the same moment)",
    "tests/test_process_lifetime.py::test_nothing_outlives_a_killed_launcher[training-False]":
        "[ranks importing-False] (ranks die with the launcher) + [engine starting-True] (engine dies with its "
        "rank); test_kill_resume::test_kill_minus_9_and_resume (mid-run kill, running_with()==[])",
    "tests/test_process_lifetime.py::test_nothing_outlives_a_killed_launcher[checkpoint writing-True]":
        "test_kill_resume::test_kill_minus_9_and_resume (killed during a save; asserts the forked writers are "
        "gone); non-slow "
        "test_runtime_megatron_cpu::test_children_forked_during_a_checkpoint_save_die_with_the_rank",
    "tests/test_process_lifetime.py::test_ctrl_c_with_save_on_stop_false_stops_in_one_line_and_saves_nothing":
        "test_sigterm_to_the_launcher_saves_the_finished_step_in_one_line (same stop path, saving); "
        "test_launch_scripts::test_scancel_stops_the_job_in_one_line_per_node_and_sbatch_resumes_it (stop under "
        "Slurm)",
    "tests/test_process_lifetime.py::"
    "test_slurms_sigterm_to_every_process_stops_in_one_line_and_saves_the_finished_step":
        "test_launch_scripts::test_scancel_stops_the_job_in_one_line_per_node_and_sbatch_resumes_it (real Slurm "
        "cancel; engine not signalled there)",
    "tests/test_kill_resume.py::test_kill_minus_9_and_resume_with_an_environment":
        "test_kill_minus_9_and_resume (kill/resume equality); test_process_lifetime::[environment workers-False];"
        " non-slow test_multi_turn::test_the_fork_servers_exit_ends_its_workers_children",
    "tests/test_hostile_inputs.py::"
    "test_a_plugin_that_breaks_its_contract_in_a_real_run_is_one_line_and_exit_2[environment_non_string_observation]":
        "test_hostile_inputs::test_reward_error_in_a_real_run_is_one_line_and_exit_2 (a plug-in error -> exit 2 "
        "-> one line through torchrun); non-slow "
        "test_multi_turn::test_env_errors_are_counted_scored_and_reported_once",
    "tests/test_hostile_inputs.py::"
    "test_a_plugin_that_breaks_its_contract_in_a_real_run_is_one_line_and_exit_2[environment_reward_past_float_range]":
        "test_reward_error_in_a_real_run_is_one_line_and_exit_2 (same plug-in error -> exit 2 -> one line through"
        " torchrun); non-slow test_multi_turn::test_env_errors_are_counted_scored_and_reported_once",
    "tests/test_hostile_inputs.py::"
    "test_a_plugin_that_breaks_its_contract_in_a_real_run_is_one_line_and_exit_2[reward_past_float_range]":
        "test_reward_error_in_a_real_run_is_one_line_and_exit_2 (same plug-in error -> exit 2 -> one line through"
        " torchrun); non-slow test_hostile_inputs::test_a_0d_tensor_reward_through_the_real_scorer",
    "tests/test_hostile_inputs.py::"
    "test_a_plugin_that_breaks_its_contract_in_a_real_run_is_one_line_and_exit_2"
    "[rollout_function_calls_the_engine_with_text]":
        "test_reward_error_in_a_real_run_is_one_line_and_exit_2 (same plug-in error -> exit 2 -> one line through"
        " torchrun); non-slow "
        "test_rollout_function::test_a_bad_engine_call_is_one_line_naming_the_file_and_function[*]",
    "tests/test_hostile_inputs.py::"
    "test_a_plugin_that_breaks_its_contract_in_a_real_run_is_one_line_and_exit_2[rollout_function_out_of_vocabulary]":
        "test_reward_error_in_a_real_run_is_one_line_and_exit_2 (same plug-in error -> exit 2 -> one line through"
        " torchrun); non-slow "
        "test_rollout_function::test_a_bad_output_is_one_line_naming_the_file_and_function[*]; slow CI "
        "test_rollout_function::test_a_call_the_engine_refuses_is_one_line",
    "tests/test_hostile_inputs.py::test_an_agent_past_the_context_ends_its_episodes_without_a_traceback":
        "test_agents_e2e::test_two_steps_with_an_sdk_agent (agent path); non-slow "
        "test_agents::test_a_bad_request_reaches_the_agent_as_the_sdks_error, "
        "::test_agent_failures_are_counted_and_the_run_goes_on",
    "tests/test_hostile_inputs.py::test_a_reward_module_that_ignores_sigterm_does_not_keep_the_run_going":
        "non-slow test_hostile_inputs::test_a_stop_handler_a_plugin_replaced_is_put_back (the mechanism); "
        "test_process_lifetime::test_sigterm_to_the_launcher_saves_the_finished_step_in_one_line (stop+save)",
    "tests/test_launch_scripts.py::test_two_nodes_train":
        "test_launch_scripts::test_scancel_stops_the_job_in_one_line_per_node_and_sbatch_resumes_it (slurm.sbatch"
        " runs multi_node.sh on 2 emulated nodes, the engine synced every step); non-slow "
        "test_launch_scripts::test_slurm_sbatch_maps_the_slurm_environment_to_nodes",
    "tests/test_launch_scripts.py::test_node_killed_ends_the_other_in_time_and_relaunch_resumes":
        "test_launch_scripts::test_scancel_stops_the_job_in_one_line_per_node_and_sbatch_resumes_it (2-node stop "
        "+ resume from the checkpoint); "
        "test_kill_resume::test_kill_minus_9_and_resume; non-slow "
        "test_launcher_report::test_a_killed_rank_is_the_cause_even_when_torchrun_observed_its_peer_first",
    "tests/test_launch_scripts.py::test_node_alone_gives_up_on_the_rendezvous_in_time":
        "non-slow test_launch_scripts::test_multi_node_sh_names_a_missing_variable_in_one_line (partial); first "
        "to re-add if budget allows (14 s)",
    "tests/test_launch_scripts.py::test_single_node_sh_trains":
        "non-slow test_launch_scripts::test_single_node_sh_hands_nproc_and_overrides_to_train; every CI run of "
        "`megatron-grpo train` (test_kill_resume::test_kill_minus_9_and_resume), which single_node.sh calls",
    "tests/test_checkpoint_integrity.py::test_a_failed_save_ends_every_rank_in_one_line[common_rank0]":
        "test_checkpoint_integrity::test_a_failed_save_ends_every_rank_in_one_line[rng_rank1] (the same "
        "AgreedSave agreement), [shard_rank1] and [writer_killed_rank1] (a failure inside megatron-core's save)",
    "tests/test_checkpoint_integrity.py::test_a_failed_save_ends_every_rank_in_one_line[manager_killed_rank1]":
        "test_checkpoint_integrity::test_a_failed_save_ends_every_rank_in_one_line[writer_killed_rank1] (a "
        "process of megatron-core's writer killed with -9) and [shard_rank1]",
    "tests/test_lora_e2e.py::test_pp2_lora_run_gathers_the_stages_adapters":
        "test_lora::test_lora_step_matches_tp1[pp2], test_lora::test_peft_loads_the_exported_adapter[pp2]; NOT "
        "the gather_object to the engine",
    "tests/test_lora_e2e.py::test_tp2_lora_checkpoint_exports_at_tp1":
        "test_lora::test_peft_loads_the_exported_adapter[tp2] (TP2 adapter exported and loaded by peft)",
    "tests/test_lora_e2e.py::test_bad_lora_config_stops_before_any_rank":
        "non-slow test_lora::test_bad_lora_config_is_one_line[raw0..raw7]; "
        "test_hostile_inputs::test_rejected_by_the_command[*] (pre-flight exit 2)",
    "tests/test_offpolicy_e2e.py::test_batches_are_one_step_stale_and_the_breakdown_sums":
        "test_multi_turn_engines::test_train_on_the_real_sglang_one_step_off_policy_with_an_environment "
        "(policy_lag [0,1,1]); non-slow test_losses_off_policy",
    "tests/test_offpolicy_e2e.py::test_in_process_engine_generates_from_a_snapshot":
        "test_async_inprocess::test_async_training_on_the_inprocess_engine_keeps_the_bound (in-process engine "
        "generating beside the optimizer); non-slow "
        "test_async_inprocess::test_inprocess_sync_retracts_and_tokens_carry_their_version_and_log_prob",
    "tests/test_offpolicy_e2e.py::test_resume_mid_run_draws_each_prompt_once":
        "test_kill_resume::test_kill_minus_9_and_resume (prompts equal after resume, sync mode)",
    "tests/test_offpolicy_e2e.py::test_engine_killed_during_background_generation_is_recovered":
        "test_lora_http_sync (engine killed mid-run, restarted); "
        "test_rollout_manager::test_killed_engine_is_detected_and_restarted",
    "tests/test_tool_demo.py::test_the_tool_demo_learns_on_the_real_sglang":
        "test_multi_turn_engines::test_train_on_the_real_sglang_one_step_off_policy_with_an_environment "
        "(multi-turn training on SGLang); non-slow "
        "test_tool_demo::test_warmup_rows_are_the_episode_loops_tokens_and_never_the_answer_without_the_tool; "
        "the learning check left in CI is test_trainer_e2e::test_short_demo_learns_and_writes_everything",
    "tests/test_trainer_e2e.py::test_in_process_engine_takes_the_embedded_runs_first_steps":
        "test_kill_resume::test_kill_minus_9_and_resume (in-process killed+resumed run must equal the embedded "
        "straight run: metrics and prompts)",
    "tests/test_trainer_e2e.py::test_entropy_bonus_schedule_reaches_the_loss":
        "non-slow test_losses_config (entropy_coef_end schedule values); "
        "test_trainer_step_equivalence::test_regularized_step_matches_tp1[*] (entropy term in the loss)",
    "tests/test_agents_e2e.py::test_a_broken_agent_file_is_one_line_before_the_run":
        "non-slow "
        "test_hostile_inputs::test_rejected_by_the_command[environment_import_fails|rollout_function_import_fails]"
        " (same plug-in load path); non-slow "
        "test_agents_verifiers::test_what_one_chat_turn_cannot_score_is_refused_at_load",
    "tests/test_agents_e2e.py::test_two_steps_of_a_verifiers_taskset":
        "non-slow test_agents_verifiers::test_a_v1_taskset_trains_through_the_connector (adapter against the real "
        "library);"
        " test_two_steps_with_an_sdk_agent (agent run)",
    "tests/test_agents_e2e.py::test_an_agent_that_breaks_its_contract_stops_the_run_in_one_line":
        "non-slow test_agents::test_contract_errors_stop_the_run_in_one_line; "
        "test_hostile_inputs::test_reward_error_in_a_real_run_is_one_line_and_exit_2",
    "tests/test_distributed_pool.py::test_ranks_serve_many_calls_with_new_groups_and_sizes":
        "every pooled module in CI exercises the pool (test_trainer_step_equivalence, test_lora, ...); non-slow "
        "test_runtime_megatron_cpu::test_harness_surfaces_rank_tracebacks, "
        "::test_harness_times_out_instead_of_hanging",
    "tests/test_distributed_pool.py::test_a_calls_process_wide_changes_do_not_reach_the_next":
        "every pooled module in CI exercises the pool (test_trainer_step_equivalence, test_lora, ...); non-slow "
        "test_runtime_megatron_cpu::test_harness_surfaces_rank_tracebacks, "
        "::test_harness_times_out_instead_of_hanging",
    "tests/test_distributed_pool.py::test_a_call_under_another_environment_gets_ranks_started_under_it":
        "every pooled module in CI exercises the pool (test_trainer_step_equivalence, test_lora, ...); non-slow "
        "test_runtime_megatron_cpu::test_harness_surfaces_rank_tracebacks, "
        "::test_harness_times_out_instead_of_hanging",
    "tests/test_distributed_pool.py::test_a_failed_call_ends_the_pool_and_the_next_starts_fresh_ranks":
        "every pooled module in CI exercises the pool (test_trainer_step_equivalence, test_lora, ...); non-slow "
        "test_runtime_megatron_cpu::test_harness_surfaces_rank_tracebacks, "
        "::test_harness_times_out_instead_of_hanging",
    "tests/test_distributed_pool.py::test_a_pooled_failure_is_decided_by_fresh_processes_and_reported":
        "every pooled module in CI exercises the pool (test_trainer_step_equivalence, test_lora, ...); non-slow "
        "test_runtime_megatron_cpu::test_harness_surfaces_rank_tracebacks, "
        "::test_harness_times_out_instead_of_hanging",
    "tests/test_distributed_pool.py::test_a_call_past_its_deadline_ends_the_pool":
        "every pooled module in CI exercises the pool (test_trainer_step_equivalence, test_lora, ...); non-slow "
        "test_runtime_megatron_cpu::test_harness_surfaces_rank_tracebacks, "
        "::test_harness_times_out_instead_of_hanging",
    "tests/test_distributed_pool.py::test_pool_ranks_die_with_their_parent":
        "every pooled module in CI exercises the pool (test_trainer_step_equivalence, test_lora, ...); non-slow "
        "test_runtime_megatron_cpu::test_harness_surfaces_rank_tracebacks, "
        "::test_harness_times_out_instead_of_hanging",
    "tests/test_sampling_mask.py::test_demo_on_the_real_sglang_with_top_k_and_top_p_replays_its_sets":
        "test_sampling_mask::test_sglang_and_trainer_both_score_the_truncated_distribution (SGLang's kept sets "
        "through the client = the trainer's op)",
    "tests/test_sampling_mask.py::test_demo_with_top_p_logs_the_kept_mass_and_an_fp32_mismatch":
        "test_sampling_mask::test_engine_and_trainer_both_score_the_truncated_distribution; non-slow "
        "test_sampling_mask::test_truncated_log_probs_match_full_vocab_reference",
    "tests/test_engine_failures.py::test_launched_engine_killed_mid_run_is_restarted":
        "test_lora_http_sync::test_lora_run_on_the_launched_engine_syncs_adapters_and_resends_the_base_after_a_restart"
        " (SIGKILL at step 2, relaunch, resync); "
        "test_rollout_manager::test_killed_engine_is_detected_and_restarted",
    "tests/test_engine_failures.py::test_external_engine_down_is_a_bounded_one_line_error":
        "non-slow test_rollout_client::test_dead_server_fails_fast_with_a_clear_error; "
        "test_sync_failures::test_engine_killed_during_sync_is_reported_within_the_timeout[distributed]",
    "tests/test_multi_turn_engines.py::test_train_one_step_off_policy_with_an_environment":
        "test_train_on_the_real_sglang_one_step_off_policy_with_an_environment (identical assertions on SGLang); "
        "test_multi_turn::test_trainer_tokens_are_the_engines_tokens_plus_observations (embedded)",
    "tests/test_eval_e2e.py::test_training_evaluates_every_n_steps_on_the_engine":
        "test_smollm2_pipeline::test_two_grpo_steps_with_the_inprocess_engine (eval at start on the engine, "
        "eval/*.jsonl); test_agents_e2e::test_two_steps_with_an_sdk_agent (end-of-run eval); non-slow "
        "test_eval_metrics::test_due_steps, "
        "::test_logger_train_clock_excludes_start_up_and_evals_and_survives_resume",
    "tests/test_eval_e2e.py::test_a_resumed_run_neither_repeats_nor_skips_an_evaluation":
        "test_smollm2_pipeline::test_two_grpo_steps_with_the_inprocess_engine (eval at start on the engine, "
        "eval/*.jsonl); test_agents_e2e::test_two_steps_with_an_sdk_agent (end-of-run eval); non-slow "
        "test_eval_metrics::test_due_steps, "
        "::test_logger_train_clock_excludes_start_up_and_evals_and_survives_resume",
    "tests/test_eval_e2e.py::test_eval_cli_on_a_checkpoint_reproduces_the_training_evaluation":
        "non-slow test_checkpoint_integrity::test_eval_refuses_a_damaged_checkpoint_as_a_resume_would "
        "(resolve_weights); NOT the CLI end to end",
    "tests/test_eval_e2e.py::test_eval_cli_on_an_hf_dir_greedy_matches_transformers":
        "non-slow test_rollout_client::test_greedy_matches_hf_generate[embedded]",
    "tests/test_rollout_function.py::test_train_with_the_documented_rollout_function_and_a_broken_one":
        "test_rollout_function::test_the_documented_example_runs_on_the_real_engine, "
        "test_rollout_function::test_trainer_rows_are_the_engines_tokens_plus_observations[full]; non-slow "
        "test_rollout_function::test_a_bad_output_is_one_line_naming_the_file_and_function",
    "tests/test_zero_advantage.py::test_a_step_without_signal_skips_its_update":
        "non-slow test_zero_advantage::test_only_a_batch_of_zero_advantages_without_other_terms_has_no_gradient; "
        "test_trainer_step_equivalence::test_skipping_old_log_prob_pass_is_exact[*]",
    "tests/test_env_connectors.py::test_train_two_steps_with_a_skyrl_gym_env":
        "non-slow test_env_connectors::test_a_registered_skyrl_gym_env_answers_as_the_library_does[*] (adapter vs"
        " real library); env training: test_multi_turn_engines SGLang run",
    "tests/test_env_connectors.py::test_train_two_steps_with_an_openenv_env_whose_server_ends_with_the_run":
        "non-slow "
        "test_env_connectors::test_an_openenv_server_is_started_once_and_answers_as_the_environment_does, "
        "::test_an_openenv_server_that_dies_is_counted_restarted_and_ends_with_the_run",
    "tests/test_rollout_manager.py::test_a_configured_port_that_is_taken_is_an_error":
        "non-slow test_rollout_manager::test_launch_failure_reports_the_log",
    "tests/test_sync_failures.py::test_engine_killed_during_sync_is_reported_within_the_timeout[tensor]":
        "[distributed] (same timeout machinery); non-slow "
        "test_sync_shm::test_segments_of_a_killed_trainer_are_swept_and_foreign_paths_refused",
    "tests/test_sync_failures.py::test_sync_to_a_dead_engine_fails_fast":
        "[distributed]; non-slow test_rollout_client::test_dead_server_fails_fast_with_a_clear_error",
    "tests/test_sync_failures.py::test_a_bracket_left_open_by_an_earlier_trainer_is_closed":
        "test_sync_failures::test_a_dead_engine_does_not_leave_the_live_one_inside_the_bracket (the bracket's "
        "handling)",
    "tests/test_reasoning_workload.py::test_build_and_a_few_grpo_steps":
        "non-slow test_reasoning_workload's generator and reward tests; the CI runs of `megatron-grpo train` "
        "(test_kill_resume::test_kill_minus_9_and_resume)",
    "tests/test_router_replay.py::test_train_with_router_replay_end_to_end":
        "test_router_replay::test_trainer_replays_engine_routing_ep2[qwen3_moe] and [mixtral] (EP2 log-prob "
        "passes forced to the engine's routing); not a whole `train` run",
    "tests/test_models_convert_cli.py::test_tools_round_trip_bitwise_and_loadable_by_transformers":
        "non-slow test_models_moe::test_convert_cli_both_ways_with_self_check (same CLIs both ways, self-check); "
        "test_models_equivalence round trips",
    "tests/test_models_convert_cli.py::test_export_under_torchrun_at_pp2_writes_every_stage_into_one_index":
        "test_models_equivalence::test_multi_rank_logits_and_round_trip[pp2] (PP2 round trip in ranks); NOT the "
        "torchrun CLI",
    "tests/test_ops_triton_logprobs.py::test_tp2_matches_torch_path_and_full_vocab_reference":
        "test_tp1_matches_torch_path_and_full_vocab_reference[*] (same kernels); non-slow "
        "test_ops_vocab_parallel::test_tp2_matches_full_vocab_reference (TP2 reduction)",
    "tests/test_mixed_precision.py::test_fp32_engine_receives_the_main_weights":
        "test_sync_weights::test_sync_tp1_dp2_all_transports (the engine serves what is sent, verified); "
        "test_mixed_precision::test_bf16_step_matches_tp1[tp2]",
    "tests/test_sync_shm.py::test_shm_sync_is_bitwise_verified_and_cleaned_up":
        "test_sync_weights::test_sync_tp2_all_transports_and_corruption (tensor transport bitwise-verified, "
        "corruption caught); non-slow "
        "test_sync_shm::test_segments_of_a_killed_trainer_are_swept_and_foreign_paths_refused, "
        "test_rollout_client::test_weight_syncer_transport_against_the_server[embedded-tensor]",
    "tests/test_sync_shm.py::test_a_byte_flipped_in_the_segment_fails_verification_and_leaves_no_segment":
        "test_sync_weights::test_sync_tp2_all_transports_and_corruption (tensor transport bitwise-verified, "
        "corruption caught); non-slow "
        "test_sync_shm::test_segments_of_a_killed_trainer_are_swept_and_foreign_paths_refused, "
        "test_rollout_client::test_weight_syncer_transport_against_the_server[embedded-tensor]",
    "tests/test_sync_shm.py::test_engine_death_mid_sync_leaves_no_segment":
        "test_sync_weights::test_sync_tp2_all_transports_and_corruption (tensor transport bitwise-verified, "
        "corruption caught); non-slow "
        "test_sync_shm::test_segments_of_a_killed_trainer_are_swept_and_foreign_paths_refused, "
        "test_rollout_client::test_weight_syncer_transport_against_the_server[embedded-tensor]; "
        "test_sync_failures::...[distributed]",
    "tests/test_models_moe.py::test_multi_rank_logits_and_round_trip[ep2]":
        "non-slow test_models_moe::test_tp1_logits_and_round_trip[*] (both archs); "
        "test_moe_trainer::test_ep2_step_matches_ep1 (EP2 model in the trainer)",
    "tests/test_models_moe.py::test_multi_rank_logits_and_round_trip[pp2]":
        "non-slow test_models_moe::test_tp1_logits_and_round_trip[*] (both archs); "
        "test_moe_trainer::test_ep2_step_matches_ep1 (EP2 model in the trainer); test_models_equivalence [pp2]",
    "tests/test_models_moe.py::test_multi_rank_logits_and_round_trip[tp2-etp1]":
        "non-slow test_models_moe::test_tp1_logits_and_round_trip[*] (both archs); "
        "test_moe_trainer::test_ep2_step_matches_ep1 (EP2 model in the trainer)",
    "tests/test_models_moe.py::test_multi_rank_logits_and_round_trip[tp2xep2]":
        "non-slow test_models_moe::test_tp1_logits_and_round_trip[*] (both archs); "
        "test_moe_trainer::test_ep2_step_matches_ep1 (EP2 model in the trainer)",
    "tests/test_multi_turn_parallel.py::test_multi_turn_step_matches_tp1[token_mean-tp2pp2]":
        "[token_mean-tp2], [token_mean-pp2]; "
        "test_models_equivalence::test_tp2xpp2_and_checkpoints_reshard_to_and_from_tp1",
    "tests/test_multi_turn_parallel.py::test_multi_turn_step_matches_tp1[seq_mean-tp2]":
        "test_multi_turn_parallel::test_tp1_loss_is_the_hand_computation_over_model_tokens[seq_mean_token_mean], "
        "test_multi_turn_parallel::test_multi_turn_step_matches_tp1[token_mean-tp2]",
    "tests/test_vpp.py::test_pp2_vpp2_logits_round_trip_and_checkpoints":
        "test_lora::test_lora_step_with_virtual_pipeline_and_recomputation[pp2xvpp2] (PP2xVPP2 step = TP1 through"
        " the interleaved schedule); non-slow test_vpp config checks",
    "tests/test_vpp.py::test_vpp2_step_matches_pp2":
        "test_lora::test_lora_step_with_virtual_pipeline_and_recomputation[pp2xvpp2] (PP2xVPP2 step = TP1 through"
        " the interleaved schedule); non-slow test_vpp config checks",
    "tests/test_vpp.py::test_sync_from_vpp2_ranks_engine_logprobs_match":
        "test_lora::test_lora_step_with_virtual_pipeline_and_recomputation[pp2xvpp2] (PP2xVPP2 step = TP1 through"
        " the interleaved schedule); non-slow test_vpp config checks; "
        "test_sync_weights::test_sync_pp2_tied_embeddings_all_transports",
    "tests/test_moe_trainer.py::test_sync_from_ep2_ranks_engine_logprobs_match":
        "test_ep2_step_matches_ep1; test_sync_weights::* (sync path); non-slow "
        "test_quantized_rollouts::test_sync_into_quantized_engine_checksums_what_was_sent",
    "tests/test_multi_turn_e2e.py::test_two_steps_with_an_environment_log_the_multi_turn_metrics":
        "test_multi_turn_engines::test_train_on_the_real_sglang_one_step_off_policy_with_an_environment (same "
        "metrics asserted); test_agents_e2e::test_two_steps_with_an_sdk_agent (same episode shape, eval episodes)",
    "tests/test_bench_gpu.py::test_smoke_writes_each_part_and_a_rerun_skips_the_finished_ones":
        "non-slow test_bench_gpu's tests of its configs, its exit without CUDA and its kernel rows "
        "(test_bench_gpu::test_kernel_rows_report_their_difference_from_the_torch_op_with_the_same_settings)",
    "tests/test_launcher_report.py::test_a_rank_killed_from_outside_ends_the_run_in_one_line":
        "non-slow "
        "test_launcher_report::test_a_killed_rank_is_the_cause_even_when_torchrun_observed_its_peer_first (torch "
        "2.13's captured report); test_hostile_inputs::test_reward_error_in_a_real_run_is_one_line_and_exit_2 "
        "(torchrun report + peer traceback hidden); test_process_lifetime kills (nothing left)",
    "tests/test_flops.py::test_a_shrunk_sized_model_loads_in_the_converter":
        "non-slow test_flops's shape and count tests; "
        "test_models_equivalence::test_multi_rank_logits_and_round_trip[pp2] (the converter)",
    "tests/test_runtime_megatron_cpu.py::test_tp2_pp2_loss_equals_tp1":
        "test_trainer_step_equivalence::test_step_matches_tp1[tp2|pp2]; "
        "test_models_equivalence::test_tp2xpp2_and_checkpoints_reshard_to_and_from_tp1",
    "tests/test_recompute.py::test_recomputed_step_equals_the_plain_step_at_tp2":
        "test_lora::test_lora_step_with_virtual_pipeline_and_recomputation[tp2-recompute] (recomputation at TP2 ="
        " TP1 step); NOT the forward-twice count",
    "tests/test_ops_vocab_parallel.py::test_tp4_matches_full_vocab_reference_with_padding_only_rank":
        "non-slow test_ops_vocab_parallel::test_tp2_matches_full_vocab_reference; "
        "test_ops_triton_logprobs::test_tp1_matches_torch_path_and_full_vocab_reference[padding_only_rank]",
}
