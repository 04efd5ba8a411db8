"""The launch scripts of the README, run as a user runs them."""

import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_grpo.runtime.parallel import peer_failure

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
