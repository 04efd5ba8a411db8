"""The one LoRA merge, ``W_base + scale * B @ A`` in fp32, shared by every side that computes it.

The trainer merges it for the weight sync and the HF export (``models/lora.py``, shard by
shard), the embedded engine merges it from its kept base when it receives the adapters alone
(``inference/engine.py``), and the trainer recomputes the engine's merge to verify that sync
(``sync/lora_sync.py``): the engine's served tensor and the trainer's reference are then the
same floating-point operations on the same inputs, so their checksums can be compared bit for
bit (on the same kind of device; a CPU and a GPU round a matmul differently).
"""

from __future__ import annotations

import torch


def merge_fp32(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``base [out, in] + scale * b [out, r] @ a [r, in]``, every operand taken in fp32; returns a
    new fp32 ``[out, in]`` tensor (cast it once to the served dtype)."""
    return base.float() + scale * torch.matmul(b.float(), a.float())
