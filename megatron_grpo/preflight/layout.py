"""The GPU layouts that cannot work on a machine, given its facts.

A pure function of the config and the machine's facts passed in (CUDA or not, how many
devices, how many trainer ranks run on this machine, TransformerEngine or not), so a CPU test
can check it for any machine. Where each GPU goes is ``runtime.placement``'s to say; the rules
(each a one-line error naming the keys):

* the NCCL weight-update group (distributed transport, NCCL backend) joins trainer rank 0 and
  every engine rank: an engine GPU that is also a trainer GPU puts two NCCL ranks on one
  device, which NCCL rejects (or deadlocks on);
* ``engine.colocate`` (``rules.colocate_problem``), the NCCL backend, the distributed
  optimizer and a quantization the engine runs only on GPUs (SGLang's fp8) need CUDA;
  sequence parallelism needs TransformerEngine's layer specs (megatron-core's local spec
  refuses it);
* a launched engine's GPUs must exist.
"""

from __future__ import annotations

from typing import Optional

from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.preflight.rules import colocate_problem
from megatron_grpo.generation.adapters import ENGINES
from megatron_grpo.runtime.placement import engine_gpu_ids


def _span(ids: list[int]) -> str:
    return f"{ids[0]}" if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"


def layout_problem(cfg: ExperimentConfig, *, cuda: bool, num_gpus: int, ranks_on_node: int,
                   transformer_engine: bool = False) -> Optional[tuple[str, str]]:
    """(dotted key, message) of the first layout of ``cfg`` that cannot work on a machine with
    ``num_gpus`` CUDA devices (``cuda``: usable at all), ``ranks_on_node`` trainer ranks and
    TransformerEngine layer specs or not; None when it can."""
    engine_cfg, sync_cfg, adapter = cfg.engine, cfg.sync, ENGINES[cfg.engine.kind]
    if cfg.parallel.sequence_parallel and not transformer_engine:
        return ("parallel.sequence_parallel", "needs TransformerEngine layer specs (CUDA and transformer_engine "
                "installed): megatron-core's local spec has no sequence-parallel norm")
    if not cuda:
        colocate = colocate_problem(cfg, adapter, cuda=False)
        if colocate is not None:
            return colocate
        if engine_cfg.quantization and adapter.quantization_needs_cuda:
            return ("engine.quantization", f"{engine_cfg.quantization} on engine.kind={adapter.name!r} needs CUDA "
                    "(its quantized kernels); this machine has no usable GPU (use engine.kind: embedded, which "
                    "fake-quantizes on the CPU, or null)")
        if sync_cfg.backend == "nccl":
            return "sync.backend", "nccl needs CUDA; this machine has no usable GPU (use auto or gloo)"
        if cfg.model.logprob_kernel == "triton":
            return ("model.logprob_kernel", "triton needs CUDA (the fused Triton kernels run on the GPU); this "
                    "machine has no usable GPU (use auto or torch)")
        if cfg.parallel.use_distributed_optimizer is True:
            return ("parallel.use_distributed_optimizer", "true needs CUDA (megatron-core's DistributedOptimizer); "
                    "this machine has no usable GPU (use auto or false)")
        return None
    if engine_cfg.urls or adapter.in_process:  # no launched engine to place (in-process: rank 0's GPU)
        return None
    servers = engine_gpu_ids(engine_cfg, sync_cfg, ranks_on_node, adapter.gpus_per_server(engine_cfg))
    used = sorted({g for ids in servers for g in ids})
    if used[-1] >= num_gpus:
        return ("engine.base_gpu_id", f"the launched engines need GPUs {_span(used)} but this machine has "
                f"{num_gpus} (trainer ranks here use GPUs {_span(list(range(ranks_on_node)))}); lower "
                "engine.num_servers or engine.sglang.tp, or set engine.base_gpu_id")
    nccl = sync_cfg.transport == "distributed" and adapter.backend(sync_cfg, cuda) == "nccl"
    shared = sorted(set(used) & set(range(ranks_on_node)))
    if nccl and shared:
        return ("engine.base_gpu_id", f"the launched engines would use GPU(s) {_span(shared)}, which trainer ranks "
                f"use too: the NCCL weight-update group cannot have two ranks on one GPU; set engine.base_gpu_id "
                f">= {ranks_on_node}, or use sync.transport=tensor (colocated)")
    return None
