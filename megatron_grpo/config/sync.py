"""`sync:` section: how the trained weights reach the rollout engine after every step, and how
the trainer checks what the engine then serves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megatron_grpo.config.base import check


@dataclass(kw_only=True)
class SyncConfig:
    """`sync:` the per-step weight sync into the engine and its verification (docs/weight_sync.md)."""

    transport: Literal["distributed", "tensor", "disk"] = "distributed"
    """How new weights reach the engine each step: a process group broadcast, colocated
    tensors, or safetensors files + /update_weights_from_disk."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend of the distributed transport. auto: what the engine kind supports
    on this machine (NCCL with CUDA where the engine accepts it, else gloo)."""

    master_address: Optional[str] = None
    """Address of trainer rank 0's machine that the weight-update group of the distributed
    transport listens on and the engines connect to. null: 127.0.0.1, which only an engine on
    the same machine can reach: set it (an address of this machine the engines can reach)
    when engine.urls names engines on other hosts."""

    bucket_mb: int = 512
    """Size of one weight-sync bucket in MiB."""

    verify_every: int = 1
    """Verify what the engines serve every N syncs (0 = never): per-tensor checksums on the
    embedded engine; on SGLang, the first rows of each tensor (/get_weights_by_name, where the
    architecture supports it) and the log-probs of a probe sequence against the trainer's."""

    verify_logprob_tolerance: float = 1e-3
    """Largest mean |engine - trainer| log-prob on the verification probe (temperature 1). fp32
    on both sides agrees to ~1e-6; raise it when the engine runs in bf16 (~1e-2)."""

    def __post_init__(self):
        check(self.bucket_mb >= 1, "bucket_mb", f"must be >= 1, got {self.bucket_mb}")
        check(self.verify_every >= 0, "verify_every", "must be >= 0")
        check(self.verify_logprob_tolerance > 0, "verify_logprob_tolerance", "must be > 0")
        check(self.master_address is None or bool(self.master_address.strip()),
              "master_address", "must be an address or null")
