"""A process group between trainer ranks and rollout engines, independent of the default group.

The trainer ranks already live in a default torch.distributed group (gloo on CPU, NCCL on
GPU); an engine is a separate program. SGLang's ``/init_weights_update_group`` joins a group
built the way below (the recipe SGLang, OpenRLHF and slime share): a TCP rendezvous at
``master_address:master_port`` whose store is hosted by rank 0 (the sending trainer rank),
a ``PrefixStore(group_name)`` so several groups share nothing, and torch's own group
constructor. Both the trainer side (``megatron_grpo.sync``) and the embedded engine use this
function, so they interoperate with each other and with a real SGLang server.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def init_custom_process_group(*, backend: str, master_address: str, master_port: int, world_size: int,
                              rank: int, group_name: str, timeout_s: float = 300.0):
    """Join (rank 0: host) the group ``group_name``; blocks until all ``world_size`` ranks joined."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    # The store is built directly, not through `rendezvous("tcp://...")`: under torchrun
    # (TORCHELASTIC_USE_AGENT_STORE=True) rendezvous would make rank 0 a *client* of the
    # elastic agent's store instead of hosting this group's store, and the engine's ranks
    # would wait on a port nobody listens on.
    # TCPStore's own server listens on EVERY interface whatever master_address says: rank 0
    # hands it a socket bound to master_address instead (loopback by default), so the
    # weight-update rendezvous is not reachable from the network unless configured so.
    listen_fd = socket.create_server((master_address, master_port)).detach() if rank == 0 else None
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False, master_listen_fd=listen_fd)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    # Identity rank map, so `dist.broadcast(t, src=0, group=group)` addresses the group's rank 0.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_custom_process_group(group) -> None:
    """Tear down a group made by ``init_custom_process_group``."""
    dist.destroy_process_group(group)
