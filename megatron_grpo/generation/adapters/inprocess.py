"""The in-process engine (``engine.kind: inprocess``): the embedded engine's generation code
run inside trainer rank 0's process (``generation/inprocess.py``), synced by an in-memory copy
(``sync/in_memory.py``). Nothing is launched and no HTTP route is called."""

from __future__ import annotations

from typing import Optional, Sequence

from megatron_grpo.config.engine import EngineConfig
from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.generation.adapters.base import EngineAdapter


class InProcessAdapter(EngineAdapter):
    name = "inprocess"
    runs = "in_process"
    # The sync is an in-memory copy on rank 0: no transport or process group is used, so every
    # value of sync.transport / sync.backend is accepted and ignored.
    transports = frozenset({"distributed", "tensor", "disk"})
    backends = frozenset({"gloo", "nccl"})
    returns_routing = True  # the embedded engine's generation code (engine.routing)
    reports_sampling_mask = True
    reports_token_versions = True  # the embedded engine's scheduler; the in-memory sync retracts (async)
    quantizations = frozenset({"fp8", "int8"})  # its own quantized copy (engine.quantize)
    fp8_formats = frozenset({"e4m3", "e5m2"})

    def gpus_per_server(self, engine_cfg: EngineConfig) -> int:
        return 0  # it runs on trainer rank 0's device

    def launch_command(self, cfg: ExperimentConfig, model_dir: str, host: str, port: int,
                       gpu_ids: Optional[list[int]] = None, trusted_weight_dirs: Sequence[str] = ()) -> list[str]:
        raise ValueError("engine.kind=inprocess is not a server: nothing is launched (the trainer builds it)")
