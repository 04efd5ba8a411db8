"""`megatron-grpo train` at ``parallel.cp=2`` is the CP1 run, step for step, and checkpoints do
not depend on cp: the demo (in-process engine) trained 3 steps at CP1 (one rank) and at CP2 (two
ranks, one DP replica) gives the same rewards, loss, grad norm and entropy (SGD, see
``SGD``); a CP2 run's step-2 checkpoint resumed at CP1 takes the steps it takes resumed at CP2,
and a CP1 run's resumed at CP2 those it takes at CP1 (the demo's Adam, moments and all)."""

import shutil
import subprocess

import pytest

from tests.support.demo_run import ENV, ROOT, read_metrics, train_cmd

CP1 = ("parallel.tp=1", "parallel.world_size=1", "parallel.cp=1")
CP2 = ("parallel.tp=1", "parallel.world_size=2", "parallel.cp=2")
COMMON = ("engine.kind=inprocess", "checkpoint.save_every=2", "checkpoint.resume=auto", "logging.plot=false",
          "eval.every_n_steps=0")
SGD = ("optimizer.name=sgd", "optimizer.lr=0.05", "optimizer.lr_decay_style=constant", "checkpoint.save_every=0")
"""SGD for the run-vs-run comparison, not the demo's Adam: Adam's first step moves each weight by
lr x sign(gradient), so a gradient component that is zero up to rounding moves a weight by a full
lr in one run and not the other, and two exact layouts part by ~1e-4 in the next step's loss
(measured: CP2 vs CP1, step 2). SGD keeps any difference at the size of the gradients'.
(No checkpoints: megatron-core 0.16 cannot load an SGD optimizer's, which have no state.)"""


def _run(demo, run_dir, steps, *overrides):
    out = subprocess.run(train_cmd(demo, run_dir, steps, *COMMON, *overrides), cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    return read_metrics(run_dir)


def assert_same_steps(rows, reference, what):
    assert [r["step"] for r in rows] == [r["step"] for r in reference], what
    for a, b in zip(rows, reference):
        assert a["rollout/prompt_indices"] == b["rollout/prompt_indices"], what
        assert a["reward_mean"] == b["reward_mean"], (what, a["step"])
        for key in ("loss", "grad_norm", "entropy", "rollout_train_logprobs_abs_diff_mean"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (what, a["step"], key, a[key], b[key])


@pytest.mark.slow
def test_cp2_run_is_the_cp1_run(demo, tmp_path):
    cp1 = _run(demo, tmp_path / "cp1", 3, *CP1, *SGD)
    cp2 = _run(demo, tmp_path / "cp2", 3, *CP2, *SGD)
    assert_same_steps(cp2, cp1, "cp2 vs cp1")
    # the weights are replicated over CP: one CP rank sends them, the probe verifies each sync
    assert [r["weight_sync_bytes"] for r in cp2] == [r["weight_sync_bytes"] for r in cp1]
    assert all(r["weight_sync_verified"] == 1 for r in cp2)
    assert len({r["loss"] for r in cp1}) == 3  # the steps differ: the weights moved


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [(CP2, CP1), (CP1, CP2)], ids=["cp2_to_cp1", "cp1_to_cp2"])
def test_a_checkpoint_resumes_at_another_cp(demo, tmp_path, saved, resumed):
    _run(demo, tmp_path / "a", 2, *saved)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    same = _run(demo, tmp_path / "a", 4, *saved)
    other = _run(demo, tmp_path / "b", 4, *resumed)
    assert [r["step"] for r in other] == [1, 2, 3, 4]
    assert_same_steps(other[2:], same[2:], "resumed at another cp")
