"""The tensor transport's CPU wire to the embedded engine (``wire/shm.py``), end to end.

A real launched engine; the tensors come from the HF checkpoint, perturbed like an optimizer
step. Proven here: the engine serves the sent weights bit for bit (read back through
/get_weights_by_name, independent of the checksums); a byte flipped in the segment is caught
by the sync's own verification; the /dev/shm segment is reused across syncs and gone after
close, after a failed send, after the engine died mid-sync, and after a trainer killed with
SIGKILL (the next sender sweeps it).
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_grpo.generation.client import RolloutClient
from megatron_grpo.generation.manager import RolloutServerManager
from megatron_grpo.sync.driver import WeightSync, WeightSyncError
from megatron_grpo.sync.servers import ServerDelivery
from megatron_grpo.sync.transports import ShmBucketWire
from tools.tiny import save_tiny_model
from megatron_grpo.wire.shm import PREFIX, SHM_DIR, open_segment
from megatron_grpo.config import EngineConfig, SyncConfig
from tests.support.configs import experiment

TIMEOUT_S = 10.0


def segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob(PREFIX + "*")}


def hf_tensors(model_dir, step: int) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(step)
    return [(n, t + 0.01 * torch.randn(t.shape, generator=g))
            for n, t in sorted(load_file(os.path.join(model_dir, "model.safetensors")).items())]


@pytest.fixture
def launched(tmp_path):
    model_dir = str(save_tiny_model(tmp_path / "qwen2", "qwen2", seed=3))
    manager = RolloutServerManager(experiment(engine=EngineConfig(dtype="float32", launch_timeout_s=120)),
                                   model_dir=model_dir, run_dir=tmp_path)
    manager.start()
    yield manager, model_dir
    manager.stop()


def make_syncer(urls, tensors, **sync):
    cfg = experiment(engine=EngineConfig(request_timeout_s=TIMEOUT_S, max_retries=1),
                     sync=SyncConfig(transport="tensor", **sync))
    syncer = WeightSync(cfg, None, ServerDelivery(cfg, urls, None), iter_weights=lambda c, h: iter(tensors))
    assert isinstance(syncer.delivery.transport.wire, ShmBucketWire)  # the embedded engine's CPU wire
    return syncer


@pytest.mark.slow
def test_shm_sync_is_bitwise_verified_and_cleaned_up(launched):
    manager, model_dir = launched
    before = segments()
    tensors = hf_tensors(model_dir, 1)
    syncer = make_syncer(manager.urls, tensors)
    stats = syncer.sync([], 1)
    assert stats.verified and stats.num_tensors == len(tensors)
    (mine,) = segments() - before
    tensors[:] = hf_tensors(model_dir, 2)
    syncer.sync([], 2)
    assert segments() - before == {mine}  # one segment, reused by every bucket and sync
    with RolloutClient(manager.urls) as client:
        for name, sent in tensors:  # float32 -> JSON double -> float32 is exact
            served = client.call("get_weights_by_name", {"name": name, "truncate_size": 10**9},
                                 url=manager.urls[0])
            assert torch.equal(torch.tensor(served, dtype=torch.float64).float(), sent), name
        assert client.server_info(manager.urls[0])["weight_version"] == "2"
    syncer.close()
    assert segments() == before


@pytest.mark.slow
def test_a_byte_flipped_in_the_segment_fails_verification_and_leaves_no_segment(launched):
    manager, model_dir = launched
    before = segments()
    syncer = make_syncer(manager.urls, hf_tensors(model_dir, 1))
    send = syncer.delivery.transport.send

    def flipping_send(bucket, **kwargs):
        pack = bucket.pack

        def bad_pack(out=None):
            flat = pack(out)
            flat[flat.numel() // 2] ^= 0x01  # one bit of one byte, in shared memory
            return flat

        bucket.pack = bad_pack
        send(bucket, **kwargs)

    syncer.delivery.transport.send = flipping_send
    with pytest.raises(WeightSyncError, match=r"verification \(step 1\).*differs between the trainer and engine"):
        syncer.sync([], 1)
    syncer.close()
    assert segments() == before


@pytest.mark.slow
def test_engine_death_mid_sync_leaves_no_segment(launched):
    manager, model_dir = launched
    before = segments()
    tensors = hf_tensors(model_dir, 1)

    def iter_then_kill(chunks, hf_config):
        for i, item in enumerate(tensors):
            if i == len(tensors) // 2:  # mid-iteration: the engine is dead when the bucket goes out
                os.kill(manager.pid, signal.SIGKILL)
                time.sleep(0.2)
            yield item

    syncer = make_syncer(manager.urls, tensors, bucket_mb=1)
    syncer._iter_weights = iter_then_kill
    with pytest.raises(WeightSyncError, match="send"):
        syncer.sync([], 1)
    assert segments() == before  # released by the failed send, not only at close
    syncer.close()


def test_segments_of_a_killed_trainer_are_swept_and_foreign_paths_refused(tmp_path):
    code = ("import os, sys, time; from megatron_grpo.wire.shm import ShmSegment; s = ShmSegment(4096); "
            "print(s.path, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    path = child.stdout.readline().strip()
    assert os.path.exists(path)
    ShmBucketWire().release()  # a live owner's segment is kept
    assert os.path.exists(path)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert os.path.exists(path)  # SIGKILL: no chance to unlink
    ShmBucketWire().release()  # the next sender on the machine sweeps it
    assert not os.path.exists(path)
    outside = tmp_path / f"{PREFIX}1_0123456789abcdef"
    outside.write_bytes(b"x" * 16)
    for bad in (str(outside), "/etc/passwd", str(SHM_DIR / "other")):
        with pytest.raises(ValueError, match="not a megatron-grpo bucket segment"):
            open_segment(bad, 1)


def test_each_engine_kind_names_its_tensor_wire():
    """SGLang keeps its own /update_weights_from_tensor payload everywhere; the embedded engine
    gets the shm wire on the CPU and SGLang's CUDA-IPC payload on a GPU."""
    from megatron_grpo.generation.adapters import ENGINES
    from megatron_grpo.sync.transports import TENSOR_WIRES

    # the in-process engine has no wire: it is synced by an in-memory copy (sync/in_memory.py)
    assert {name: (a.tensor_wire(False), a.tensor_wire(True)) for name, a in ENGINES.items() if not a.in_process} == {
        "embedded": ("shm_bucket", "named_tensors"), "sglang": ("named_tensors", "named_tensors")}
    assert all(a.tensor_wire(c) in TENSOR_WIRES for a in ENGINES.values() for c in (False, True))


def test_the_sweep_leaves_other_users_segments_alone(tmp_path):
    """A dead sender's segment of this user is swept; one owned by another user is skipped,
    whatever its pid (before: PermissionError in /dev/shm's sticky directory ended the sweep
    and with it the run's start)."""
    from megatron_grpo.wire.shm import remove_stale_segments

    if os.getuid() != 0:
        pytest.skip("only root can hand a file to another user (CI and this machine run as root)")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    mine, theirs = (tmp_path / f"{PREFIX}{dead}_{c * 16}" for c in "ab")
    for path in (mine, theirs):
        path.write_bytes(b"x")
    os.chown(theirs, os.getuid() + 4242, -1)
    removed = remove_stale_segments(tmp_path)
    assert removed == [mine.name] and not mine.exists() and theirs.exists()
