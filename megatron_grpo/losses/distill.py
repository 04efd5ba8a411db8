"""On-policy distillation terms: the student's sampled tokens scored by a frozen teacher
(``distillation:``, docs/distillation.md).

With lo = log pi_student(y_t) (pi_old: the trainer's scoring of the sampled token, the
student's weights before this step's update) and lt = log pi_teacher(y_t), both at the
sampling temperature, the per-token reverse KL estimate is ``lo - lt`` (k1 of KL(student ||
teacher) on a token the student sampled). Two forms:

* ``advantage`` (the on-policy distillation recipe: Agarwal et al. 2024 "GKD", Thinking
  Machines 2025 "On-policy distillation"): the advantage of token t is
  ``A_task + coef * (lt - lo)``, per token, not whitened across the group, fed to the policy
  loss (its clip, its off-policy correction and its reduction) like any advantage. Its
  expected gradient is coef times the gradient of -KL(student || teacher) per token.
* ``loss``: ``coef * kl_estimator(lp, lt)`` added to the loss, seq-mean-token-mean with the
  mini-batch's S, exactly as ``algorithm.kl_loss_coef``'s term against the reference.

Departures from the published recipe: Thinking Machines' cookbook uses the sampler's
log-probs as the student's (here the trainer's recomputation, which the off-policy
correction then relates to the sampler's: the mismatch is corrected, not baked into the
advantage), and a discount over future tokens (here none: each token's own reverse KL, their
default of a zero discount). GKD's mixing with teacher samples and its generalized JSD are not
implemented (the student samples only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_grpo.config.distillation import DistillationConfig
from megatron_grpo.losses.common import masked_sum
from megatron_grpo.losses.kl import KL_ESTIMATORS
from megatron_grpo.losses.reductions import Denominators, seq_mean_token_mean


@dataclass(frozen=True)
class Distilled:
    """What distillation adds to one ``compute_policy_loss`` call."""

    advantages: torch.Tensor
    """float[B, T]: the advantages the policy loss uses (the task's, or 0 without
    task_reward, plus the distillation advantage in form advantage)."""
    loss: torch.Tensor
    """0-d: the term added to the loss (0 in form advantage)."""
    metrics: dict[str, torch.Tensor]
    """Local, token-weighted (``losses.metrics``)."""


def reverse_kl(old_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of KL(student || teacher) on the student's sampled tokens:
    ``float[B, T] x2 -> float[B, T]`` (lo - lt)."""
    return old_log_probs - teacher_log_probs


def distill(lp: torch.Tensor, lo: torch.Tensor, lt: torch.Tensor, task_adv: torch.Tensor, valid: torch.Tensor,
            den: Denominators, config: DistillationConfig) -> Distilled:
    """The distillation term of one call. ``lp`` float[B, T] log pi_theta (with grad), ``lo``
    float[B, T] log pi_old (detached), ``lt`` float[B, T] log pi_teacher (detached), ``task_adv``
    float[B, T] the task's advantages, ``valid`` bool[B, T]; all sanitised (0 where not valid).
    """
    rkl = reverse_kl(lo, lt) * valid
    task = task_adv if config.task_reward else torch.zeros_like(task_adv)
    local_tokens = valid.sum().clamp(min=1).to(lp.dtype)
    metrics = {
        "distill/reverse_kl": masked_sum(rkl, valid) / local_tokens,
        "distill/logprob_gap_abs": masked_sum(rkl.abs(), valid) / local_tokens,
        "distill/teacher_logprob": masked_sum(lt, valid) / local_tokens,
        "distill/task_advantage_abs": masked_sum(task.abs(), valid) / local_tokens,
    }
    if config.form == "advantage":
        part = -config.coef * rkl
        metrics["distill/advantage"] = masked_sum(part, valid) / local_tokens
        metrics["distill/advantage_abs"] = masked_sum(part.abs(), valid) / local_tokens
        return Distilled(advantages=task + part, loss=lp.new_zeros(()), metrics=metrics)
    kl = KL_ESTIMATORS.get(config.kl_estimator)(lp, lt)
    return Distilled(advantages=task, loss=config.coef * seq_mean_token_mean(kl, valid, den), metrics=metrics)
