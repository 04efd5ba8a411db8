"""The whole pipeline, really started: `megatron-grpo train` on the demo task (TP=2 on 2 gloo
ranks + the embedded rollout engine + distributed weight sync). Kill -9 and resume are in
tests/test_kill_resume.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def demo_inputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    subprocess.run([sys.executable, "tools/make_demo_model.py", "--out", str(out), "--warmup-steps", "100"],
                   cwd=ROOT, check=True, capture_output=True)
    return out


def train_cmd(demo: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megatron_grpo.cli", "train", "--config", "yaml_configs/demo_cpu.yaml",
            f"model.hf_dir={demo / 'model'}", f"data.train_file={demo / 'arithmetic.jsonl'}",
            f"trainer.run_dir={run_dir}", f"trainer.num_steps={steps}", "logging.progress_bar=false", *extra]


def run_train(cmd, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_short_demo_learns_and_writes_everything(demo_inputs, tmp_path):
    run_dir = tmp_path / "run"
    out = run_train(train_cmd(demo_inputs, run_dir, 40, "checkpoint.save_every=20", "optimizer.lr=2e-3"))
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 41))
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert last > first + 0.05, (first, last)
    for key in ("reward_mean", "loss", "clip_ratio", "ppo_kl", "entropy", "rollout_train_logprobs_abs_diff_mean",
                "time_rollout_s", "time_logprob_s", "time_train_s", "time_sync_s", "tokens_per_s"):
        assert key in rows[0], key
    # the trainer scores exactly what the engine sampled: fp32 mismatch is rounding noise
    assert max(r["rollout_train_logprobs_abs_diff_mean"] for r in rows) < 1e-4
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000040"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_000020", "step_000040"]
    assert (ckpts / "step_000040" / "COMPLETE").is_file()
    assert (run_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "config.yaml").is_file()
    assert "reward_mean" in out.stdout  # the summary table
