"""The adapter-only weight sync of a LoRA policy into the embedded engine over HTTP
(``inference/lora_update.py``, ``sync/lora_sync.py``).

Route level (the embedded engine's app in-process, a tiny qwen2; the requests as the trainer's
transports send them): the engine keeps the base exactly as sent (fp32 under a bf16 engine) and
serves ``merge_fp32(base, A, B, scale)`` cast once, bit for bit, from that base every time; a
plain load of the weight drops the base; a bad adapter request (outside a session, no base
loaded, an unknown parameter, a wrong shape, a tensor no module uses, a malformed key, a rank
past the bound) is a 400 naming the problem and changes nothing; the disk wire carries the
same keys in each file's metadata.

End to end (``@slow``: the CPU demo at TP2 with the launched embedded engine): every sync after
the first moves the adapters alone (<= 5% of the merged bytes), every sync is verified against
the trainer's own recomputation of the engine's merge, the probe and the train/rollout
mismatch are <= 1e-5, and an engine killed mid-run is relaunched and sent the base again.
"""

import json
import subprocess

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from megatron_grpo.inference.engine import EmbeddedEngine
from megatron_grpo.inference.limits import RequestLimits
from megatron_grpo.inference.server import build_app
from tools.tiny import save_tiny_model
from megatron_grpo.ops.lora_merge import merge_fp32
from megatron_grpo.wire.buckets import DISK_UPDATE_KEY, Bucket
from megatron_grpo.wire.checksum import tensor_checksum
from megatron_grpo.wire.shm import ShmSegment
from tests.support.demo_run import ENV, ROOT, kill_engine_after, read_metrics, train_cmd

