"""Which GPUs the trainer and the launched engines use, and the layouts that cannot work.

Kept free of torch: the config loader calls ``remote_engine_problem`` while it validates,
and the pre-flight calls ``layout_problem`` with the machine's facts (CUDA or not, how many
devices, how many trainer ranks run on this machine) passed in, so every rule here is a pure
function a CPU test can check for any machine.

The layout on one machine (indices among the devices the trainer sees)::

    trainer rank with LOCAL_RANK r ........ GPU r        (runtime.parallel.initialize)
    launched engine i, g GPUs each ........ GPUs base + i*g ... base + (i+1)*g - 1
        base = rollout.base_gpu_id, or by default: the first GPU after the trainer's (its own
        GPUs), or GPU 0 when the engine shares the trainer's GPUs (colocate / tensor transport)

Rules (each a one-line error naming the keys):

* the NCCL weight-update group (distributed transport, NCCL backend) joins trainer rank 0 and
  every engine rank: an engine GPU that is also a trainer GPU puts two NCCL ranks on one
  device, which NCCL rejects (or deadlocks on);
* an engine in ``rollout.urls`` on another host must be told an address of this machine to
  connect to (``rollout.weight_sync_master_address``), not loopback;
* ``rollout.colocate``, the NCCL backend and the distributed optimizer need CUDA; sequence
  parallelism needs TransformerEngine's layer specs (megatron-core's local spec refuses it);
* a launched engine's GPUs must exist.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Optional
from urllib.parse import urlsplit

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def ranks_on_this_node() -> int:
    """Trainer ranks on this machine: torchrun's LOCAL_WORLD_SIZE (1 outside torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def is_loopback(host: Optional[str]) -> bool:
    """True for None, ``localhost`` and 127.0.0.0/8 or ::1 addresses."""
    if host is None:
        return True
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def remote_engine_problem(rollout) -> Optional[str]:
    """Why the engines in ``rollout.urls`` cannot join the weight-update group, or None.

    With the distributed transport each engine connects to ``weight_sync_master_address``;
    a loopback (or unset) address points an engine on another host at itself.
    """
    if rollout.weight_sync_transport != "distributed" or not is_loopback(rollout.weight_sync_master_address):
        return None
    for i, url in enumerate(rollout.urls):
        host = urlsplit(url).hostname
        if not is_loopback(host):
            return (f"is {rollout.weight_sync_master_address or 'null (127.0.0.1)'} but rollout.urls[{i}] = {url} "
                    "is on another host, which would connect to itself; set it to an address of this machine "
                    "that the engine can reach")
    return None


def shares_trainer_gpus(rollout) -> bool:
    """True when the launched engine is meant to sit on the trainer's GPUs: colocated, or fed
    by the tensor transport (CUDA IPC handles of the trainer's memory)."""
    return rollout.colocate or rollout.weight_sync_transport == "tensor"


def engine_gpu_ids(rollout, ranks_on_node: int, gpus_per_server: int) -> list[list[int]]:
    """The GPUs of each launched server, e.g. 2 trainer ranks, 2 servers of tp 2 ->
    [[2, 3], [4, 5]]; colocated -> [[0, 1], [2, 3]]."""
    if rollout.base_gpu_id is not None:
        base = rollout.base_gpu_id
    else:
        base = 0 if shares_trainer_gpus(rollout) else ranks_on_node
    return [list(range(base + i * gpus_per_server, base + (i + 1) * gpus_per_server))
            for i in range(rollout.num_servers)]


def _span(ids: list[int]) -> str:
    return f"{ids[0]}" if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"


def layout_problem(cfg, *, cuda: bool, num_gpus: int, ranks_on_node: int,
                   transformer_engine: bool = False) -> Optional[tuple[str, str]]:
    """(dotted key, message) of the first layout of ``cfg`` (an ExperimentConfig) that cannot
    work on a machine with ``num_gpus`` CUDA devices (``cuda``: usable at all),
    ``ranks_on_node`` trainer ranks and TransformerEngine layer specs or not; None when it can."""
    from megatron_grpo.rollout.engines import ENGINES  # the adapters import config modules

    rollout, adapter = cfg.rollout, ENGINES[cfg.rollout.engine]
    if cfg.parallel.sequence_parallel and not transformer_engine:
        return ("parallel.sequence_parallel", "needs TransformerEngine layer specs (CUDA and transformer_engine "
                "installed): megatron-core's local spec has no sequence-parallel norm")
    if not cuda:
        if rollout.colocate:
            return "rollout.colocate", "needs CUDA (the engine releases GPU memory); this machine has no usable GPU"
        if rollout.weight_sync_backend == "nccl":
            return "rollout.weight_sync_backend", "nccl needs CUDA; this machine has no usable GPU (use auto or gloo)"
        if cfg.parallel.use_distributed_optimizer is True:
            return ("parallel.use_distributed_optimizer", "true needs CUDA (megatron-core's DistributedOptimizer); "
                    "this machine has no usable GPU (use auto or false)")
        return None
    if rollout.urls:
        return None
    servers = engine_gpu_ids(rollout, ranks_on_node, adapter.gpus_per_server(rollout))
    used = sorted({g for ids in servers for g in ids})
    if used[-1] >= num_gpus:
        return ("rollout.base_gpu_id", f"the launched engines need GPUs {_span(used)} but this machine has "
                f"{num_gpus} (trainer ranks here use GPUs {_span(list(range(ranks_on_node)))}); lower "
                "rollout.num_servers or rollout.sglang.tp, or set rollout.base_gpu_id")
    nccl = rollout.weight_sync_transport == "distributed" and adapter.backend(rollout, cuda) == "nccl"
    shared = sorted(set(used) & set(range(ranks_on_node)))
    if nccl and shared:
        return ("rollout.base_gpu_id", f"the launched engines would use GPU(s) {_span(shared)}, which trainer ranks "
                f"use too: the NCCL weight-update group cannot have two ranks on one GPU; set rollout.base_gpu_id "
                f">= {ranks_on_node}, or use rollout.weight_sync_transport=tensor (colocated)")
    return None
