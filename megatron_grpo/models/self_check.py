"""Conversion self-check: the same probe batch through the Megatron model and the HF model.

The Megatron side runs at whatever TP/PP the process group has (its logits are gathered over
TP and sent to global rank 0); the HF reference runs in fp32 on global rank 0 only. The
result (max |Δlogits|) is broadcast so every rank exits with the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_grpo.models.forward import forward_logits, gather_vocab
from megatron_grpo.models.lora_export import peft_logits
from megatron_grpo.runtime.device import collective_device, collective_tensor

PROBE_BATCH, PROBE_SEQ, PROBE_SEED = 2, 32, 1234
DEFAULT_TOLERANCE = 1e-3
"""Max |Δlogits| accepted in fp32. A mapping bug (a swapped head, a missing norm) moves logits
by O(0.1-1); fp32 reduction-order noise stays orders of magnitude below."""


@dataclass(frozen=True)
class SelfCheckResult:
    max_abs_diff: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance  # False for NaN

    def line(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        return (f"self-check {verdict}: max |Δlogits| = {self.max_abs_diff:.3g} over a "
                f"{PROBE_BATCH}x{PROBE_SEQ} probe batch (tolerance {self.tolerance:g})")


def probe_input_ids(vocab_size: int, batch: int = PROBE_BATCH, seq: int = PROBE_SEQ) -> torch.Tensor:
    """Deterministic token ids [batch, seq], identical on every rank."""
    g = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, (batch, seq), generator=g)


def megatron_logits_on_rank0(model_chunks: list, hf_config, input_ids_BS) -> torch.Tensor | None:
    """Full-vocab fp32 logits [B, S, V] on global rank 0, None elsewhere. Collective."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    logits = forward_logits(model_chunks, input_ids_BS)
    if logits is not None:
        logits = gather_vocab(logits, hf_config.vocab_size).float().cpu()
    # The holder: last PP stage, TP rank 0, DP rank 0 (global rank 0 when pp == 1).
    holder = int(logits is not None and ps.get_tensor_model_parallel_rank() == 0
                 and ps.get_data_parallel_rank(with_context_parallel=True) == 0)
    flags = collective_tensor([dist.get_rank() if holder else -1], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    src, rank = int(flags.item()), dist.get_rank()
    if rank == src:
        if src == 0:
            return logits
        dist.send(logits.contiguous().to(collective_device()), dst=0)
    elif rank == 0:
        B, S = input_ids_BS.shape
        buf = torch.empty(B, S, hf_config.vocab_size, device=collective_device())
        dist.recv(buf, src=src)
        return buf.cpu()
    return None


def hf_logits(hf_dir: str | Path, input_ids_BS: torch.Tensor,
              round_to: torch.dtype = torch.float32) -> torch.Tensor:
    """fp32 logits [B, S, V] of the HF model in ``hf_dir`` (loaded on CPU). ``round_to``:
    round the weights to this dtype first, to compare with a lower-precision conversion."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        round_params_(model.parameters(), round_to)
        return model(input_ids=input_ids_BS).logits.float()


def round_params_(params, dtype: torch.dtype) -> None:
    """Round fp32 parameters in place to ``dtype``'s precision (no-op for float32)."""
    if dtype == torch.float32:
        return
    with torch.no_grad():
        for p in params:
            p.copy_(p.to(dtype).to(p.dtype))


def run_self_check(model_chunks: list, hf_config, hf_dir: str | Path,
                   tolerance: float = DEFAULT_TOLERANCE,
                   hf_round_to: torch.dtype = torch.float32,
                   adapter_dir: str | Path | None = None) -> SelfCheckResult:
    """Compare the (fp32) Megatron chunks with the HF model in ``hf_dir`` (its weights
    rounded to ``hf_round_to``), with the peft adapter of ``adapter_dir`` loaded onto it by
    peft when given. Collective; the same result on every rank."""
    import torch.distributed as dist

    ids = probe_input_ids(hf_config.vocab_size)
    ours = megatron_logits_on_rank0(model_chunks, hf_config, ids)
    value = 0.0
    if dist.get_rank() == 0:
        ref = (peft_logits(hf_dir, adapter_dir, ids) if adapter_dir is not None
               else hf_logits(hf_dir, ids, round_to=hf_round_to))
        value = float((ours - ref).abs().max()) if ours.shape == ref.shape else float("inf")
    diff = collective_tensor([value])
    dist.broadcast(diff, src=0)
    return SelfCheckResult(float(diff.item()), tolerance)
