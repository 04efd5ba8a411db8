"""The GRPO loop. One step, read top to bottom:

1. rank 0 draws prompts, the rollout engine samples ``num_generations`` responses each
   (token ids + the engine's log-probs), rewards are scored and group-normalised into
   advantages; the TrainBatch is broadcast to every rank. With ``rollout.mode:
   one_step_off_policy`` the next step's batch is then generated in the background while this
   step trains, and waited for before the sync (``trainer/rollouts.py``);
2. each DP rank takes its rows; old-policy (and, with a KL loss, reference) log-probs are
   recomputed by Megatron in forward-only mode with the vocab-parallel op;
3. for ``num_iterations`` epochs, every mini-batch is one optimizer step of the corrected
   GRPO loss (``megatron_step.train_mini_batch``);
4. the new weights are resharded into the rollout engine (``sync``); when due
   (``eval.every_n_steps``, the last step) rank 0 evaluates the held-out sets on the engine,
   which now serves these weights, in rounds the other ranks wait for one at a time; then
   metrics are logged and a checkpoint is written when due. An evaluation belongs to its
   step's metrics entry and happens before that step's checkpoint, so a resumed run neither
   repeats nor skips one.

Every rank runs this function (torchrun); rank 0 also owns the engine, data and logging.
"""

from __future__ import annotations

from pathlib import Path

import yaml
import torch.distributed as dist

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.evaluation import Evaluator
from megatron_grpo.runtime.files import write_text_atomic
from megatron_grpo.trainer import checkpoint as ckpt
from megatron_grpo.trainer.batch import dp_shard, mini_batch_order
from megatron_grpo.runtime.collectives import RunAborted, broadcast
from megatron_grpo.trainer.engine_guard import EngineGuard
from megatron_grpo.models.tokenizer import load_tokenizer
from megatron_grpo.trainer.components import build_policy, build_reference, build_rollout_side
from megatron_grpo.trainer.megatron_step import (ScoringSpec, compute_log_probs, old_log_probs_needed,
                                                 probe_log_probs, train_mini_batch)
from megatron_grpo.trainer.moe_metrics import RouterLoad
from megatron_grpo.trainer.optim import lr_at, set_lr
from megatron_grpo.trainer.rollout_step import generate_and_score
from megatron_grpo.trainer.rollouts import RolloutSchedule
from megatron_grpo.trainer.router_replay import RoutingReplay
from megatron_grpo.trainer.step_timer import StepTimer


class NonFiniteError(RunAborted):
    """Too many consecutive steps had a non-finite loss or gradient."""


