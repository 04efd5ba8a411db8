"""``compute_policy_loss``: surrogate -> off-policy correction -> reduction (+ KL, - entropy).

See the package docstring (``megatron_grpo/losses/__init__.py``) for the maths, the
distributed contract and every departure from the peers.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_grpo.config.algorithm import AlgorithmConfig
from megatron_grpo.config.distillation import DistillationConfig
from megatron_grpo.losses.common import Count, as_count, compute_dtype, masked_sum, sanitize
from megatron_grpo.losses.distill import distill
from megatron_grpo.losses.kl import KL_ESTIMATORS
from megatron_grpo.losses.off_policy import off_policy_correction, rollout_diagnostics
from megatron_grpo.losses.policy import POLICY_LOSSES
from megatron_grpo.losses.reductions import REDUCTIONS, Denominators, seq_mean_token_mean


def _check_shapes(log_probs: torch.Tensor, advantages: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be float[B, T], got shape {tuple(log_probs.shape)}")
    shape = log_probs.shape
    for name, t in others.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} must have the shape of log_probs {tuple(shape)}, got {tuple(t.shape)}")
    if advantages.shape not in (shape, shape[:1]):
        raise ValueError(
            f"advantages must be float[B] or float[B, T] with B, T = {tuple(shape)}, "
            f"got {tuple(advantages.shape)}"
        )


def compute_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: AlgorithmConfig,
    rollout_log_probs: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    num_tokens: Optional[Count] = None,
    num_sequences: Optional[Count] = None,
    teacher_log_probs: Optional[torch.Tensor] = None,
    distillation: Optional[DistillationConfig] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO policy loss of one batch (or one part of a mini-batch) and its metrics.

    log_probs:         float[B, T] log pi_theta of the sampled tokens (carries the gradient)
    old_log_probs:     float[B, T] log pi_old (the trainer's recomputation; detached here)
    advantages:        float[B] or float[B, T]
    loss_mask:         {0,1}[B, T] (bool/int/float) trainable response tokens
    rollout_log_probs: float[B, T] log mu from the rollout engine: mismatch metrics, and the
                       off-policy block when ``config.off_policy_correction`` enables it
    ref_log_probs:     float[B, T] log pi_ref: KL loss (kl_loss_coef > 0) / ``kl_loss`` metric
    entropy:           float[B, T] per-token entropy (with grad for the bonus): entropy_coef
                       bonus / ``entropy`` metric
    num_tokens:        N, valid tokens of the whole mini-batch before off-policy masking
                       (default: this call's); int or 0-d tensor
    num_sequences:     S, sequences of the whole mini-batch (default: this call's B)
    teacher_log_probs: float[B, T] log pi_teacher of the sampled tokens, with ``distillation``
                       (``losses.distill``: the distillation advantage or loss term)

    Returns ``(loss, metrics)``: a 0-d tensor (float32, float64 for float64 inputs) whose
    sum over the parts of a mini-batch, each called with the mini-batch's N and S, equals the
    loss of the whole mini-batch, value and gradient; and LOCAL metrics as python floats
    (pool them with ``reduce_metrics``). Values at positions where loss_mask is 0 are never
    read (they may be NaN/inf); the loss and its gradient are always finite for finite valid
    inputs, and exactly 0 (zero gradient) when no token is valid.
    """
    _check_shapes(
        log_probs, advantages, old_log_probs=old_log_probs, loss_mask=loss_mask,
        rollout_log_probs=rollout_log_probs, ref_log_probs=ref_log_probs, entropy=entropy,
        teacher_log_probs=teacher_log_probs,
    )
    if (teacher_log_probs is None) != (distillation is None or not distillation.enabled):
        raise ValueError("teacher_log_probs and an enabled distillation config go together")
    if config.kl_loss_coef > 0 and ref_log_probs is None:
        raise ValueError("algorithm.kl_loss_coef > 0 needs ref_log_probs")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("algorithm.entropy_coef > 0 needs the per-token entropy")
    opc = config.off_policy_correction
    if opc.enabled and rollout_log_probs is None:
        raise ValueError(
            "algorithm.off_policy_correction is enabled but rollout_log_probs was not given "
            "(the rollout engine must return log-probs)"
        )

    dtype = compute_dtype(log_probs.dtype)
    valid = loss_mask.bool()
    num_rows = log_probs.shape[0]
    lp = sanitize(log_probs, valid, dtype)
    lo = sanitize(old_log_probs.detach(), valid, dtype)
    adv = advantages.detach().unsqueeze(-1) if advantages.dim() == 1 else advantages.detach()
    adv = sanitize(adv.expand(lp.shape), valid, dtype)

    num_valid = valid.sum()
    local_tokens = num_valid.clamp(min=1).to(dtype)
    den = Denominators(
        num_tokens=as_count(num_tokens, num_valid, lp),
        num_sequences=as_count(num_sequences, torch.tensor(num_rows), lp),
        seq_lengths=valid.sum(dim=-1).to(dtype),
        horizon=config.max_response_length,
    )

    metrics: dict[str, torch.Tensor] = {}
    extra = None
    if teacher_log_probs is not None:  # the teacher's term: per-token advantages or a loss term
        distilled = distill(lp, lo, sanitize(teacher_log_probs.detach(), valid, dtype), adv, valid, den, distillation)
        adv, extra = distilled.advantages, distilled.loss
        metrics.update(distilled.metrics)
    surrogate = POLICY_LOSSES.get(config.policy_loss_type)(lp, lo, adv, valid, config)
    pg_BT, keep = surrogate.loss, valid
    if rollout_log_probs is not None:
        lmu = sanitize(rollout_log_probs.detach(), valid, dtype)
        # float64: detached statistics, so that mean <= max holds to the last digit.
        metrics.update(rollout_diagnostics(lo.double(), lmu.double(), valid))
        if opc.enabled:
            correction = off_policy_correction(lo, lmu, valid, opc)
            keep = correction.keep
            if correction.weight is not None:
                pg_BT = pg_BT * correction.weight
            metrics.update(correction.metrics)
    loss = REDUCTIONS.get(config.loss_reduction)(pg_BT, keep, den)
    if extra is not None:
        loss = loss + extra

    def token_fraction(flags: torch.Tensor) -> torch.Tensor:
        return masked_sum(flags.to(dtype), valid) / local_tokens

    metrics["clip_ratio_low"] = token_fraction(surrogate.clipped_low)
    metrics["clip_ratio_high"] = token_fraction(surrogate.clipped_high)
    metrics["clip_ratio"] = token_fraction(surrogate.clipped_low | surrogate.clipped_high)
    metrics["pg_clipfrac_lower"] = token_fraction(surrogate.dual_clipped)
    metrics["ppo_kl"] = masked_sum(lo - lp.detach(), valid) / local_tokens

    if ref_log_probs is not None:
        # KL(pi || ref) is always seq-mean-token-mean (SkyRL), with the mini-batch's S.
        lref = sanitize(ref_log_probs.detach(), valid, dtype)
        kl_BT = KL_ESTIMATORS.get(config.kl_estimator)(lp if config.kl_loss_coef > 0 else lp.detach(), lref)
        if config.kl_loss_coef > 0:
            loss = loss + config.kl_loss_coef * seq_mean_token_mean(kl_BT, valid, den)
        # metric: the same seq-mean-token-mean over THIS call's rows (pooled by row count)
        per_seq = masked_sum(kl_BT.detach(), valid, dim=-1) / den.seq_lengths.clamp(min=1)
        metrics["kl_loss"] = per_seq.sum() / max(num_rows, 1)
    if entropy is not None:
        # Entropy bonus: token mean over the mini-batch's N (SkyRL divides per micro-batch).
        ent = sanitize(entropy, valid, dtype)
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * masked_sum(ent, valid) / den.num_tokens
        metrics["entropy"] = masked_sum(ent.detach(), valid) / local_tokens

    metrics["num_valid_tokens"] = num_valid
    metrics["num_sequences"] = torch.tensor(num_rows)
    # One device->host transfer for all metrics (not one .item() sync per metric).
    names = list(metrics)
    values = torch.stack([metrics[k].detach().to(device=lp.device, dtype=torch.float64) for k in names]).tolist()
    return loss, dict(zip(names, values))
