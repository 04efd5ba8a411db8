"""The launch scripts of the README, run as a user runs them."""

import re
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_grpo.runtime.parallel import peer_failure
from megatron_grpo.trainer.cli import _launcher_exception as launcher_exception
from megatron_grpo.trainer.nodes import NodeError, NodeSpec

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (ROOT / "launch").iterdir() if p.suffix in (".sh", ".sbatch"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    # A quote inside ${VAR:?message} once made multi_node.sh unparseable: every multi-node
    # launch failed before torchrun started.
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


# What gloo and NCCL raise when a peer is gone, and the one line the ranks print for it.
PEER_ERRORS = [
    (RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                  "[10.0.0.2]:33440. This is typically caused by a remote worker crashing. GLHF!"),
     "Connection closed by peer [10.0.0.2]:33440"),
    (RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                  "600000ms for recv operation to complete"),
     "Timed out waiting 600000ms for recv operation to complete"),
    (dist.DistBackendError("NCCL communicator was aborted on rank 3. Original reason: watchdog"),
     "NCCL communicator was aborted on rank 3"),
]


@pytest.mark.parametrize("error,line", PEER_ERRORS, ids=["gloo-closed", "gloo-timeout", "nccl"])
def test_peer_failure_is_one_line(error, line):
    try:
        try:
            raise error
        except Exception as e:
            raise KeyError("a wrapper (dist_checkpointing, ...)") from e
    except KeyError as wrapped:
        assert peer_failure(wrapped) == line


def test_other_errors_are_not_peer_failures():
    assert peer_failure(RuntimeError("shape mismatch [2, 3] vs [3, 2]")) is None
    assert peer_failure(ValueError("gloo/transport/ in a value error")) is None


# ---- megatron-grpo train as one node of several ---------------------------------------------

def test_one_node_is_standalone_and_several_meet_at_node_0():
    assert NodeSpec().torchrun_args(600) == ["--standalone"]
    assert NodeSpec(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400).torchrun_args(59.5) == [
        "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29400", "--rdzv_conf=timeout=60"]


@pytest.mark.parametrize("kwargs,fragment", [
    ({"nnodes": 0}, "--nnodes must be >= 1"),
    ({"nnodes": 2, "node_rank": 2, "master_addr": "h"}, "--node-rank must be in 0..1"),
    ({"nnodes": 2}, "--master-addr (the address of node 0) is required"),
    ({"master_port": 70000}, "--master-port must be in 1..65535"),
])
def test_bad_node_arguments_are_one_line(kwargs, fragment):
    with pytest.raises(NodeError, match=re.escape(fragment)):
        NodeSpec(**kwargs)


def test_torchrun_failure_of_its_own_is_repeated_as_one_line():
    store_timeout = (b"Traceback (most recent call last):\n  File \"run.py\"\n"
                     b"torch.distributed.DistStoreError: Timed out after 11 seconds waiting for clients. "
                     b"1/2 clients joined.\n")
    assert launcher_exception(store_timeout) == ("DistStoreError: Timed out after 11 seconds waiting for "
                                                 "clients. 1/2 clients joined.")
    rank_failed = (b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n====\n"
                   b"megatron_grpo.train FAILED\n----\n  exitcode  : 1 (pid: 12)\n====\n")
    assert launcher_exception(rank_failed) is None  # the rank's own output said why
