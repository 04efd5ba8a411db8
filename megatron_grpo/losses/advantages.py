"""Outcome advantages from per-completion rewards (docs/loss_spec.md#advantages).

``compute_advantages(rewards, num_generations, config)`` takes ``float[B]`` rewards with the
``num_generations`` completions of each prompt in contiguous rows and returns ``float[B]``.
The trainer broadcasts A_i over the response tokens (the loss accepts ``[B]`` or ``[B, T]``).

Estimators (``ADVANTAGE_ESTIMATORS``, selected by ``algorithm.advantage_estimator``):

* ``grpo``:    A_i = (s_i - mean_g) / (std_g + 1e-6), std unbiased (verl, SkyRL).
* ``dr_grpo``: A_i = s_i - mean_g (Dr.GRPO drops the std division).
* ``rloo``:    A_i = n/(n-1) (s_i - mean_g) = s_i - mean of the OTHER members.

Departures from the peers, on purpose:

* A group whose reward std is <= 1e-6 gets A = 0 for every member, for every estimator.
  Peers compute (s - mean) / (0 + eps): for identical float rewards the mean is off by ~1 ulp,
  and dividing by 1e-6 turns that rounding into |A| ~ 0.5 (docs/loss_spec.md#advantages). Identical rewards
  carry no ranking signal, so 0 is the exact answer.
* Arithmetic is float64 (result cast back to the rewards' dtype), which removes most of the
  rounding in the group mean to begin with.
* Singleton groups (num_generations == 1): grpo uses mean 0 / std 1 -> A = s / (1 + 1e-6)
  and dr_grpo A = s (verl, SkyRL); rloo has no "others" and gives 0 (SkyRL; verl keeps s).
* Non-finite rewards raise ValueError (a reward-function bug must not become a NaN loss).
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_grpo.config.algorithm import AlgorithmConfig
from megatron_grpo.losses.registry import Registry

ADVANTAGE_EPS = 1e-6
"""Added to the group std in the grpo denominator (verl, SkyRL; TRL uses 1e-4)."""

ZERO_STD_TOL = 1e-6
"""A group whose unbiased reward std is <= this gets advantage 0 (docs/loss_spec.md#advantages)."""

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]
"""scores ``float64[G, n]`` (G groups of n completions) -> advantages ``float64[G, n]``."""

ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")


def _group_stats(scores_GN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group mean and unbiased std, ``[G, 1]`` each; singleton groups get mean 0, std 1."""
    n = scores_GN.shape[1]
    if n == 1:
        return torch.zeros_like(scores_GN), torch.ones_like(scores_GN)
    return scores_GN.mean(dim=1, keepdim=True), scores_GN.std(dim=1, unbiased=True, keepdim=True)


def _zero_if_constant(adv_GN: torch.Tensor, std_G1: torch.Tensor) -> torch.Tensor:
    return torch.where(std_G1 <= ZERO_STD_TOL, torch.zeros_like(adv_GN), adv_GN)


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(scores_GN: torch.Tensor) -> torch.Tensor:
    """(s - mean_g) / (std_g + 1e-6); 0 for zero-std groups. ``float64[G, n] -> [G, n]``."""
    mean, std = _group_stats(scores_GN)
    return _zero_if_constant((scores_GN - mean) / (std + ADVANTAGE_EPS), std)


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
def dr_grpo_advantages(scores_GN: torch.Tensor) -> torch.Tensor:
    """s - mean_g (no std normalisation); 0 for zero-std groups. ``float64[G, n] -> [G, n]``."""
    mean, std = _group_stats(scores_GN)
    return _zero_if_constant(scores_GN - mean, std)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(scores_GN: torch.Tensor) -> torch.Tensor:
    """Leave-one-out: s_i - mean_{j != i} s_j = n/(n-1) (s_i - mean_g); singleton groups and
    zero-std groups give 0. ``float64[G, n] -> [G, n]``."""
    n = scores_GN.shape[1]
    if n == 1:
        return torch.zeros_like(scores_GN)
    mean, std = _group_stats(scores_GN)
    return _zero_if_constant((scores_GN - mean) * (n / (n - 1)), std)


def compute_advantages(
    rewards: torch.Tensor, num_generations: int, config: AlgorithmConfig
) -> torch.Tensor:
    """Per-completion advantages.

    rewards: ``float[B]``, B = num_prompts * num_generations, each prompt's completions in
    contiguous rows. Returns ``float[B]`` (rewards' dtype, at least float32), never NaN.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D float[B], got shape {tuple(rewards.shape)}")
    if num_generations < 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"batch of {rewards.numel()} rewards is not a whole number of groups of "
            f"num_generations={num_generations}"
        )
    finite = torch.isfinite(rewards)
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()[:8]
        raise ValueError(f"non-finite rewards at rows {bad}: check the reward functions")
    estimator = ADVANTAGE_ESTIMATORS.get(config.advantage_estimator)
    scores_GN = rewards.to(torch.float64).view(-1, num_generations)
    out_dtype = torch.promote_types(rewards.dtype, torch.float32)
    return estimator(scores_GN).reshape(-1).to(out_dtype)
