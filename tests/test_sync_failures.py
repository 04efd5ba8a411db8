"""Weight sync against an engine that dies: a clear error within the timeout, never a hang.

Single process (no model parallelism): the tensors come from the HF checkpoint itself, which
is all this test needs to prove about failure handling; the mapping and TP/PP are covered
by test_sync_weights.py.
"""

import os
import signal
import time

import pytest
import torch

from megatron_grpo.generation.manager import RolloutServerManager
from megatron_grpo.wire.buckets import Bucket, plan_buckets
from megatron_grpo.sync.driver import WeightSync, WeightSyncError
from megatron_grpo.sync.servers import ServerDelivery
from tools.tiny import save_tiny_model
from megatron_grpo.config import EngineConfig, SyncConfig
from tests.support.configs import experiment

TIMEOUT_S = 5.0


def hf_tensors(model_dir):
    from safetensors.torch import load_file

    return list(load_file(os.path.join(model_dir, "model.safetensors")).items())


@pytest.fixture
def launched(tmp_path):
    model_dir = str(save_tiny_model(tmp_path / "qwen2", "qwen2"))
    cfg = experiment(engine=EngineConfig(dtype="float32", launch_timeout_s=120))
    manager = RolloutServerManager(cfg, model_dir=model_dir, run_dir=tmp_path)
    manager.start()
    yield manager, model_dir
    manager.stop()


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["distributed", "tensor"])
def test_engine_killed_during_sync_is_reported_within_the_timeout(launched, transport):
    manager, model_dir = launched
    tensors = hf_tensors(model_dir)

    def iter_weights_then_kill(chunks, hf_config):
        for i, item in enumerate(tensors):
            if i == len(tensors) // 2:  # mid-sync: buckets already sent, more to come
                os.kill(manager.pid, signal.SIGKILL)
                time.sleep(0.2)
            yield item

    cfg = experiment(engine=EngineConfig(request_timeout_s=TIMEOUT_S, max_retries=2),
                     sync=SyncConfig(transport=transport, bucket_mb=1))
    syncer = WeightSync(cfg, None, ServerDelivery(cfg, manager.urls, None), iter_weights=iter_weights_then_kill)
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"send \(step 1\) failed on rank 0: .*{manager.urls[0]}"):
        syncer.sync([], 1)
    assert time.monotonic() - started < TIMEOUT_S * 3
    syncer.close()


@pytest.mark.slow
def test_sync_to_a_dead_engine_fails_fast(launched):
    manager, model_dir = launched
    os.kill(manager.pid, signal.SIGKILL)
    time.sleep(0.5)
    cfg = experiment(engine=EngineConfig(request_timeout_s=TIMEOUT_S, max_retries=2))
    syncer = WeightSync(cfg, None, ServerDelivery(cfg, manager.urls, None),
                        iter_weights=lambda c, h: iter(hf_tensors(model_dir)))
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"prepare \(pause/flush\) failed on rank 0: RolloutError"):
        syncer.sync([], 1)
    assert time.monotonic() - started < TIMEOUT_S
    syncer.close()


def test_buckets_respect_the_size_and_dtype():
    tensors = [("a", torch.ones(100)), ("b", torch.ones(300)), ("c", torch.ones(10, dtype=torch.bfloat16)),
               ("d", torch.ones(50)), ("e", torch.ones(2000))]
    buckets = list(plan_buckets(tensors, bucket_bytes=1600))
    layout = [(b.names, b.dtype, b.nbytes) for b in buckets]
    # fp32: a (400 B) + b (1200 B) = 1600 fits; d (200 B) opens a new one; e (8000 B) goes
    # alone; the still-open buckets (bf16 c, fp32 e) are flushed at the end in opening order
    assert layout == [(["a", "b"], torch.float32, 1600), (["d"], torch.float32, 200),
                      (["c"], torch.bfloat16, 20), (["e"], torch.float32, 8000)]
    flat = buckets[0].pack()
    assert flat.dtype == torch.uint8 and flat.numel() == 1600
    assert torch.equal(flat[400:].view(torch.float32), torch.ones(300))
    assert isinstance(buckets[0], Bucket)


def test_tensor_payloads_cannot_run_code():
    import base64
    import pickle

    from megatron_grpo.wire.serialize import deserialize_named_tensors, serialize_named_tensors, use_file_system_sharing

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(ValueError, match="posix.system is not allowed|os.system is not allowed"):
        deserialize_named_tensors(base64.b64encode(pickle.dumps([("x", Evil())])).decode())
    use_file_system_sharing()  # what a sender does; the fd strategy's globals are refused
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    (name, back), = deserialize_named_tensors(serialize_named_tensors([("w", t)]))
    assert name == "w" and torch.equal(back, t)


def _closed_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.slow
def test_a_dead_engine_does_not_leave_the_live_one_inside_the_bracket(launched):
    """CI found this: engine 2 died while engine 1 had opened its bracket; every retry was refused."""
    manager, model_dir = launched
    live = manager.urls[0]
    cfg = experiment(engine=EngineConfig(request_timeout_s=TIMEOUT_S, max_retries=1),
                     sync=SyncConfig(transport="tensor"))
    syncer = WeightSync(cfg, None, ServerDelivery(cfg, [live, _closed_port_url()], None),
                        iter_weights=lambda c, h: iter(hf_tensors(model_dir)))
    with pytest.raises(WeightSyncError, match=r"prepare \(pause/flush\) failed on rank 0: .*ConnectError"):
        syncer.sync([], 1)
    syncer.close()
    # the live engine was finished (bracket closed, generating again): a sync to it alone succeeds
    # without having to close anything, and moves its version
    retry = WeightSync(cfg, None, ServerDelivery(cfg, [live], None),
                       iter_weights=lambda c, h: iter(hf_tensors(model_dir)))
    retry.sync([], 2)
    assert retry.delivery.client.weight_version(live) == "2"
    retry.close()


@pytest.mark.slow
def test_a_bracket_left_open_by_an_earlier_trainer_is_closed(launched, caplog):
    manager, model_dir = launched
    url = manager.urls[0]
    cfg = experiment(engine=EngineConfig(request_timeout_s=TIMEOUT_S, max_retries=1),
                     sync=SyncConfig(transport="tensor"))
    syncer = WeightSync(cfg, None, ServerDelivery(cfg, [url], None),
                        iter_weights=lambda c, h: iter(hf_tensors(model_dir)))
    syncer.delivery.client.begin_weight_update(url)  # what a trainer killed mid-sync leaves behind
    with caplog.at_level("WARNING"):
        syncer.sync([], 3)
    assert "had a weight-update bracket open" in caplog.text
    assert syncer.delivery.client.weight_version(url) == "3"
    syncer.close()
