"""Where this machine stands in a run: one node (`--standalone`) or node ``node_rank`` of
``nnodes`` meeting at ``master_addr:master_port``. ``megatron-grpo train`` turns it into
torchrun's rendezvous arguments; launch/multi_node.sh and launch/slurm.sbatch pass it in.

torchrun's static rendezvous is used for several nodes (no etcd, no elastic membership):
node 0's torchrun hosts the store, every node must be started with the same ``nnodes`` and
its own ``node_rank``, and the wait for the others is bounded by
``parallel.distributed_timeout_s`` (torchrun's own default is 600 s).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Optional

DEFAULT_MASTER_PORT = 29500


class NodeError(ValueError):
    """A wrong node argument; ``str(e)`` is the one-line message naming it."""


@dataclass(kw_only=True, frozen=True)
class NodeSpec:
    nnodes: int = 1
    """Machines in the run, each running one `megatron-grpo train`."""

    node_rank: int = 0
    """This machine's index in 0..nnodes-1 (node 0 hosts the rendezvous and global rank 0)."""

    master_addr: Optional[str] = None
    """Address of node 0 that every node can reach (required with nnodes > 1)."""

    master_port: int = DEFAULT_MASTER_PORT
    """TCP port of the rendezvous on node 0."""

    def __post_init__(self):
        if self.nnodes < 1:
            raise NodeError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise NodeError(f"--node-rank must be in 0..{self.nnodes - 1} (--nnodes {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.master_addr:
            raise NodeError(f"--master-addr (the address of node 0) is required with --nnodes {self.nnodes}")
        if not 0 < self.master_port < 65536:
            raise NodeError(f"--master-port must be in 1..65535, got {self.master_port}")

    def torchrun_args(self, timeout_s: float) -> list[str]:
        """torchrun's rendezvous arguments (before ``--nproc_per_node``)."""
        if self.nnodes == 1 and not self.master_addr:
            return ["--standalone"]
        return [f"--nnodes={self.nnodes}", f"--node_rank={self.node_rank}", f"--master_addr={self.master_addr}",
                f"--master_port={self.master_port}",
                # the static rendezvous reads an integer number of seconds
                f"--rdzv_conf=timeout={max(1, math.ceil(timeout_s))}"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, default=1, help="machines in the run (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1")
    parser.add_argument("--master-addr", default=None, help="address of node 0 (required with --nnodes > 1)")
    parser.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT,
                        help=f"rendezvous port on node 0 (default {DEFAULT_MASTER_PORT})")


def from_args(args: argparse.Namespace) -> NodeSpec:
    return NodeSpec(nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                    master_port=args.master_port)
