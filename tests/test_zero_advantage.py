"""A step whose every group has equal rewards has no policy gradient: the trainer skips its
old-log-prob pass and its optimizer steps (``algorithm.skip_zero_advantage_steps``, opt-in) unless the
entropy bonus, a KL loss or router replay still gives one (``trainer.has_gradient``)."""

import dataclasses
import subprocess

import pytest
import torch

from megatron_grpo.config.algorithm import AlgorithmConfig
from megatron_grpo.rollout.batch import TrainBatch
from megatron_grpo.trainer.trainer import ZERO_ADVANTAGE, has_gradient
from tests.support.demo_run import ENV, ROOT, read_metrics, train_cmd

CONSTANT_REWARD = "def always_one(response):\n    return 1.0\n"


def batch_with(advantages: list[float]) -> TrainBatch:
    n = len(advantages)
    return TrainBatch(tokens=torch.zeros(n, 3, dtype=torch.long), loss_mask=torch.ones(n, 2),
                      rollout_log_probs=torch.zeros(n, 2), advantages=torch.tensor(advantages))


def test_only_a_batch_of_zero_advantages_without_other_terms_has_no_gradient():
    plain = AlgorithmConfig()
    assert not has_gradient(batch_with([0.0, 0.0, -0.0, ZERO_ADVANTAGE]), plain)
    assert has_gradient(batch_with([0.0, 0.0, 2 * ZERO_ADVANTAGE, 0.0]), plain)
    assert has_gradient(batch_with([0.0, -0.5, 0.5, 0.0]), plain)
    zeros = batch_with([0.0] * 4)
    assert has_gradient(zeros, dataclasses.replace(plain, entropy_coef=0.01))  # the bonus has a gradient
    assert has_gradient(zeros, dataclasses.replace(plain, kl_loss_coef=0.1))  # so has the KL loss


@pytest.fixture(scope="module")
def constant_reward(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero_adv")
    (root / "constant.py").write_text(CONSTANT_REWARD)
    return f"reward.functions=[{{name: '{root}/constant.py:always_one'}}]"


def run(demo, run_dir, *extra):
    out = subprocess.run(train_cmd(demo, run_dir, 2, "engine.kind=inprocess", "algorithm.entropy_coef=0.0",
                                   "checkpoint.save_every=0", *extra),
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return read_metrics(run_dir)


@pytest.mark.slow
def test_a_step_without_signal_skips_its_update(demo, constant_reward, tmp_path):
    skipped = run(demo, tmp_path / "skip", constant_reward, "algorithm.skip_zero_advantage_steps=true")
    assert [r["skipped_zero_advantage"] for r in skipped] == [1, 1]
    for r in skipped:
        assert r["reward_mean"] == 1.0 and r["reward_std"] == 0.0
        assert "loss" not in r and "grad_norm" not in r  # no optimizer step ran
        assert r["weight_sync_verified"] == 1
    # the same run with the skip off (the default) pays for an update that changes nothing: loss and gradient 0
    updated = run(demo, tmp_path / "update", constant_reward)  # the default
    assert [r["skipped_zero_advantage"] for r in updated] == [0, 0]
    assert all(r["loss"] == 0.0 and r["grad_norm"] == 0.0 for r in updated)
    assert sum(r["time/train_s"] for r in skipped) < sum(r["time/train_s"] for r in updated)
