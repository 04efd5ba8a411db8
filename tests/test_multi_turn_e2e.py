"""A short `megatron-grpo train` run with multi-turn episodes (TP=2 on 2 gloo ranks + the
embedded engine): the environment's observations are in the trained sequences and the
multi_turn/* metrics reach metrics.jsonl."""

import subprocess

import pytest

from tests.demo_run import ENV, NUDGE, ROOT, read_metrics, train_cmd

@pytest.mark.slow
def test_two_steps_with_an_environment_log_the_multi_turn_metrics(demo, tmp_path):
    env_file = tmp_path / "nudge.py"
    env_file.write_text(NUDGE)
    run_dir = tmp_path / "run"
    cmd = train_cmd(demo, run_dir, 2, f"rollout.environment={env_file}:Nudge",
                    "rollout.multi_turn.observation_role=user", "rollout.multi_turn.max_turns=3",
                    "rollout.multi_turn.max_episode_tokens=64",
                    "rollout.prompts_per_step=4", "rollout.num_generations=4", "parallel.global_batch_size=16",
                    "parallel.micro_batch_size=8", "eval.every_n_steps=0", "logging.plot=false")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["multi_turn/turns_mean"] == 2 and r["multi_turn/turns_max"] == 2
        # "<|user|> please reply with only a number <|assistant|>" after each first turn, plus the
        # template's <eos> when the turn was cut for length (max_new_tokens 1) rather than ended by it
        assert 8 <= r["multi_turn/observation_tokens_mean"] <= 9
        assert r["multi_turn/model_tokens_mean"] == 2
        assert r["multi_turn/env_errors"] == 0 and r["multi_turn/env_timeouts"] == 0
        assert r["multi_turn/env_s"] > 0 and r["multi_turn/generate_s"] > 0
        # only the model's tokens are trained: 2 per sequence, 16 sequences
        assert r["num_valid_tokens"] == 32
