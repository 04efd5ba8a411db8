"""The distillation teacher, checked against an independent forward (``distillation.verify_every``).

The trainer's teacher log-probs of the first ``verify_sequences`` rows of data-parallel rank 0's
batch are compared, on their response tokens, with those of the same teacher run by plain
transformers in fp32 on global rank 0 (log_softmax of the logits divided by the sampling
temperature: the convention the trainer scores the student and the teacher with). A mapping bug
(a swapped head, a wrong norm, a teacher that is not the folder it claims) moves log-probs by
O(0.1-1); fp32 agrees to ~1e-6.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_grpo.rollout.batch import TrainBatch


@dataclass(frozen=True)
class TeacherCheck:
    """What one check measured (the same on every rank)."""

    mean_abs_diff: float
    max_abs_diff: float
    tokens: int

    def metrics(self) -> dict[str, float]:
        return {"distill/teacher_check_abs_diff": self.mean_abs_diff,
                "distill/teacher_check_max_abs_diff": self.max_abs_diff}


def reference_log_probs(model, tokens_BS: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) of each next token with a transformers causal LM:
    tokens long[B, S] -> float64[B, S - 1] (position t scores ``tokens[:, t + 1]``)."""
    with torch.no_grad():
        logits = model(input_ids=tokens_BS).logits.double()[:, :-1]
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens_BS[:, 1:, None])[..., 0]


def compare(trainer_BT: torch.Tensor, reference_BT: torch.Tensor, mask_BT: torch.Tensor) -> TeacherCheck:
    """|trainer - reference| on the positions of ``mask_BT`` (> 0): float[B, T] x3 -> TeacherCheck
    (NaN diffs count as infinite)."""
    scored = mask_BT > 0
    diff = (trainer_BT.double() - reference_BT.double()).abs()[scored]
    diff = torch.nan_to_num(diff, nan=float("inf"))
    if diff.numel() == 0:
        return TeacherCheck(0.0, 0.0, 0)
    return TeacherCheck(float(diff.mean()), float(diff.max()), int(diff.numel()))


class TeacherVerifier:
    """Holds the transformers teacher (rank 0, fp32 on the CPU, loaded on first use) and runs
    the check (collective)."""

    def __init__(self, hf_dir: str | Path, num_rows: int, temperature: float):
        self.hf_dir, self.num_rows, self.temperature = str(hf_dir), num_rows, temperature
        self._model = None

    def _reference(self):
        if self._model is None:
            from transformers import AutoModelForCausalLM

            self._model = AutoModelForCausalLM.from_pretrained(self.hf_dir, dtype=torch.float32).eval()
        return self._model

    def check(self, teacher_BT: Optional[torch.Tensor], local: TrainBatch) -> TeacherCheck:
        """Collective. ``teacher_BT``: this rank's teacher log-probs of ``local`` (float[N, T] on
        the last pipeline stage, None elsewhere); ``local``: this data-parallel rank's rows."""
        from megatron.core import parallel_state as ps

        rows = min(self.num_rows, local.num_sequences)
        holder = (teacher_BT is not None and ps.get_tensor_model_parallel_rank() == 0
                  and ps.get_data_parallel_rank(with_context_parallel=True) == 0)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, teacher_BT[:rows].detach().cpu() if holder else None)
        result = None
        if dist.get_rank() == 0:
            ours = next(t for t in gathered if t is not None)
            tokens = local.tokens[:rows].cpu()
            ref = reference_log_probs(self._reference(), tokens, self.temperature)
            result = compare(ours, ref, local.loss_mask[:rows].cpu())
        box = [result]
        dist.broadcast_object_list(box, src=0)
        return box[0]