def train(cfg: ExperimentConfig) -> list[dict]:
    """Run the experiment; returns rank 0's metric records (empty on other ranks)."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.data import PromptSampler, load_prompt_dataset
    from megatron_grpo.metrics_log import MetricsLogger
    from megatron_grpo.sync.syncer import WeightSyncer

    rank, run_dir = dist.get_rank(), cfg.trainer.run_dir
    dp, dp_rank, dp_group = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ps.get_data_parallel_group()
    tokenizer = load_tokenizer(cfg.model.hf_dir)
    sampler = PromptSampler(load_prompt_dataset(cfg.data, tokenizer), cfg.rollout.prompts_per_step,
                            cfg.trainer.seed, cfg.data.shuffle)
    policy = build_policy(cfg)
    routing = RoutingReplay(policy.modules, replay=True) if cfg.algorithm.router_replay else None  # MoE only
    reference = build_reference(cfg, policy.hf_config)
    spec = ScoringSpec(cfg.rollout.temperature, policy.hf_config.vocab_size, cfg.model.logprob_chunk_size)

    start_step, trainer_state = 0, {}
    resume_dir = ckpt.find_resume_dir(run_dir, cfg.checkpoint.resume)
    if resume_dir is not None:
        trainer_state = ckpt.load_training_checkpoint(resume_dir, policy.modules, policy.optimizer)
        start_step = trainer_state["step"]
        sampler.load_state_dict(trainer_state["sampler"])
        if rank == 0:
            print(f"[megatron-grpo] {resume_dir}: resumed from checkpoint step {start_step}", flush=True)
    logger = MetricsLogger(run_dir, cfg.logging, cfg.trainer.num_steps, rank,
                           resumed_step=start_step, config_dict=cfg.to_dict())
    if rank == 0:
        write_text_atomic(Path(run_dir) / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    side = build_rollout_side(cfg, tokenizer, sampler) if rank == 0 else None
    evaluator = (Evaluator(cfg, tokenizer, side.client, side.scorer, side.sampling)
                 if side is not None and cfg.eval.sets else None)
    urls = broadcast(side.manager.urls if side else None)
    syncer = WeightSyncer(cfg.rollout, urls, policy.hf_config, work_dir=f"{run_dir}/weight_sync",
                          client=side.client if side else None,
                          probe=lambda tokens: probe_log_probs(policy.chunks, tokens, spec))
    engine = EngineGuard(side, syncer, policy.modules, max_attempts=cfg.rollout.max_restarts + 1,
                         colocate=cfg.rollout.colocate)
    engine.sync(start_step)  # the engine starts from the HF weights
    generate = (lambda step, prompts: generate_and_score(step, prompts, side.client, side.sampling, side.scorer,
                                                         side.tokenizer, cfg,
                                                         more_prompts=side.sampler.next_batch)) if side else None
    rollouts = RolloutSchedule(cfg.rollout.mode, engine, side.sampler if side else None, generate,
                               cfg.trainer.num_steps)

    records, nonfinite_streak = [], trainer_state.get("nonfinite_streak", 0)
    logger.begin_training()
    try:
        for step in range(start_step, cfg.trainer.num_steps):
            timer = StepTimer()
            # 1. rollout + rewards + advantages (rank 0), broadcast (a few MB; the weights
            # dominate traffic); off-policy mode: step+1's generation starts in the background
            result, in_order = rollouts.batch_for(step)
            engine.release_memory()  # colocated: the GPU is the trainer's until the sync
            batch = result.batch
            timer.lap("generate")
            if in_order:  # the scoring was part of that wait (rank 0's; the others wait in the broadcast)
                timer.move(result.stats["rollout/reward_s"], "generate", "reward")

            # 2. old-policy / reference log-probs on this DP rank's rows
            if cfg.algorithm.shuffle_mini_batches:
                order = mini_batch_order(batch.num_sequences, cfg.parallel.global_batch_size, cfg.trainer.seed, step)
                batch = batch if order is None else batch.select(order)
            local = dp_shard(batch, dp_rank, dp, cfg.parallel.global_batch_size)
            budget = cfg.parallel.max_tokens_per_microbatch
            moe_metrics = {}
            if old_log_probs_needed(cfg.algorithm.num_iterations, batch.num_sequences // cfg.parallel.global_batch_size):
                router_load = RouterLoad(policy.modules)  # counted where the pass runs: pi_old's routing
                local.old_log_probs = compute_log_probs(policy.chunks, local, cfg.parallel.micro_batch_size, spec,
                                                        budget, router_load=router_load if router_load.active else None,
                                                        routing=routing)
                moe_metrics = router_load.metrics(cfg.parallel.sequence_parallel)  # collective; {} if dense
                if routing is not None:  # the policy that generated: engine vs trainer routing
                    moe_metrics.update(routing.take_metrics())
            if reference is not None:
                local.ref_log_probs = compute_log_probs(reference, local, cfg.parallel.micro_batch_size, spec, budget)
            timer.lap("logprob")

            # 3. num_iterations epochs of mini-batch updates
            step_metrics, skipped = [], 0
            local_per_mini = cfg.parallel.global_batch_size // dp
            global_minis = [batch.select(slice(m, m + cfg.parallel.global_batch_size))
                            for m in range(0, batch.num_sequences, cfg.parallel.global_batch_size)]
            for it in range(cfg.algorithm.num_iterations):
                for m, gmini in enumerate(global_minis):
                    opt_step = (step * cfg.algorithm.num_iterations + it) * len(global_minis) + m
                    set_lr(policy.optimizer, lr_at(opt_step, cfg.optimizer, cfg.trainer.num_steps
                                                   * cfg.algorithm.num_iterations * len(global_minis)))
                    mini = local.select(slice(m * local_per_mini, (m + 1) * local_per_mini))
                    metrics, applied, grad_norm = train_mini_batch(
                        policy.chunks, policy.optimizer, mini, cfg.algorithm, spec,
                        cfg.parallel.micro_batch_size, int(gmini.loss_mask.sum()), gmini.num_sequences,
                        dp, dp_group, budget, routing=routing)
                    skipped += not applied
                    if metrics is not None:
                        step_metrics.append({**metrics, "grad_norm": grad_norm, "iteration": it})
            timer.lap("train")
            if routing is not None:  # without an old-log-prob pass: the (single) update's forward
                for key, value in routing.take_metrics().items():  # collective; restarts the count
                    moe_metrics.setdefault(key, value)

            # 4. (off-policy: wait for step+1's batch, the engine must be idle) weights -> rollout
            # engine, evaluation, metrics, checkpoint
            rollouts.collect_next(step)
            timer.lap("idle")
            sync_stats = engine.sync(step + 1)
            timer.lap("sync")
            eval_metrics = {}
            if cfg.eval.due(step + 1, cfg.trainer.num_steps):
                eval_metrics = evaluate(step + 1, engine, evaluator, Path(run_dir) / "eval")
            eval_s = timer.lap("eval")
            nonfinite_streak = nonfinite_streak + 1 if skipped else 0
            record = _step_record(step, result.stats, step_metrics, skipped, policy.optimizer)
            record["engine_restarts"] = engine.restarts
            record["weight_sync_verified"] = int(sync_stats.verified)
            if sync_stats.probe_logprob_abs_diff is not None:
                record["weight_sync_probe_logprob_abs_diff"] = sync_stats.probe_logprob_abs_diff
            record.update(moe_metrics)
            record.update(eval_metrics)
            record.update(timer.finish())
            # training throughput: evaluation time is not the step's work
            record["tokens_per_s"] = float(batch.loss_mask.sum()) / max(record["time/step_s"] - eval_s, 1e-9)
            if rank == 0:
                records.append(logger.log(step + 1, record, excluded_s=eval_s))
            if nonfinite_streak >= cfg.trainer.max_consecutive_nonfinite:
                raise NonFiniteError(
                    f"step {step + 1}: non-finite loss or gradient in {nonfinite_streak} consecutive steps "
                    f"(trainer.max_consecutive_nonfinite={cfg.trainer.max_consecutive_nonfinite}); "
                    "lower optimizer.lr or check the data and rewards")
            done = step + 1 == cfg.trainer.num_steps
            every = cfg.checkpoint.save_every
            if done or (every and (step + 1) % every == 0):
                # rank 0's sampler is the one that advanced: every rank saves its state
                state = broadcast({"step": step + 1, "sampler": rollouts.sampler_state() if rank == 0 else None,
                                    "nonfinite_streak": nonfinite_streak})
                ckpt.save_training_checkpoint(run_dir, step + 1, policy.modules, policy.optimizer, state,
                                              cfg.checkpoint.keep_last)
        logger.finish(print_summary=True)
    finally:
        rollouts.close()  # before the engine and its client go
        logger.close()
        syncer.close()
        if side is not None:
            side.close()
    return records


def evaluate(step: int, engine: EngineGuard, evaluator, out_dir: Path) -> dict:
    """Collective: rank 0 evaluates every held-out set on the engine's current weights (those
    of ``step``), one round at a time; every rank waits only for one round in a broadcast
    (``engine.rollout``, which also recovers a failed engine). Returns the ``eval/...``
    metrics on rank 0 (empty elsewhere) and writes the scored responses under ``out_dir``."""
    rounds = broadcast(evaluator.rounds() if evaluator is not None else None)
    results = [engine.rollout(step, lambda r=r: evaluator.run_round(step, r)) for r in rounds]
    if evaluator is None:
        return {}
    evaluator.write_samples(out_dir, step, results)
    return evaluator.summarize(results)


def _step_record(step, rollout_stats, step_metrics, skipped, optimizer) -> dict:
    """Rank 0's metrics of a step: rollout stats, the last-iteration training metrics (sent
    from the reporting last-stage rank), lr, and skipped updates."""
    from megatron.core import parallel_state as ps

    reporter = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_data_parallel_rank() == 0)
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, _mean_over_minibatches(step_metrics) if reporter else None)
    train_metrics = next(m for m in box if m is not None)
    record = {**rollout_stats, **train_metrics}
    record["lr"] = float(optimizer.param_groups[0]["lr"])
    record["skipped_updates"] = skipped
    return record


def _mean_over_minibatches(parts: list[dict]) -> dict:
    """Pool the optimizer-step metrics of one step (mini-batches x iterations) with the loss
    package's rules (token-weighted, max of *_max, ...); loss and grad_norm are means over
    optimizer steps. With num_iterations > 1 the last iteration's clip/KL are also reported
    (``key/last_iter``): that is where clipping acts."""
    from megatron_grpo.losses import reduce_metrics

    def pool(rows: list[dict]) -> dict:
        per_step = ("loss", "grad_norm", "iteration")
        out = reduce_metrics([{k: v for k, v in r.items() if k not in per_step} for r in rows])
        out["loss"] = sum(r["loss"] for r in rows) / len(rows)
        out["grad_norm"] = sum(r["grad_norm"] for r in rows) / len(rows)
        out["padding_fraction"] = 1.0 - out["num_sequence_tokens"] / max(out["num_padded_tokens"], 1.0)
        return out

    out = pool(parts)
    last_it = max(p["iteration"] for p in parts)
    if last_it > 0:
        last = pool([p for p in parts if p["iteration"] == last_it])
        out.update({f"{k}/last_iter": last[k] for k in ("loss", "clip_ratio", "ppo_kl", "pg_clipfrac_lower")})
    return out
