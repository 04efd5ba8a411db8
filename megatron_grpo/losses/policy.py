"""Per-token policy surrogates (docs/loss_spec.md#policy-losses), keyed by ``algorithm.policy_loss_type``.

Each entry maps sanitised ``float[B, T]`` inputs (current log-probs with grad, old log-probs,
advantages broadcast to tokens, the valid mask) to a ``Surrogate``: the per-token loss to
minimise and the boolean clip indicators the metrics count. Aggregation, off-policy weights
and the KL/entropy terms are applied by ``loss.compute_policy_loss``.

r = exp(clamp(lp - lo, +-20)) with lo the old (behaviour) policy recomputed by the trainer.

* ``ppo``:   max(-A r, -A clip(r, 1-eps_low, 1+eps_high)); with ``clip_ratio_c`` = c (> 1) the
  dual clip min(., -A c) bounds negative-advantage tokens (Ye et al. 2019). Dual clip is off
  when ``clip_ratio_c`` is null (verl always applies it; SkyRL only for its ``dual_clip`` loss).
* ``gspo``:  the same clip on the GSPO-token ratio
  s = exp(min(sg(mean_t(lp - lo)) + lp - sg(lp), 10)) (one ratio per sequence, token gradients).
* ``cispo``: -sg(clip(r, 1-cispo_eps_clip_low, 1+cispo_eps_clip_high)) A lp (REINFORCE with a
  clipped, detached IS weight: clipped tokens still get a gradient).
* ``sapo``:  -A (4/tau) sigmoid(tau (r - 1)), tau = sapo_tau_pos if A > 0 else sapo_tau_neg
  (a soft gate instead of a hard clip; its slope at r = 1 is exactly the PPO gradient).

Clip indicators: ``clipped_low`` / ``clipped_high`` mark tokens whose ratio left the band on
the side where the clip bites (r < 1-eps_low with A < 0, r > 1+eps_high with A > 0, which
together are exactly the tokens with -A clip(r) > -A r). CISPO counts tokens whose weight was
clipped on either side whatever the sign of A (SkyRL's CISPO metric compares the wrong way and
reports 1 always). SAPO has no hard clip: its indicators report the tokens PPO's band would
have clipped, as a drift diagnostic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from megatron_grpo.config.algorithm import AlgorithmConfig
from megatron_grpo.losses.common import masked_sum, safe_exp
from megatron_grpo.losses.registry import Registry

GSPO_LOG_RATIO_MAX = 10.0
"""GSPO clamps its token log-ratio from above at 10 (verl, SkyRL)."""


@dataclass
class Surrogate:
    """Per-token output of a policy loss, all ``[B, T]``."""

    loss: torch.Tensor
    """float: loss to minimise (carries the gradient)."""

    clipped_low: torch.Tensor
    """bool: ratio clipped at the lower bound."""

    clipped_high: torch.Tensor
    """bool: ratio clipped at the upper bound."""

    dual_clipped: torch.Tensor
    """bool: loss bounded by the dual clip -A c (always False without dual clip)."""


SurrogateFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AlgorithmConfig], Surrogate
]
"""(log_probs, old_log_probs, advantages, valid, config), each ``[B, T]`` -> Surrogate."""

POLICY_LOSSES: Registry[SurrogateFn] = Registry("policy loss")


def _clipped_objective(
    ratio: torch.Tensor, adv: torch.Tensor, config: AlgorithmConfig, dual_clip: bool
) -> Surrogate:
    """max(-A r, -A clip(r)), optionally dual-clipped; indicators computed before dual clip."""
    low_bound, high_bound = 1.0 - config.eps_clip_low, 1.0 + config.eps_clip_high
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, low_bound, high_bound)
    loss = torch.maximum(unclipped, clipped)
    r = ratio.detach()
    clipped_low = (r < low_bound) & (adv < 0)
    clipped_high = (r > high_bound) & (adv > 0)
    dual_clipped = torch.zeros_like(clipped_low)
    if dual_clip and config.clip_ratio_c is not None:
        bound = -adv * config.clip_ratio_c
        negative = adv < 0
        dual_clipped = negative & (loss.detach() > bound)
        loss = torch.where(negative, torch.minimum(loss, bound), loss)
    return Surrogate(loss, clipped_low, clipped_high, dual_clipped)


@POLICY_LOSSES.register("ppo")
def ppo_loss(lp, lo, adv, valid, config: AlgorithmConfig) -> Surrogate:
    """PPO clip (+ dual clip when clip_ratio_c is set). ``[B, T]`` inputs -> Surrogate."""
    return _clipped_objective(safe_exp(lp - lo), adv, config, dual_clip=True)


@POLICY_LOSSES.register("gspo")
def gspo_loss(lp, lo, adv, valid, config: AlgorithmConfig) -> Surrogate:
    """GSPO-token: PPO clip on s_{i,t} = sg(s_i) * pi/sg(pi). ``[B, T]`` inputs -> Surrogate."""
    lengths = valid.sum(dim=-1, keepdim=True).clamp(min=1).to(lp.dtype)
    seq_log_ratio = masked_sum(lp - lo, valid, dim=-1).unsqueeze(-1) / lengths
    # (lp - sg(lp)) is exactly 0 in value; adding the detached sequence term last keeps the
    # value bit-exact (verl PR #2775) while the gradient is that of lp.
    log_s = torch.clamp((lp - lp.detach()) + seq_log_ratio.detach(), max=GSPO_LOG_RATIO_MAX)
    return _clipped_objective(torch.exp(log_s), adv, config, dual_clip=False)


@POLICY_LOSSES.register("cispo")
def cispo_loss(lp, lo, adv, valid, config: AlgorithmConfig) -> Surrogate:
    """-sg(clip(r, 1-eps_lo, 1+eps_hi)) A lp. ``[B, T]`` inputs -> Surrogate."""
    low_bound, high_bound = 1.0 - config.cispo_eps_clip_low, 1.0 + config.cispo_eps_clip_high
    ratio = safe_exp(lp - lo).detach()
    weight = torch.clamp(ratio, low_bound, high_bound)
    loss = -weight * adv * lp
    return Surrogate(loss, ratio < low_bound, ratio > high_bound, torch.zeros_like(valid))


@POLICY_LOSSES.register("sapo")
def sapo_loss(lp, lo, adv, valid, config: AlgorithmConfig) -> Surrogate:
    """-A (4/tau) sigmoid(tau (r - 1)). ``[B, T]`` inputs -> Surrogate."""
    ratio = safe_exp(lp - lo)
    tau = torch.where(
        adv > 0,
        torch.full_like(adv, config.sapo_tau_pos),
        torch.full_like(adv, config.sapo_tau_neg),
    )
    loss = -adv * (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    r = ratio.detach()
    clipped_low = (r < 1.0 - config.eps_clip_low) & (adv < 0)
    clipped_high = (r > 1.0 + config.eps_clip_high) & (adv > 0)
    return Surrogate(loss, clipped_low, clipped_high, torch.zeros_like(valid))
