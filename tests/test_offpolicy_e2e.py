"""`rollout.mode: one_step_off_policy` in real runs of `megatron-grpo train` (TP=2 on 2 gloo
ranks + the embedded engine): the engine's weight version of every trained batch after the
first is one step behind, a resume in the middle draws exactly the prompts an uninterrupted
run draws, and an engine killed during the background generation is restarted and the batch
regenerated. The sync mode's side of the same checks is in tests/test_trainer_e2e.py."""

import shutil
import subprocess

import pytest

from megatron_grpo.trainer.step_timer import PHASES
from tests.support.demo_run import ENV, ROOT, kill_engine_after, read_metrics, train_cmd

OFF = "rollout.mode=one_step_off_policy"


def cmd(demo, run_dir, steps, *extra):
    return train_cmd(demo, run_dir, steps, OFF, "logging.plot=false", "eval.every_n_steps=0", *extra)


def run(command, timeout=600):
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def straight(demo, tmp_path_factory):
    """An uninterrupted 6-step off-policy run with a checkpoint every 2 steps (all kept)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    run(cmd(demo, run_dir, 6, "checkpoint.save_every=2", "checkpoint.keep_last=3"))
    return run_dir


@pytest.mark.slow
def test_batches_are_one_step_stale_and_the_breakdown_sums(straight):
    rows = read_metrics(straight)
    assert [r["step"] for r in rows] == list(range(1, 7))
    # the engine's own report: step s (1-based) trains on a batch of weight version s-2
    # (version v = the weights after v steps), the first step on version 0
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 1, 2, 3, 4]
    assert [r["rollout/policy_lag"] for r in rows] == [0, 1, 1, 1, 1, 1]
    # stale samples: rho = pi_old / mu departs from 1 (fp32 rounding alone gives ~1e-7)
    assert max(abs(r["is_ratio_mean"] - 1) for r in rows[1:]) > 1e-4
    assert abs(rows[0]["is_ratio_mean"] - 1) < 1e-4
    for r in rows:
        parts = sum(r[f"time/{p}_s"] for p in PHASES)
        assert abs(parts - r["time/step_s"]) < 1e-6, r
        assert min(r[f"time/{p}_s"] for p in PHASES) >= 0
    # after the first step the batch was generated in the background: no in-order generation
    assert all(r["time/generate_s"] < rows[0]["time/generate_s"] for r in rows[1:])


@pytest.mark.slow
def test_in_process_engine_generates_from_a_snapshot(demo, straight, tmp_path):
    """The in-process engine generates step s+1's batch while the optimizer changes the
    trainer's weights: it must sample from its own copy of the synced weights, so the run equals
    the launched engine's, metric for metric."""
    from tests.support.kill_resume import COMPARED

    run_dir = tmp_path / "run"
    run(cmd(demo, run_dir, 6, "checkpoint.save_every=2", "checkpoint.keep_last=3", "engine.kind=inprocess"))
    mine, launched = read_metrics(run_dir), read_metrics(straight)
    assert [r["rollout/weight_version"] for r in mine] == [0, 0, 1, 2, 3, 4]
    assert [r["rollout/prompt_indices"] for r in mine] == [r["rollout/prompt_indices"] for r in launched]
    for key in COMPARED:  # the engines' log-probs differ by fp32 rounding (threads), the samples not at all
        assert [r[key] for r in mine] == pytest.approx([r[key] for r in launched], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_resume_mid_run_draws_each_prompt_once(demo, straight, tmp_path):
    # resume from the step-2 checkpoint, written while step 3's batch was already drawn
    saved = tmp_path / "step_000002"
    shutil.copytree(straight / "checkpoints" / "step_000002", saved)
    run_dir = tmp_path / "run"
    run(cmd(demo, run_dir, 6, "checkpoint.save_every=2", f"checkpoint.resume={saved}"))
    resumed = read_metrics(run_dir)
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    expected = [r["rollout/prompt_indices"] for r in read_metrics(straight)[2:]]
    assert [r["rollout/prompt_indices"] for r in resumed] == expected
    # the first batch after the resume is generated in order by the resumed weights
    assert [r["rollout/policy_lag"] for r in resumed] == [0, 1, 1, 1]


@pytest.mark.slow
def test_engine_killed_during_background_generation_is_recovered(demo, tmp_path):
    run_dir = tmp_path / "run"
    # 32 prompts x 16 one sequence at a time: a background generation long enough (512 forward
    # passes, a second or more) to be hit; in full batches it took ~0.3 s once the HTTP path was
    # cut, and the kill could land after it
    proc = subprocess.Popen(cmd(demo, run_dir, 5, "checkpoint.save_every=0", "rollout.prompts_per_step=32",
                                "engine.embedded.max_batch_size=1",
                                "engine.request_timeout_s=20", "engine.max_retries=2"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    # step 3 starts right after step 2's entry and sends step 4's prompts to the engine
    err = kill_engine_after(proc, run_dir, 2, settle_s=0.1)
    assert proc.returncode == 0, err[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 6))
    assert rows[-1]["engine_restarts"] == 1
    # step 4's batch failed in the background and was regenerated after the restart with the
    # trainer's current weights (which the engine reports): lag 0 there, 1 elsewhere
    assert [r["rollout/policy_lag"] for r in rows] == [0, 1, 1, 0, 1]
    assert "generation failed (attempt 1 of" in err
