"""Advantage estimators against hand-computed values (docs/loss_spec.md#advantages)."""

import pytest
import torch

from megatron_grpo.config import AlgorithmConfig
from megatron_grpo.losses import compute_advantages

# Three groups of n = 3 (contiguous rows):
#   [0.5, 1.5, 1.0]: mean 1, deviations (-0.5, 0.5, 0), unbiased std sqrt(0.5/2) = 0.5
#   [3, 0, 0]:       mean 1, deviations (2, -1, -1),   unbiased std sqrt(6/2) = sqrt(3)
#   [2, 2, 2]:       std 0 -> advantage 0 for every estimator
REWARDS = torch.tensor([0.5, 1.5, 1.0, 3.0, 0.0, 0.0, 2.0, 2.0, 2.0])

EXPECTED = {
    # (s - mean) / (std + 1e-6): -0.5/0.500001, 2/(1.7320508+1e-6) = 1.1546998717, -1/1.7320518 = -0.5773499359
    "grpo": [-0.999998000004, 0.999998000004, 0.0, 1.15469987171297, -0.577349935856485, -0.577349935856485, 0, 0, 0],
    # s - mean
    "dr_grpo": [-0.5, 0.5, 0.0, 2.0, -1.0, -1.0, 0, 0, 0],
    # s_i - mean of the others: 0.5 - (1.5+1)/2 = -0.75; 3 - 0 = 3; 0 - (3+0)/2 = -1.5
    "rloo": [-0.75, 0.75, 0.0, 3.0, -1.5, -1.5, 0, 0, 0],
}


@pytest.mark.parametrize("estimator", sorted(EXPECTED))
def test_estimators_hand_values(estimator):
    adv = compute_advantages(REWARDS, 3, AlgorithmConfig(advantage_estimator=estimator))
    assert adv.dtype == torch.float32 and adv.shape == (9,)
    torch.testing.assert_close(adv, torch.tensor(EXPECTED[estimator]), rtol=1e-6, atol=1e-7)


def test_identical_float_rewards_give_exactly_zero():
    # docs/loss_spec.md#advantages: 64 identical float32 rewards 7.3229351 give A = -0.486 in verl/SkyRL
    # (1 ulp of mean rounding divided by eps=1e-6). Here: exactly 0.
    rewards = torch.full((64,), 7.3229351, dtype=torch.float32)
    for estimator in ("grpo", "dr_grpo", "rloo"):
        adv = compute_advantages(rewards, 64, AlgorithmConfig(advantage_estimator=estimator))
        assert torch.equal(adv, torch.zeros(64))


def test_singleton_groups():
    rewards = torch.tensor([2.0, -1.0])
    # grpo: mean 0, std 1 -> s / (1 + 1e-6); dr_grpo: s; rloo: no "others" -> 0 (SkyRL)
    torch.testing.assert_close(
        compute_advantages(rewards, 1, AlgorithmConfig()), torch.tensor([1.999998000002, -0.999999000001])
    )
    torch.testing.assert_close(
        compute_advantages(rewards, 1, AlgorithmConfig(advantage_estimator="dr_grpo")), torch.tensor([2.0, -1.0])
    )
    assert torch.equal(compute_advantages(rewards, 1, AlgorithmConfig(advantage_estimator="rloo")), torch.zeros(2))


def test_float64_rewards_stay_float64():
    adv = compute_advantages(REWARDS.double(), 3, AlgorithmConfig(advantage_estimator="dr_grpo"))
    assert adv.dtype == torch.float64


@pytest.mark.parametrize(
    "rewards, n, match",
    [
        (torch.ones(5), 2, "whole number of groups"),
        (torch.ones(2, 2), 2, "1-D"),
        (torch.tensor([1.0, float("nan")]), 2, "non-finite rewards at rows \\[1\\]"),
        (torch.tensor([1.0, float("inf")]), 2, "non-finite"),
    ],
)
def test_bad_inputs_raise(rewards, n, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(rewards, n, AlgorithmConfig())
