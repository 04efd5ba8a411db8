"""The whole pipeline, really started: `megatron-grpo train` on the demo task (TP=2 on 2 gloo
ranks + the embedded rollout engine + distributed weight sync) learns and writes everything; the
in-process engine (its in-memory sync) reproduces that run's first steps. Kill -9 and resume are
in tests/test_kill_resume.py."""

import subprocess

import pytest

from megatron_grpo.trainer.step_timer import PHASES

from tests.support.demo_run import ENV, ROOT, read_metrics, train_cmd

# a faster schedule than the full demo's, so that 60 steps show learning (constant: a shorter
# run with the same overrides takes the same first steps)
SCHEDULE = ("optimizer.lr=2e-3", "optimizer.lr_decay_style=constant")


@pytest.fixture(scope="module")
def learned(demo, tmp_path_factory):
    """The embedded engine's 60-step run on the session's demo model (tests/conftest.py: the
    demo's format warm-up, 20 steps; it starts at chance as the README's 60-step one does):
    (its run directory, its stdout)."""
    run_dir = tmp_path_factory.mktemp("embedded") / "run"
    out = run_train(train_cmd(demo, run_dir, 60, "checkpoint.save_every=30", *SCHEDULE))
    return run_dir, out.stdout


def run_train(cmd, timeout=600):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def check_outputs(run_dir, stdout: str, steps: int, saved: list[int]) -> list[dict]:
    """What every run writes, and the invariants of every `sync`-mode record; returns the records."""
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for key in ("reward_mean", "loss", "clip_ratio", "ppo_kl", "entropy", "rollout_train_logprobs_abs_diff_mean",
                "time/generate_s", "time/reward_s", "time/logprob_s", "time/train_s", "time/sync_s",
                "time/idle_s", "time/step_s", "tokens_per_s"):
        assert key in rows[0], key
    # rollout.mode: sync (the default): the engine samples step s with the weights after s-1 steps
    assert [r["rollout/weight_version"] for r in rows] == list(range(steps))
    assert all(r["rollout/policy_lag"] == 0 and r["time/idle_s"] < 1e-3 for r in rows)
    assert all(abs(sum(r[f"time/{p}_s"] for p in PHASES) - r["time/step_s"]) < 1e-6 for r in rows)
    # the trainer scores exactly what the engine sampled: fp32 mismatch is rounding noise
    assert max(r["rollout_train_logprobs_abs_diff_mean"] for r in rows) < 1e-4
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{saved[-1]:06d}"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == [f"step_{s:06d}" for s in saved]
    assert (ckpts / f"step_{saved[-1]:06d}" / "COMPLETE").is_file()
    assert (run_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "config.yaml").is_file()
    assert "reward_mean" in stdout  # the summary table
    return rows


@pytest.mark.slow
def test_short_demo_learns_and_writes_everything(learned):
    run_dir, stdout = learned
    rows = check_outputs(run_dir, stdout, 60, [30, 60])
    first = sum(r["reward_mean"] for r in rows[:15]) / 15
    last = sum(r["reward_mean"] for r in rows[-15:]) / 15
    assert first < 0.2 and last > first + 0.05, (first, last)  # measured: 0.099 -> 0.173 (micro-batches of 64)


@pytest.mark.slow
def test_in_process_engine_takes_the_embedded_runs_first_steps(learned, demo, tmp_path):
    """The in-process engine is the embedded engine's generation code in rank 0, synced in
    memory instead of over HTTP: with the same seed it samples the same tokens (identical
    rewards), and the loss, which reads the engine's log-probs, differs only by fp32 rounding
    (the two batch the engine's forwards differently; measured ~1e-8). So the embedded run's
    learning above is the in-process engine's too, at a seventh of the cost."""
    run_dir = tmp_path / "run"
    steps = 8
    out = run_train(train_cmd(demo, run_dir, steps, "checkpoint.save_every=30", *SCHEDULE,
                              "engine.kind=inprocess"))
    rows = check_outputs(run_dir, out.stdout, steps, [steps])
    embedded = read_metrics(learned[0])[:steps]
    assert [r["rollout/prompt_indices"] for r in rows] == [r["rollout/prompt_indices"] for r in embedded]
    assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in embedded]
    assert [r["response_length_mean"] for r in rows] == [r["response_length_mean"] for r in embedded]
    for key in ("loss", "grad_norm", "entropy", "ppo_kl"):
        assert all(abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(b[key])) for a, b in zip(rows, embedded)), key


@pytest.mark.slow
def test_static_decode_takes_the_embedded_runs_first_steps(learned, demo, tmp_path):
    """``engine.embedded.decode: static`` in a real run: the launched engine (`megatron-grpo serve
    --decode static`) decodes in static buffers and reads the tokens every 3 draws, and with the
    same seed samples what the eager engine sampled (the same rewards and lengths), every sync
    passing the probe. (On CPU there are no CUDA graphs; the path is otherwise the GPU's.)"""
    run_dir = tmp_path / "run"
    steps = 4
    out = run_train(train_cmd(demo, run_dir, steps, "checkpoint.save_every=30", *SCHEDULE,
                              "engine.embedded.decode=static", "engine.embedded.stop_check_every=3"))
    rows = check_outputs(run_dir, out.stdout, steps, [steps])
    assert "(decode: static, the host reads the tokens every 3;" in (run_dir / "rollout" / "server.log").read_text()
    embedded = read_metrics(learned[0])[:steps]
    assert [r["rollout/prompt_indices"] for r in rows] == [r["rollout/prompt_indices"] for r in embedded]
    assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in embedded]
    assert [r["response_length_mean"] for r in rows] == [r["response_length_mean"] for r in embedded]
    for key in ("loss", "grad_norm"):
        assert all(abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(b[key])) for a, b in zip(rows, embedded)), key


@pytest.mark.slow
def test_entropy_bonus_schedule_reaches_the_loss(demo, tmp_path):
    """``algorithm.entropy_coef_end``: each step's loss carries that step's weight. The demo's
    answer is one token and its mini-batches hold whole groups (generation order): the policy
    term is the token mean of -A * ratio, which is 0 per group at ratio 1 and stays within a
    few 1e-3 of it here (measured: |loss + weight * entropy| <= 0.005 with entropy ~2.4), so
    the loss is -weight * entropy to well within the 0.12 that separates the three weights."""
    run_dir = tmp_path / "run"
    out = run_train(train_cmd(demo, run_dir, 3, "algorithm.entropy_coef=0.1",
                              "algorithm.entropy_coef_end=0.0", "engine.kind=inprocess"))
    rows = check_outputs(run_dir, out.stdout, 3, [3])
    assert [r["entropy_coef"] for r in rows] == pytest.approx([0.1, 0.05, 0.0], abs=1e-12)
    for r in rows:
        assert abs(r["loss"] + r["entropy_coef"] * r["entropy"]) < 0.02, r
