"""`distillation:` section: on-policy distillation from a frozen teacher (docs/distillation.md).

The student samples as usual; the teacher, a second Megatron model built in the trainer,
scores every sampled token at the sampling temperature, and the student is pushed toward it
by one of two forms (``form``): the per-token reverse-KL advantage of the on-policy
distillation recipe, or a KL loss term against the teacher like ``algorithm.kl_loss_coef``'s
against the reference. Off while ``teacher`` is null.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_grpo.config.base import check


@dataclass(kw_only=True)
class DistillationConfig:
    teacher: Optional[str] = None
    """The teacher's Hugging Face folder (config.json, tokenizer, safetensors); null: no
    distillation. Its tokenizer and chat template must be the student's (model.hf_dir); it may
    be wider or deeper. It is sharded like the policy (parallel.tp/pp/cp), frozen, and never
    checkpointed."""

    teacher_megatron_ckpt: Optional[str] = None
    """Load the teacher's weights from this Megatron checkpoint (a trainer checkpoint of a full,
    not LoRA, run) instead of the folder's safetensors; its architecture and tokenizer still
    come from `teacher`."""

    form: Literal["advantage", "loss"] = "advantage"
    """advantage: each sampled token's advantage gets coef x (log p_teacher - log p_student),
    per token and not whitened (the on-policy distillation recipe); loss: coef x the KL
    estimate kl_estimator(student, teacher) is added to the loss, seq-mean-token-mean, like
    algorithm.kl_loss_coef's term against the reference."""

    coef: float = 1.0
    """Weight of the distillation term (the advantage's or the loss's)."""

    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k2"
    """form: loss only: the per-token estimator of KL(student || teacher), as algorithm.kl_estimator.
    k2 by default: on the student's own samples the gradient of k2 = (lp - lt)^2 / 2 is
    (lp - lt) grad lp, the reverse KL's gradient; k1's is grad lp, zero in expectation."""

    task_reward: bool = True
    """true: the GRPO advantage of reward.functions is kept and the distillation term added;
    false: pure distillation (rewards are still scored and logged, they train nothing)."""

    verify_every: int = 1
    """Every N steps (0: never) rank 0 re-scores verify_sequences of the batch with the teacher
    in transformers (fp32, an independent forward) and compares the teacher's log-probs; the
    mean |difference| is logged as distill/teacher_check_abs_diff and a run past
    verify_tolerance stops with one line."""

    verify_sequences: int = 2
    """Sequences of the step's batch the teacher check re-scores."""

    verify_tolerance: float = 1e-3
    """Largest mean |trainer - transformers| teacher log-prob on the checked response tokens.
    fp32 agrees to ~1e-6; raise it for model.dtype bfloat16 (~3e-2)."""

    def __post_init__(self):
        check(math.isfinite(self.coef) and self.coef > 0, "coef", f"must be > 0, got {self.coef}")
        check(self.verify_every >= 0, "verify_every", f"must be >= 0, got {self.verify_every}")
        check(self.verify_sequences >= 1, "verify_sequences", f"must be >= 1, got {self.verify_sequences}")
        check(math.isfinite(self.verify_tolerance) and self.verify_tolerance > 0, "verify_tolerance",
              f"must be > 0, got {self.verify_tolerance}")
        check(self.teacher is None or bool(self.teacher.strip()), "teacher", "must be a folder or null")
        check(self.teacher_megatron_ckpt is None or self.teacher is not None, "teacher_megatron_ckpt",
              "needs distillation.teacher (the folder its architecture and tokenizer come from)")

    @property
    def enabled(self) -> bool:
        return self.teacher is not None
