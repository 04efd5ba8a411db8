"""The whole pipeline, really started: `megatron-grpo train` on the demo task (TP=2 on 2 gloo
ranks + the embedded rollout engine + distributed weight sync; and the same with the in-process
engine and its in-memory sync). Kill -9 and resume are in tests/test_kill_resume.py."""

import subprocess

import pytest

from tests.demo_run import ENV, ROOT, make_demo, read_metrics, train_cmd


@pytest.fixture(scope="module")
def demo_inputs(tmp_path_factory):
    return make_demo(tmp_path_factory.mktemp("demo"))


def run_train(cmd, timeout=600):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["embedded", "inprocess"])
def test_short_demo_learns_and_writes_everything(demo_inputs, tmp_path, engine):
    run_dir = tmp_path / "run"
    # a faster schedule than the full demo's, so that 60 steps show learning
    out = run_train(train_cmd(demo_inputs, run_dir, 60, "checkpoint.save_every=30", "optimizer.lr=2e-3",
                              "optimizer.lr_decay_style=constant", f"rollout.engine={engine}"))
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 61))
    first = sum(r["reward_mean"] for r in rows[:15]) / 15
    last = sum(r["reward_mean"] for r in rows[-15:]) / 15
    assert first < 0.2 and last > first + 0.05, (first, last)  # measured: 0.088 -> 0.164
    for key in ("reward_mean", "loss", "clip_ratio", "ppo_kl", "entropy", "rollout_train_logprobs_abs_diff_mean",
                "time/generate_s", "time/reward_s", "time/logprob_s", "time/train_s", "time/sync_s",
                "time/idle_s", "time/step_s", "tokens_per_s"):
        assert key in rows[0], key
    # rollout.mode: sync (the default): the engine samples step s with the weights after s-1 steps
    assert [r["rollout/weight_version"] for r in rows] == list(range(60))
    assert all(r["rollout/policy_lag"] == 0 and r["time/idle_s"] < 1e-3 for r in rows)
    phases = ("generate", "reward", "logprob", "train", "idle", "sync", "eval", "other")
    assert all(abs(sum(r[f"time/{p}_s"] for p in phases) - r["time/step_s"]) < 1e-6 for r in rows)
    # the trainer scores exactly what the engine sampled: fp32 mismatch is rounding noise
    assert max(r["rollout_train_logprobs_abs_diff_mean"] for r in rows) < 1e-4
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000060"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_000030", "step_000060"]
    assert (ckpts / "step_000060" / "COMPLETE").is_file()
    assert (run_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "config.yaml").is_file()
    assert "reward_mean" in out.stdout  # the summary table