LAYER = "model.layers.0."
QKV = [LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"]  # a fused adapter: one A for the three
O_PROJ = LAYER + "self_attn.o_proj.weight"
RANK, SCALE = 4, 2.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2", seed=3)


@pytest.fixture(scope="module")
def base(model_dir):
    """The checkpoint's weights moved off it (a LoRA run's base need not be the HF weights)."""
    g = torch.Generator().manual_seed(0)
    return {n: t + 0.01 * torch.randn(t.shape, generator=g)
            for n, t in load_file(str(model_dir / "model.safetensors")).items()}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def served(model_dir, tmp_path_factory, request):
    """(engine, client) of the app over a fresh engine, in each dtype."""
    engine = EmbeddedEngine(model_dir, dtype=request.param, max_batch_size=4, seed=0)
    trusted = tmp_path_factory.mktemp("weights")
    with TestClient(build_app(engine, limits=RequestLimits(trusted_weight_dirs=(str(trusted),)))) as client:
        client.trusted = trusted
        yield engine, client
    engine.shutdown()


class Sender:
    """The tensor transport's CPU wire, by hand: a bucket packed into a /dev/shm segment and
    posted to /update_weights_from_shm with its extra keys."""

    def __init__(self, client):
        self.client, self.segments = client, []

    def post(self, named: list, **extras):
        bucket = Bucket(dtype=named[0][1].dtype)
        for name, t in named:
            bucket.add(name, t)
        segment = ShmSegment(bucket.nbytes)
        self.segments.append(segment)  # kept mapped until the test ends
        bucket.pack(out=segment.tensor)
        return self.client.post("/update_weights_from_shm", json={
            "path": segment.path, "names": bucket.names, "dtypes": [bucket.dtype_name] * len(bucket.names),
            "shapes": bucket.shapes, "compute_checksums": True, **extras})


def adapters(seed: int):
    """A fused q/k/v adapter (one A [r, 64], a B per module) and an o_proj one, fp32."""
    g = torch.Generator().manual_seed(seed)
    a_qkv = torch.randn(RANK, 64, generator=g)
    bs = {n: torch.randn(out, RANK, generator=g) for n, out in zip(QKV, (64, 32, 32))}
    a_o, b_o = torch.randn(RANK, 64, generator=g), torch.randn(64, RANK, generator=g)
    named = [("qkv.lora_A", a_qkv), *((n + ".lora_B", b) for n, b in bs.items()),
             (O_PROJ + ".lora_A", a_o), (O_PROJ + ".lora_B", b_o)]
    modules = [[n, "qkv.lora_A", n + ".lora_B"] for n in QKV] + [[O_PROJ, O_PROJ + ".lora_A", O_PROJ + ".lora_B"]]
    expected = {**{n: (a_qkv, b) for n, b in bs.items()}, O_PROJ: (a_o, b_o)}
    return named, {"lora": {"scale": SCALE, "modules": modules}}, expected


def in_session(client, fn):
    assert client.post("/begin_weight_update").status_code == 200
    try:
        return fn()
    finally:
        client.post("/end_weight_update")


def load_base(client, sender, base):
    adapted = [*QKV, O_PROJ]
    answer = in_session(client, lambda: sender.post(sorted(base.items()), lora_base=adapted))
    assert answer.status_code == 200, answer.text


def served_tensor(engine, name):
    return engine._params[name].detach().clone()


def check_merge_served(engine, client, base, expected):
    """Every adapted parameter is ``merge_fp32`` of the fp32 base as sent, cast once, bit for
    bit, and /weights_checksum says so."""
    names = sorted(expected)
    checksums = client.post("/weights_checksum", json={"names": names}).json()["checksums"]
    for name in names:
        a, b = expected[name]
        reference = merge_fp32(base[name], a, b, SCALE).to(engine.dtype)
        assert torch.equal(served_tensor(engine, name), reference), name
        assert checksums[name]["checksum"] == tensor_checksum(reference), name


def test_adapters_merge_onto_the_kept_base_bit_for_bit(served, base):
    engine, client = served
    sender = Sender(client)
    load_base(client, sender, base)
    for seed in (1, 2):  # each merge starts from the kept base: the second is not on top of the first
        named, extras, expected = adapters(seed)
        answer = in_session(client, lambda: sender.post(named, **extras))
        assert answer.status_code == 200 and answer.json()["message"].startswith("Loaded 4 tensors"), answer.text
        check_merge_served(engine, client, base, expected)
    if engine.dtype == torch.bfloat16:  # the base kept in fp32, not its bf16 rounding
        a, b = expected[O_PROJ]
        rounded = merge_fp32(base[O_PROJ].bfloat16(), a, b, SCALE).bfloat16()
        assert not torch.equal(served_tensor(engine, O_PROJ), rounded)
    # a plain load of a weight drops its kept base: an adapter for it is refused until one is sent
    in_session(client, lambda: sender.post([(O_PROJ, base[O_PROJ])]))
    named, extras, _ = adapters(3)
    answer = in_session(client, lambda: sender.post(named, **extras))
    assert answer.status_code == 400 and f"no LoRA base loaded for '{O_PROJ}'" in answer.json()["message"]


def _bad(named, extras, **change):
    """The adapter request with one thing wrong."""
    named = [(n, t) for n, t in named if n not in change.get("drop", ())] + change.get("add", [])
    lora = {**extras["lora"], **change.get("lora", {})}
    return named, {"lora": lora, **change.get("keys", {})}


def test_bad_adapter_requests_are_400s_naming_the_problem(served, base):
    engine, client = served
    sender = Sender(client)
    named, extras, _ = adapters(4)
    before = {n: served_tensor(engine, n) for n in [*QKV, O_PROJ]}
    outside = sender.post(named, **extras)
    assert outside.status_code == 400 and "between begin_weight_update() and end_weight_update()" in outside.text
    if engine._lora_base:  # the other test ran first on this engine
        in_session(client, lambda: sender.post(sorted(base.items())))  # drops every kept base
        before = {n: served_tensor(engine, n) for n in [*QKV, O_PROJ]}
    no_base = in_session(client, lambda: sender.post(named, **extras))
    assert no_base.status_code == 400 and f"no LoRA base loaded for '{QKV[0]}'" in no_base.json()["message"]
    load_base(client, sender, base)
    before = {n: served_tensor(engine, n) for n in [*QKV, O_PROJ]}
    modules = extras["lora"]["modules"]
    cases = {
        "unknown parameter name 'model.layers.9.mlp.up_proj.weight'":
            _bad(named, extras, lora={"modules": [*modules, ["model.layers.9.mlp.up_proj.weight", "qkv.lora_A",
                                                              O_PROJ + ".lora_B"]]}),
        f"{QKV[1]}: LoRA A [4, 64] / B [64, 4] do not fit the model's [32, 64]":
            _bad(named, extras, drop=[QKV[1] + ".lora_B"], add=[(QKV[1] + ".lora_B", torch.zeros(64, RANK))]),
        f"{O_PROJ}: LoRA B 'missing' is not a tensor of the request":
            _bad(named, extras, lora={"modules": [*modules[:3], [O_PROJ, O_PROJ + ".lora_A", "missing"]]}),
        "tensor 'stray' of the request is not the A or B of any lora.modules entry":
            _bad(named, extras, add=[("stray", torch.zeros(2))]),
        "lora.scale must be a finite number": _bad(named, extras, lora={"scale": "2"}),
        f"lora.modules names parameter '{O_PROJ}' twice": _bad(named, extras, lora={"modules": [*modules, modules[-1]]}),
        "LoRA rank 65 is outside [1, 64]":
            _bad([(O_PROJ + ".lora_A", torch.zeros(65, 64)), (O_PROJ + ".lora_B", torch.zeros(64, 65))], extras,
                 lora={"modules": [modules[-1]]}),
        "a request carries adapters (lora) or weights (lora_base), not both":
            _bad(named, extras, keys={"lora_base": ["qkv.lora_A"]}),
    }
    for message, (bad_named, bad_extras) in cases.items():
        answer = in_session(client, lambda: sender.post(bad_named, **bad_extras))
        assert answer.status_code == 400 and message in answer.json()["message"], (message, answer.text)
    refused = in_session(client, lambda: sender.post([(O_PROJ, base[O_PROJ])], lora_base=["nope"]))
    assert refused.status_code == 400 and "lora_base names 'nope'" in refused.json()["message"]
    assert all(torch.equal(served_tensor(engine, n), t) for n, t in before.items())  # nothing was touched


def test_the_disk_wire_carries_the_keys_in_each_files_metadata(served, base):
    engine, client = served
    directory = client.trusted / "sync"
    directory.mkdir(exist_ok=True)
    named, extras, expected = adapters(5)
    adapted = [*QKV, O_PROJ]
    # files load in name order: the base first, then the adapters
    save_file(dict(sorted(base.items())), str(directory / "bucket_00000.safetensors"),
              metadata={DISK_UPDATE_KEY: json.dumps({"lora_base": adapted})})
    save_file(dict(named), str(directory / "bucket_00001.safetensors"), metadata={DISK_UPDATE_KEY: json.dumps(extras)})
    outside = client.post("/update_weights_from_disk", json={"model_path": str(directory)})
    assert outside.status_code == 400 and "between begin_weight_update() and end_weight_update()" in outside.text
    answer = in_session(client, lambda: client.post("/update_weights_from_disk",
                                                    json={"model_path": str(directory), "compute_checksums": True}))
    assert answer.status_code == 200, answer.text
    check_merge_served(engine, client, base, expected)


LORA_HTTP = ("engine.kind=embedded", "sync.transport=tensor", "model.lora.rank=4", "model.lora.alpha=8",
             "optimizer.lr=2e-3", "optimizer.lr_warmup_steps=0", "checkpoint.save_every=0", "logging.plot=false",
             "eval.sets=[]", "engine.request_timeout_s=20", "engine.max_retries=2")


@pytest.mark.slow
def test_lora_run_on_the_launched_engine_syncs_adapters_and_resends_the_base_after_a_restart(demo, tmp_path):
    """TP2, 4 steps, the engine SIGKILLed once step 2 is logged. The logged syncs (after the
    start's base sync) send the adapters alone; the relaunched engine is sent the base again
    by the restart's resync itself: an adapter update reaching it first would be refused ("no
    LoRA base loaded"), failing a sync, which the supervisor would log and retry."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(demo, run_dir, 4, *LORA_HTTP), cwd=ROOT, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = kill_engine_after(proc, run_dir, 2)
    assert proc.returncode == 0, err[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["engine_restarts"] == 1
    assert (run_dir / "rollout" / "server.log").read_text().count("launch:") == 2
    assert "weight sync failed" not in err and "no LoRA base loaded" not in err, err[-3000:]
    merged_bytes = (demo / "model" / "model.safetensors").stat().st_size  # fp32, as the engine serves it
    assert all(0 < r["weight_sync_bytes"] <= 0.05 * merged_bytes for r in rows), [r["weight_sync_bytes"] for r in rows]
    # verified = the engine's checksums equal the trainer's recomputation of its merge (else the run fails)
    assert all(r["weight_sync_verified"] == 1 for r in rows)
    assert max(r["weight_sync_probe_logprob_abs_diff"] for r in rows) <= 1e-5
    assert max(r["rollout_train_logprobs_abs_diff_mean"] for r in rows) <= 1e-5
