"""Which GPUs the trainer and the launched engines use.

Kept free of torch and of the packages above ``runtime``: the pre-flight
(``preflight/layout.py``, ``preflight/rules.py``) decides which layouts cannot work, from these
functions and the machine's facts passed in.

The layout on one machine (indices among the devices the trainer sees)::

    trainer rank with LOCAL_RANK r ........ GPU r        (runtime.parallel.initialize)
    launched engine i, g GPUs each ........ GPUs base + i*g ... base + (i+1)*g - 1
        base = engine.base_gpu_id, or by default: the first GPU after the trainer's (its own
        GPUs), or GPU 0 when the engine shares the trainer's GPUs (colocate / tensor transport)
"""

from __future__ import annotations

import ipaddress
import os
from typing import Optional

from megatron_grpo.config.engine import EngineConfig
from megatron_grpo.config.sync import SyncConfig

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


def shares_trainer_gpus(engine_cfg: EngineConfig, sync_cfg: SyncConfig) -> bool:
    """True when the launched engine is meant to sit on the trainer's GPUs: colocated, or fed
    by the tensor transport (CUDA IPC handles of the trainer's memory)."""
    return engine_cfg.colocate or sync_cfg.transport == "tensor"


def engine_gpu_ids(engine_cfg: EngineConfig, sync_cfg: SyncConfig, ranks_on_node: int,
                   gpus_per_server: int) -> list[list[int]]:
    """The GPUs of each launched server, e.g. 2 trainer ranks, 2 servers of tp 2 ->
    [[2, 3], [4, 5]]; colocated -> [[0, 1], [2, 3]]."""
    if engine_cfg.base_gpu_id is not None:
        base = engine_cfg.base_gpu_id
    else:
        base = 0 if shares_trainer_gpus(engine_cfg, sync_cfg) else ranks_on_node
    return [list(range(base + i * gpus_per_server, base + (i + 1) * gpus_per_server))
            for i in range(engine_cfg.num_servers)]
