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
from typing import Optional

import torch.distributed as dist


def bind_group_store(master_address: str) -> socket.socket:
    """A listening socket on ``master_address`` at a port the OS picks, for rank 0 to host a
    group's store on (``init_custom_process_group(listen_socket=...)``). Bound before the port
    is handed to the other ranks, so no other process can take it in between (a port picked
    free and bound later can be: CI lost that race for a launched server once)."""
    return socket.create_server((master_address, 0))


def init_custom_process_group(*, backend: str, master_address: str, master_port: int, world_size: int,
                              rank: int, group_name: str, timeout_s: float = 300.0,
                              listen_socket: Optional[socket.socket] = None):
    """Join (rank 0: host) the group ``group_name``; blocks until all ``world_size`` ranks joined.
    Rank 0 hosts the store on ``listen_socket`` when given (``bind_group_store``; it then owns
    the socket), else on a socket it binds to ``master_address:master_port``."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    # The store is built directly, not through `rendezvous("tcp://...")`: under torchrun
    # (TORCHELASTIC_USE_AGENT_STORE=True) rendezvous would make rank 0 a *client* of the
    # elastic agent's store instead of hosting this group's store, and the engine's ranks
    # would wait on a port nobody listens on.
    # TCPStore's own server listens on EVERY interface whatever master_address says: rank 0
    # hands it a socket bound to master_address instead (loopback by default), so the
    # weight-update rendezvous is not reachable from the network unless configured so.
    listen_fd = None
    if rank == 0:
        listen_fd = (listen_socket or socket.create_server((master_address, master_port))).detach()
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
