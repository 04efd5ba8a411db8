"""Train/rollout mismatch: diagnostics and the off-policy correction block (docs/loss_spec.md#off-policy-correction).

The rollout engine (SGLang, the embedded engine) samples with mu, which differs from the
trainer's pi_old even at identical weights (kernels, precision, batching). With
rho = pi_old / mu = exp(clamp(lo - lmu, +-20)) per token, the block runs, in SkyRL PR #849's
order, on the valid mask m:

1. outlier sequence mask: drop sequence i if any valid token has rho > outlier_token_is_threshold_high
   or rho < outlier_token_is_threshold_low (null = no bound)          -> m1
2. TIS weight (detached), on m1: ``token``: w = min(rho, token_tis_ratio_clip_high);
   ``sequence``: w_i = min(exp(clamp(sum_t m1 log rho, +-20)), sequence_tis_ratio_clip_high)
3. sequence mask on m1: ``geometric``: keep iff geo_mask_low <= exp(mean_t m1 log rho) <= geo_mask_high;
   ``product``: keep iff product_mask_low <= exp(clamp(sum_t m1 log rho, +-20)) <= product_mask_high  -> m2

The policy loss becomes agg(l * w, m2); the denominators stay those of m (``reductions.py``).
Every mask here drops whole sequences, and rho never carries a gradient.

The block is on when ``tis_ratio_type``, ``sequence_mask_metric`` or an outlier threshold is
set (skyrl 0.4.0; PR #849 ignores outlier thresholds alone). skyrl 0.4.0's per-token mask
(``token_mask_is_threshold_*``) is not implemented.

Metrics (0-d tensors) divide by LOCAL counts: valid tokens before masking, or rows B with empty
ones (``*_seq_*``, ``*_sequence_mask_*``; SkyRL); ``reduce_metrics`` re-weights them exactly.
Departures from SkyRL: ``tis_token_clip_high_ratio`` divides by all valid tokens (SkyRL: those
left after the outlier mask); ``is_ratio_*`` are over valid tokens only (SkyRL counts padding as 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_grpo.config.algorithm import OffPolicyCorrectionConfig
from megatron_grpo.losses.common import LOG_RATIO_CLAMP, masked_sum, safe_exp
from megatron_grpo.losses.registry import Registry

Metrics = dict[str, torch.Tensor]


def _masked_mean_std(x: torch.Tensor, valid: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population std of ``x`` over valid positions; n = max(#valid, 1)."""
    mean = masked_sum(x, valid) / n
    var = masked_sum((x - mean).square(), valid) / n
    return mean, var.sqrt()


