"""The distillation teacher in the trainer (``distillation:``, docs/distillation.md): built once,
frozen, scoring each step's tokens, and checked against an independent forward.

``build_teacher`` builds megatron-core chunks of ``distillation.teacher`` sharded over the
policy's TP/PP/CP groups (``components.build_and_load``), every parameter frozen, outside DDP,
the optimizer and checkpoints. ``Teacher.score`` fills a batch's ``teacher_log_probs`` with the
same vocab-parallel pass as the policy's log-probs, on the teacher's full distribution at the
sampling temperature (``rollout.temperature``, the convention the student is scored at).

The check (every ``distillation.verify_every`` steps): the trainer's teacher log-probs of the first ``verify_sequences`` rows of data-parallel rank 0's
batch are compared, on their response tokens, with those of the same teacher run by plain
transformers in fp32 on global rank 0 (log_softmax of the logits divided by the sampling
temperature: the convention the trainer scores the student and the teacher with). A mapping bug
(a swapped head, a wrong norm, a teacher that is not the folder it claims) moves log-probs by
O(0.1-1); fp32 agrees to ~1e-6.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.models import load_hf_config
from megatron_grpo.models.builder import check_context_parallel
from megatron_grpo.models.hf_export import save_hf_checkpoint
from megatron_grpo.rollout.batch import TrainBatch
from megatron_grpo.runtime.collectives import RunAborted
from megatron_grpo.trainer.components import build_and_load, frozen
from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs
from megatron_grpo.trainer.microbatch import MicroBatching


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
        gathered: Optional[list] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(teacher_BT[:rows].detach().cpu() if holder else None, gathered, dst=0)  # rank 0 compares
        result = None
        if dist.get_rank() == 0:
            ours = next(t for t in gathered if t is not None)
            tokens = local.tokens[:rows].cpu()
            ref = reference_log_probs(self._reference(), tokens, self.temperature)
            result = compare(ours, ref, local.loss_mask[:rows].cpu())
        box = [result]
        dist.broadcast_object_list(box, src=0)
        return box[0]


@dataclass
class Teacher:
    """The frozen teacher of a run (``build_teacher``) and how it is scored and checked."""

    chunks: list
    hf_config: Any
    spec: ScoringSpec
    """The policy's scoring (its temperature, chunking, kernel) with the teacher's vocabulary."""
    cfg: Any
    """The run's ``distillation:`` section."""
    verifier: Optional[TeacherVerifier]
    """None with ``verify_every: 0``."""

    def score(self, step: int, local: TrainBatch, batching: MicroBatching) -> dict:
        """Collective: fill ``local.teacher_log_probs`` (the teacher's log-probs of the sampled
        tokens, float[N, T] on the last pipeline stage) and, when due, check them against
        transformers; returns the check's metrics ({} when none ran). Raises RunAborted (every
        rank) when the check disagrees past ``verify_tolerance``."""
        # the teacher's own distribution, not the engine's kept set (sampling-mask replay)
        scored = dataclasses.replace(local, kept_ids=None)
        local.teacher_log_probs = compute_log_probs(self.chunks, scored, batching, self.spec)
        if self.verifier is None or step % self.cfg.verify_every:
            return {}
        found = self.verifier.check(local.teacher_log_probs, local)
        if not found.mean_abs_diff <= self.cfg.verify_tolerance:  # NaN fails too
            raise RunAborted(
                f"step {step + 1}: the distillation teacher's log-probs disagree with transformers' forward of "
                f"{self.cfg.teacher}: mean |diff| {found.mean_abs_diff:.3g} over {found.tokens} tokens > "
                f"distillation.verify_tolerance {self.cfg.verify_tolerance:g} (a teacher built wrong, or bf16: "
                "raise the tolerance)")
        return found.metrics()


def build_teacher(cfg: ExperimentConfig, spec: ScoringSpec) -> Optional[Teacher]:
    """Collective: the teacher's chunks for this rank, loaded from ``distillation.teacher`` (or its
    ``teacher_megatron_ckpt``) and frozen, scored like ``spec`` (the policy's); None without
    distillation. Its tokenizer was checked against the student's at pre-flight."""
    distill = cfg.distillation
    if not distill.enabled:
        return None
    hf_config = load_hf_config(distill.teacher)
    check_context_parallel(hf_config, cfg.model.attention_backend, cfg.parallel.cp)
    chunks = frozen(build_and_load(cfg, hf_config, hf_dir=distill.teacher, megatron_ckpt=distill.teacher_megatron_ckpt,
                                   sequence_parallel=cfg.parallel.sequence_parallel))
    verifier = None
    if distill.verify_every:
        verifier = TeacherVerifier(reference_dir(cfg, chunks, hf_config), distill.verify_sequences, spec.temperature)
    return Teacher(chunks=chunks, hf_config=hf_config, spec=dataclasses.replace(spec, vocab_size=hf_config.vocab_size),
                   cfg=distill, verifier=verifier)


def reference_dir(cfg: ExperimentConfig, chunks: list, hf_config) -> str:
    """The HF folder the check loads in transformers (collective): ``distillation.teacher``, or,
    for a teacher loaded from ``teacher_megatron_ckpt``, its weights exported once (fp32) to
    ``<run_dir>/distillation/teacher_hf``."""
    distill = cfg.distillation
    if not distill.teacher_megatron_ckpt:
        return distill.teacher
    out = Path(cfg.trainer.run_dir) / "distillation" / "teacher_hf"
    save_hf_checkpoint(chunks, hf_config, out, sidecar_dir=distill.teacher, dtype=torch.float32, progress=False)
    return str(out)
