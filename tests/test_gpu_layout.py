"""The GPU-side decisions that a CPU can check: where launched engines go and which layouts
are refused (runtime/placement.py, preflight/layout.py), the launch commands, the tensor transport's payload
(CUDA IPC handles carry GPU UUIDs), the RNG state in checkpoints, the colocated mode's order
of calls, and the smoke script's answer on a machine without CUDA.

Real GPUs are absent here; where a test needs "a machine with N GPUs" it passes the facts to
the pure function that decides (``layout_problem(cuda=..., num_gpus=...)``)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_grpo.config import EngineConfig, ExperimentConfig, SGLangConfig, SyncConfig
from megatron_grpo.config.base import ConfigError, build_section
from megatron_grpo.preflight import check_engine, layout_problem
from megatron_grpo.generation.adapters import ENGINES
from megatron_grpo.runtime import placement

ROOT = Path(__file__).resolve().parent.parent


def _experiment(**sections) -> ExperimentConfig:
    """A config of a small rollout batch, with ``sections`` (``engine={...}``, ``sync={...}``)."""
    raw = {"model": {"hf_dir": "m"}, "data": {"train_file": "d.jsonl"}, "trainer": {"run_dir": "r"},
           "rollout": {"num_generations": 2, "prompts_per_step": 4}, **sections}
    return build_section(ExperimentConfig, raw)


def _problem(cfg, cuda=True, num_gpus=8, ranks_on_node=2, te=True):
    return layout_problem(cfg, cuda=cuda, num_gpus=num_gpus, ranks_on_node=ranks_on_node,
                          transformer_engine=te)


# ---- placement ------------------------------------------------------------------------------

def test_engines_go_after_the_trainer_gpus_by_default_and_onto_them_when_colocated():
    separate = EngineConfig(kind="sglang", num_servers=2, sglang=SGLangConfig(tp=2))
    assert placement.engine_gpu_ids(separate, SyncConfig(), 2, 2) == [[2, 3], [4, 5]]
    assert placement.engine_gpu_ids(separate, SyncConfig(transport="tensor"), 2, 2) == [[0, 1], [2, 3]]
    assert placement.engine_gpu_ids(EngineConfig(base_gpu_id=5), SyncConfig(), 4, 1) == [[5]]


def test_two_nccl_ranks_on_one_gpu_is_refused_naming_the_keys():
    cfg = _experiment(engine={"base_gpu_id": 1})  # the embedded engine on GPU 1, where trainer rank 1 is
    key, message = _problem(cfg)
    assert key == "engine.base_gpu_id" and "two ranks on one GPU" in message and "base_gpu_id >= 2" in message
    assert _problem(_experiment(engine={"base_gpu_id": 2})) is None
    assert _problem(_experiment()) is None  # default: right after the trainer's GPUs
    # the same GPUs are fine with gloo, or with the tensor transport (no NCCL group)
    assert _problem(_experiment(engine={"base_gpu_id": 1}, sync={"backend": "gloo"})) is None
    assert _problem(_experiment(engine={"base_gpu_id": 0}, sync={"transport": "tensor"})) is None
    # engines on other machines (urls) are not placed here
    assert _problem(_experiment(engine={"base_gpu_id": 0, "urls": ["http://127.0.0.1:1"]})) is None


def test_engine_gpus_must_exist():
    key, message = _problem(_experiment(engine={"kind": "sglang", "num_servers": 2, "sglang": {"tp": 4}}), num_gpus=8)
    assert key == "engine.base_gpu_id" and "need GPUs 2-9 but this machine has 8" in message


def test_gpu_only_features_are_refused_without_cuda():
    assert _problem(_experiment(sync={"backend": "nccl"}), cuda=False)[0] == "sync.backend"
    colocated = _experiment(engine={"kind": "sglang", "colocate": True}, sync={"transport": "tensor"})
    assert _problem(colocated, cuda=False)[0] == "engine.colocate"
    assert _problem(colocated, cuda=True) is None
    dist_opt = _experiment()
    dist_opt.parallel.use_distributed_optimizer = True
    assert _problem(dist_opt, cuda=False)[0] == "parallel.use_distributed_optimizer"
    dist_opt.parallel.use_distributed_optimizer = "auto"
    assert _problem(dist_opt, cuda=False) is None
    kernel = _experiment()
    kernel.model.logprob_kernel = "triton"
    key, message = _problem(kernel, cuda=False)
    assert key == "model.logprob_kernel" and "triton needs CUDA" in message and "use auto or torch" in message
    assert _problem(kernel, cuda=True) is None
    kernel.model.logprob_kernel = "auto"
    assert _problem(kernel, cuda=False) is None
    sp = _experiment()
    sp.parallel.tp, sp.parallel.sequence_parallel = 2, True
    assert _problem(sp, te=False)[0] == "parallel.sequence_parallel"
    assert _problem(sp, te=True) is None


@pytest.mark.parametrize("url,address,bad", [
    ("http://10.0.0.7:30000", None, True),
    ("http://10.0.0.7:30000", "127.0.0.1", True),
    ("http://gpu-node-3:30000", "localhost", True),
    ("http://10.0.0.7:30000", "10.0.0.2", False),
    ("http://127.0.0.1:30000", None, False),
    ("http://localhost:30000", None, False),
    ("http://[::1]:30000", None, False),
])
def test_a_remote_engine_is_not_told_to_connect_to_loopback(url, address, bad):
    engine = {"urls": [url]}
    if bad:
        with pytest.raises(ConfigError, match=r"sync.master_address: .* is on another host"):
            check_engine(_experiment(engine=engine, sync={"master_address": address}))
        # the disk and tensor transports do not connect back
        check_engine(_experiment(engine=engine, sync={"master_address": address, "transport": "disk"}))
    else:
        check_engine(_experiment(engine=engine, sync={"master_address": address}))


def test_colocate_needs_the_tensor_transport_and_an_engine_that_releases_memory():
    with pytest.raises(ConfigError, match="engine.colocate: needs sync.transport: tensor"):
        check_engine(_experiment(engine={"kind": "sglang", "colocate": True}))
    with pytest.raises(ConfigError, match="engine.colocate: engine.kind='embedded' cannot release"):
        check_engine(_experiment(engine={"colocate": True}, sync={"transport": "tensor"}))


def test_the_master_address_reaches_the_transport():
    from megatron_grpo.sync.servers import ServerDelivery

    cfg = _experiment(engine={"urls": ["http://10.0.0.7:1"]}, sync={"master_address": "10.0.0.2"})
    syncer = ServerDelivery(cfg, cfg.engine.urls, None)
    try:
        assert syncer.transport.master_address == "10.0.0.2"
    finally:
        syncer.close()


def test_launch_commands_place_the_engine():
    sglang, embedded = ENGINES["sglang"], ENGINES["embedded"]
    cfg = _experiment(engine={"kind": "sglang", "sglang": {"python": sys.executable, "tp": 2}})
    assert "--base-gpu-id" not in sglang.launch_command(cfg, "m", "127.0.0.1", 1)
    if torch.cuda.is_available():  # pragma: no cover - the CPU flags replace placement here
        cmd = sglang.launch_command(cfg, "m", "127.0.0.1", 1, [4, 5])
        assert cmd[cmd.index("--base-gpu-id") + 1] == "4"
    colocated = _experiment(engine={"kind": "sglang", "sglang": {"python": sys.executable}, "colocate": True},
                            sync={"transport": "tensor"})
    assert "--enable-memory-saver" in sglang.launch_command(colocated, "m", "127.0.0.1", 1, [0])
    cmd = embedded.launch_command(_experiment(), "m", "127.0.0.1", 1, [3])
    assert cmd[cmd.index("--device") + 1] == "cuda:3"
    cmd = embedded.launch_command(_experiment(), "m", "127.0.0.1", 1, None)
    assert cmd[cmd.index("--device") + 1] == "cpu"


# ---- the tensor transport's payload ---------------------------------------------------------

def test_cpu_payload_is_unchanged_shared_memory():
    from megatron_grpo.sync.transports import tensor_bucket_buffer
    from megatron_grpo.wire.serialize import deserialize_named_tensors, serialize_named_tensors, use_file_system_sharing

    use_file_system_sharing()  # what the tensor transport sets when it is created
    buffer = tensor_bucket_buffer(64, torch.device("cpu"))
    assert buffer.is_shared() and buffer.device.type == "cpu"
    named = [("a", buffer[:32].view(torch.float32).view(2, 4)), ("b", buffer[32:].view(torch.int64))]
    named[0][1].copy_(torch.arange(8.0).view(2, 4))
    text = serialize_named_tensors(named)
    back = deserialize_named_tensors(text)
    assert [n for n, _ in back] == ["a", "b"] and torch.equal(back[0][1], named[0][1])
    back[0][1][0, 0] = 42.0  # the same memory, not a copy
    assert named[0][1][0, 0] == 42.0


def test_cuda_handles_travel_with_the_gpu_uuid():
    """The device slot of rebuild_cuda_tensor's arguments carries the GPU UUID (what SGLang's
    receiver expects); the receiver maps it to its own index, and refuses a GPU it cannot see."""
    from megatron_grpo.wire import serialize

    args = tuple(range(15))
    assert serialize._with_device(args, lambda d: f"GPU-{d}") == (*range(6), "GPU-6", *range(7, 15))
    uuids = ["GPU-aaa", "GPU-bbb"]
    assert serialize.device_index("GPU-bbb", uuids) == 1
    assert serialize.device_index(0, uuids) == 0
    with pytest.raises(ValueError, match="not visible to this process"):
        serialize.device_index("GPU-ccc", uuids)
    unpickler = serialize._SafeUnpickler(__import__("io").BytesIO(b""))
    assert unpickler.find_class("torch.multiprocessing.reductions", "rebuild_cuda_tensor") \
        is serialize.rebuild_cuda_tensor_by_uuid


def test_every_global_of_a_cuda_reduction_is_allowed(monkeypatch):
    """The receiver's allow-list admits every global in the argument tuple that torch's
    ``reduce_tensor`` builds for a CUDA tensor (its class, size, storage class, dtype): found
    on a GPU, where the storage class ``TypedStorage`` was refused. The tuple is built here
    as torch builds it (no CUDA needed) and goes through the real pickler and unpickler."""
    import base64
    import io
    import pickle

    from megatron_grpo.wire import serialize

    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    args = (type(t), t.size(), t.stride(), 0, type(t._typed_storage()), t.dtype, "GPU-x", b"handle", 12, 0,
            False, b"ref", 0, b"event", True)
    assert len(args) == 15 and args[serialize.CUDA_DEVICE_ARG] == "GPU-x"

    class Reduced:
        def __reduce__(self):
            return torch.multiprocessing.reductions.rebuild_cuda_tensor, args

    seen = []
    monkeypatch.setattr(serialize, "rebuild_cuda_tensor_by_uuid", lambda *a: seen.append(a) or torch.zeros(1))
    text = base64.b64encode(pickle.dumps([("w", Reduced())])).decode("ascii")
    [(name, _)] = serialize.deserialize_named_tensors(text)
    assert name == "w" and seen == [args]


# ---- checkpoints: RNG state ------------------------------------------------------------------

def test_rng_state_round_trip_on_cpu_and_gpu_keys_only_with_cuda():
    from megatron_grpo.trainer.checkpoint import rng_state, set_rng_state

    state = rng_state(cuda=False)
    assert set(state) == {"torch"}
    first = torch.rand(4)
    set_rng_state(state, cuda=False)
    assert torch.equal(torch.rand(4), first)
    # a GPU run's checkpoint read on a CPU machine: the CUDA entries are skipped, not an error
    gpu_state = {**state, "cuda": torch.zeros(16, dtype=torch.uint8), "tracker": {"model-parallel-rng": state["torch"]}}
    set_rng_state(gpu_state, cuda=False)
    assert torch.equal(torch.rand(4), first)


# ---- colocated mode: the order of the calls ---------------------------------------------------

class _RecordingAdapter:
    """Stands in for SGLang on a GPU, which cannot run here: records the memory calls."""

    def __init__(self, calls):
        self.calls = calls

    def release_memory(self, client, url):
        self.calls.append(("release", url))

    def resume_memory(self, client, url, tags=None):
        self.calls.append(("resume", tuple(tags or ())))


def _colocated_guard(rank, world):
    from types import SimpleNamespace

    from megatron_grpo.generation.http_engine import HttpEngine
    from megatron_grpo.rollout.supervisor import EngineSupervisor

    calls = []
    manager = SimpleNamespace(urls=["http://e0", "http://e1"], adapter=_RecordingAdapter(calls), launched=True)
    syncer = SimpleNamespace(sync=lambda modules, step: calls.append(("sync", step)) or "stats")
    engine = HttpEngine(manager, None, syncer)
    guard = EngineSupervisor(engine, [], max_attempts=1, colocate=True, owner=True)
    assert guard.sync(0) == "stats"  # the first sync: the engine holds its memory
    guard.release_memory()
    guard.release_memory()  # once per step
    guard.sync(1)
    plain = EngineSupervisor(engine, [], max_attempts=1, owner=True)
    plain.release_memory()  # not colocated: nothing is called
    return calls


def test_colocated_engine_releases_after_generation_and_resumes_around_the_sync():
    from tests.support.distributed import run_distributed

    (calls,) = run_distributed(_colocated_guard, 1, timeout_s=120)
    assert calls == [("sync", 0), ("release", "http://e0"), ("release", "http://e1"),
                     ("resume", ("weights",)), ("resume", ("weights",)), ("sync", 1),
                     ("resume", ("kv_cache",)), ("resume", ("kv_cache",))]


def test_memory_routes_are_named_only_by_the_sglang_adapter():
    from megatron_grpo.generation.adapters import sglang

    assert sglang._RELEASE_MEMORY[1] == "/release_memory_occupation"
    assert ENGINES["sglang"].supports_memory_release and not ENGINES["embedded"].supports_memory_release


# ---- the smoke script -------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
def test_gpu_smoke_says_in_one_line_that_it_needs_a_gpu():
    proc = subprocess.run([sys.executable, "-m", "tools.bench.gpu_smoke"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], proc.stderr