def _masked_extreme(x: torch.Tensor, valid: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (or min) of ``x`` over valid positions; 0 when nothing is valid."""
    fill = torch.full((), -torch.inf if largest else torch.inf, dtype=x.dtype, device=x.device)
    kept = torch.where(valid, x, fill)
    value = kept.max() if largest else kept.min()
    return torch.where(valid.any(), value, torch.zeros_like(value))


def _row_fraction(flags_B: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Fraction of ALL rows (empty ones included, as SkyRL) that are flagged; 0 for B = 0."""
    return flags_B.to(dtype).sum() / max(flags_B.numel(), 1)


def rollout_diagnostics(lo: torch.Tensor, lmu: torch.Tensor, valid: torch.Tensor) -> Metrics:
    """Mismatch between the trainer's pi_old and the rollout engine's mu over valid tokens.

    lo, lmu: sanitised ``float[B, T]``; valid: ``bool[B, T]``. Returns is_ratio_mean/std/max/min
    (rho = pi_old/mu), is_ratio_outside_10pct (the fraction of tokens with rho outside
    [0.9, 1.1], the measure of the TRL top-p study cited in docs/off_policy.md),
    rollout_train_logprobs_abs_diff_mean/_std (|lmu - lo|) and k3_kl = mean(rho - log rho - 1),
    the k3 estimate of KL(mu || pi_old) (verl ``k3_kl``).
    """
    log_rho = torch.clamp(lo - lmu, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = torch.exp(log_rho)
    n = valid.sum().clamp(min=1).to(lo.dtype)
    rho_mean, rho_std = _masked_mean_std(rho, valid, n)
    diff_mean, diff_std = _masked_mean_std((lmu - lo).abs(), valid, n)
    return {
        "is_ratio_mean": rho_mean,
        "is_ratio_std": rho_std,
        "is_ratio_max": _masked_extreme(rho, valid, largest=True),
        "is_ratio_min": _masked_extreme(rho, valid, largest=False),
        "is_ratio_outside_10pct": masked_sum(((rho < 0.9) | (rho > 1.1)).to(lo.dtype), valid) / n,
        "rollout_train_logprobs_abs_diff_mean": diff_mean,
        "rollout_train_logprobs_abs_diff_std": diff_std,
        "k3_kl": masked_sum(rho - log_rho - 1.0, valid) / n,
    }


@dataclass
class Correction:
    """Result of the off-policy block."""

    keep: torch.Tensor
    """bool ``[B, T]``: the valid mask after the outlier and sequence masks (m2)."""

    weight: Optional[torch.Tensor]
    """Detached TIS weight, ``[B, T]`` (token) or ``[B, 1]`` (sequence); None without TIS."""

    metrics: Metrics = field(default_factory=dict)


TISFn = Callable[[torch.Tensor, torch.Tensor, OffPolicyCorrectionConfig, torch.Tensor], tuple[torch.Tensor, Metrics]]
"""(log_rho ``[B, T]``, keep ``bool[B, T]``, config, num_valid) -> (weight, metrics)."""

SequenceMaskFn = Callable[[torch.Tensor, torch.Tensor, OffPolicyCorrectionConfig], tuple[torch.Tensor, Metrics]]
"""(log_rho ``[B, T]``, keep ``bool[B, T]``, config) -> (keep_seq ``bool[B]``, metrics)."""

TIS_WEIGHTS: Registry[TISFn] = Registry("TIS ratio type")
SEQUENCE_MASKS: Registry[SequenceMaskFn] = Registry("sequence mask metric")


@TIS_WEIGHTS.register("token")
def token_tis(log_rho, keep, config: OffPolicyCorrectionConfig, num_valid) -> tuple[torch.Tensor, Metrics]:
    """w = min(rho, cap) per token, ``[B, T]``."""
    rho = torch.exp(log_rho)
    cap = config.token_tis_ratio_clip_high
    capped = masked_sum((rho > cap).to(rho.dtype), keep) / num_valid
    return torch.clamp(rho, max=cap), {"tis_token_clip_high_ratio": capped}


@TIS_WEIGHTS.register("sequence")
def sequence_tis(log_rho, keep, config: OffPolicyCorrectionConfig, num_valid) -> tuple[torch.Tensor, Metrics]:
    """w_i = min(prod_t rho, cap) per sequence, ``[B, 1]``."""
    seq_rho = safe_exp(masked_sum(log_rho, keep, dim=-1)).unsqueeze(-1)
    cap = config.sequence_tis_ratio_clip_high
    capped = _row_fraction(seq_rho.squeeze(-1) > cap, seq_rho.dtype)
    return torch.clamp(seq_rho, max=cap), {"tis_seq_clip_high_ratio": capped}


def _bounds_mask(stat_B: torch.Tensor, low: float, high: float, prefix: str) -> tuple[torch.Tensor, Metrics]:
    over, under = stat_B > high, stat_B < low
    drop = over | under
    return ~drop, {
        f"{prefix}_masked_ratio": _row_fraction(drop, stat_B.dtype),
        f"{prefix}_over_high_ratio": _row_fraction(over, stat_B.dtype),
        f"{prefix}_under_low_ratio": _row_fraction(under, stat_B.dtype),
    }


@SEQUENCE_MASKS.register("geometric")
def geometric_mask(log_rho, keep, config: OffPolicyCorrectionConfig) -> tuple[torch.Tensor, Metrics]:
    """Keep iff geo_mask_low <= exp(mean_t log rho) <= geo_mask_high; ``bool[B]``."""
    lengths = keep.sum(dim=-1).clamp(min=1).to(log_rho.dtype)
    geo = safe_exp(masked_sum(log_rho, keep, dim=-1) / lengths)
    return _bounds_mask(geo, config.geo_mask_low, config.geo_mask_high, "geo_sequence_mask")


@SEQUENCE_MASKS.register("product")
def product_mask(log_rho, keep, config: OffPolicyCorrectionConfig) -> tuple[torch.Tensor, Metrics]:
    """Keep iff product_mask_low <= prod_t rho <= product_mask_high; ``bool[B]``."""
    prod = safe_exp(masked_sum(log_rho, keep, dim=-1))
    return _bounds_mask(prod, config.product_mask_low, config.product_mask_high, "product_sequence_mask")


def outlier_mask(log_rho, valid, config: OffPolicyCorrectionConfig) -> tuple[torch.Tensor, Metrics]:
    """``bool[B]``: False for sequences with a valid token whose rho leaves the outlier bounds."""
    rho = torch.exp(log_rho)
    low, high = config.outlier_token_is_threshold_low, config.outlier_token_is_threshold_high
    over = valid & (rho > high) if high is not None else torch.zeros_like(valid)
    under = valid & (rho < low) if low is not None else torch.zeros_like(valid)
    seq_over, seq_under = over.any(dim=-1), under.any(dim=-1)
    drop = seq_over | seq_under
    return ~drop, {
        "outlier_seq_masked_ratio": _row_fraction(drop, rho.dtype),
        "outlier_seq_over_high_ratio": _row_fraction(seq_over, rho.dtype),
        "outlier_seq_under_low_ratio": _row_fraction(seq_under, rho.dtype),
    }


def off_policy_correction(
    lo: torch.Tensor, lmu: torch.Tensor, valid: torch.Tensor, config: OffPolicyCorrectionConfig
) -> Correction:
    """Outlier mask -> TIS weight -> sequence mask. lo, lmu: sanitised ``float[B, T]``
    (no grad needed; the result is detached); valid: ``bool[B, T]``."""
    lo, lmu = lo.detach(), lmu.detach()
    log_rho = torch.where(valid, torch.clamp(lo - lmu, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), torch.zeros_like(lo))
    num_valid = valid.sum().clamp(min=1).to(lo.dtype)
    keep_seq, metrics = outlier_mask(log_rho, valid, config)
    keep = valid & keep_seq.unsqueeze(-1)
    weight = None
    if config.tis_ratio_type is not None:
        weight, tis_metrics = TIS_WEIGHTS.get(config.tis_ratio_type)(log_rho, keep, config, num_valid)
        metrics.update(tis_metrics)
    if config.sequence_mask_metric is not None:
        keep_seq, mask_metrics = SEQUENCE_MASKS.get(config.sequence_mask_metric)(log_rho, keep, config)
        keep = keep & keep_seq.unsqueeze(-1)
        metrics.update(mask_metrics)
    return Correction(keep=keep, weight=weight, metrics=metrics)
