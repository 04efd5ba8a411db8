"""The rollout client against a real HTTP server: the embedded engine and the real SGLang
(the same tests: a contract test of the shared API). SGLang runs from the environment
``launch/setup_sglang_cpu.sh`` builds (CI builds it first); without it these tests fail in
CI and are skipped, with the reason, elsewhere.

References are transformers' own forward of the same checkpoint in this process.
"""

import time
from pathlib import Path

import pytest
import torch

from megatron_grpo.generation import RolloutClient, RolloutError, SamplingParams
from megatron_grpo.generation.manager import RolloutServerManager, free_port, weight_sync_dir
from megatron_grpo.wire.buckets import plan_buckets
from megatron_grpo.wire.checksum import tensor_checksum
from megatron_grpo.wire.group import destroy_custom_process_group, init_custom_process_group
from megatron_grpo.wire.serialize import serialize_named_tensors, use_file_system_sharing
from tests.support.sglang import require_sglang
from tools.tiny import save_tiny_model
from tests.support.sglang_shared import SGLANG_MEMORY
from megatron_grpo.config import EngineConfig, SGLangConfig, SyncConfig
from tests.support.configs import experiment

API_KEY = "test-key"
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19]]

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


RUN_DIRS: dict[str, Path] = {}  # kind -> run directory of the launched server


@pytest.fixture(scope="module", params=["embedded", "sglang"])
def server(request, model_dir, tmp_path_factory):
    """(kind, url) of a launched server with API key ``API_KEY``."""
    kind = request.param
    run_dir = RUN_DIRS[kind] = tmp_path_factory.mktemp(f"run_{kind}")
    if kind == "sglang":
        require_sglang()
    cfg = experiment(engine=EngineConfig(kind=kind, api_key=API_KEY, dtype="float32", launch_timeout_s=600,
                                         request_timeout_s=120, sglang=SGLangConfig(**SGLANG_MEMORY)))
    manager = RolloutServerManager(cfg, model_dir=model_dir, run_dir=run_dir)
    try:
        (url,) = manager.start()
        yield kind, url
    finally:
        manager.stop()


@pytest.fixture(scope="module")
def client(server):
    c = RolloutClient([server[1]], api_key=API_KEY, request_timeout_s=120, max_retries=2)
    yield c
    c.close()


def reference_logprobs(hf_model, prompt, output, temperature):
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0].double()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return torch.tensor([lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)], dtype=torch.float64)


def tolerance(kind):
    return 1e-5 if kind == "embedded" else 1e-4  # SGLang agrees to ~5 decimals (measured)


def test_generate_batched_n_logprobs(server, client, hf_model):
    kind, url = server
    samples = client.generate(PROMPTS, 4, SamplingParams(temperature=0.8, max_new_tokens=8))
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, j) for i in range(3) for j in range(4)]
    version = client.weight_version(url)
    deltas = []
    for s in samples:
        assert s.prompt_ids == PROMPTS[s.prompt_index]
        assert 1 <= len(s.output_ids) == len(s.output_logprobs) <= 8
        assert s.finish_reason in ("stop", "length") and s.weight_version == version
        deltas.append((torch.tensor(s.output_logprobs, dtype=torch.float64)
                       - reference_logprobs(hf_model, s.prompt_ids, s.output_ids, 0.8)).abs())
    assert torch.cat(deltas).mean().item() <= tolerance(kind)
    # n samples of a prompt are not copies of each other
    assert len({tuple(s.output_ids) for s in samples[:4]}) > 1


def test_greedy_matches_hf_generate(client, hf_model):
    samples = client.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=6))
    for s in samples:
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([s.prompt_ids]), do_sample=False, max_new_tokens=6, pad_token_id=0)
        assert s.output_ids == ref[0, len(s.prompt_ids):].tolist()


def test_seeded_generation_is_reproducible(server, client):
    if server[0] == "sglang":
        pytest.skip("SGLang honours sampling_seed only with --enable-deterministic-inference")
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    a = client.generate(PROMPTS, 3, params, sampling_seed=7)
    b = client.generate(PROMPTS[:1] + PROMPTS[1:], 3, params, sampling_seed=7)
    c = client.generate(PROMPTS, 3, params, sampling_seed=8)
    assert [s.output_ids for s in a] == [s.output_ids for s in b]
    assert [s.output_ids for s in a] != [s.output_ids for s in c]


def test_packed_requests_give_the_samples_of_one_request_per_prompt(server):
    """sequences_per_request (what the launched embedded engine's adapter sets) packs whole
    prompt groups into a request: the same samples, in the same order, with the same seeds."""
    kind, url = server
    if kind == "sglang":
        pytest.skip("the client packs requests only for the embedded engine (its adapter's choice)")
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    per_prompt = RolloutClient([url], api_key=API_KEY, request_timeout_s=120)
    two_groups = RolloutClient([url], api_key=API_KEY, request_timeout_s=120, sequences_per_request=6)
    all_in_one = RolloutClient([url], api_key=API_KEY, request_timeout_s=120, sequences_per_request=256)
    try:
        runs = [c.generate(PROMPTS, 3, params, sampling_seed=11) for c in (per_prompt, two_groups, all_in_one)]
        unseeded = all_in_one.generate(PROMPTS, 3, params)
    finally:
        for c in (per_prompt, two_groups, all_in_one):
            c.close()
    for samples in runs[1:]:
        assert [(s.prompt_index, s.sample_index, s.prompt_ids, s.output_ids) for s in samples] == \
            [(s.prompt_index, s.sample_index, s.prompt_ids, s.output_ids) for s in runs[0]]
        for a, b in zip(samples, runs[0]):
            assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) <= 1e-5
    assert [(s.prompt_index, s.sample_index, s.prompt_ids) for s in unseeded] == \
        [(i, j, PROMPTS[i]) for i in range(3) for j in range(3)]


def test_only_a_call_alone_in_flight_skips_the_batching_window():
    """Overlapping generate() calls (async rollouts, episodes) keep the engine's batching window
    so that their requests can share a prefill; a synchronous step's one call skips it. The
    requests' bodies are recorded before they would be sent."""
    import asyncio

    from megatron_grpo.generation.client import AsyncRolloutClient

    client = AsyncRolloutClient(["http://127.0.0.1:9"], sequences_per_request=256)
    bodies = []

    async def record(route, body, **kwargs):
        bodies.append(body)
        await asyncio.sleep(0.01)
        raise RolloutError("http://127.0.0.1:9", route, "not sent")

    client._call = record
    params = SamplingParams(max_new_tokens=2)

    async def main():
        await asyncio.gather(client.generate(PROMPTS, 2, params), return_exceptions=True)
        alone = list(bodies)
        bodies.clear()
        await asyncio.gather(client.generate(PROMPTS[:1], 2, params), client.generate(PROMPTS[1:], 2, params),
                             return_exceptions=True)
        return alone, list(bodies)

    alone, overlapping = asyncio.run(main())
    assert len(alone) == 1 and alone[0]["skip_batch_window"] is True and alone[0]["input_ids"] == PROMPTS
    assert len(overlapping) == 2 and not any("skip_batch_window" in b for b in overlapping)
    assert client._generating == 0


def test_request_chunks():
    from megatron_grpo.generation.client import request_chunks

    assert request_chunks(3, 4, None, 1) == [(0, 1), (1, 2), (2, 3)]  # one request per prompt
    assert request_chunks(8, 16, 256, 1) == [(0, 8)]  # the whole batch in one request
    assert request_chunks(20, 16, 256, 1) == [(0, 10), (10, 20)]  # within the bound, even halves
    assert request_chunks(8, 16, 256, 2) == [(0, 4), (4, 8)]  # every server gets some
    assert request_chunks(3, 16, 256, 4) == [(0, 1), (1, 2), (2, 3)]  # fewer prompts than servers
    assert request_chunks(5, 300, 256, 1) == [(i, i + 1) for i in range(5)]  # a group over the bound: alone
    assert request_chunks(0, 16, 256, 1) == []


def test_api_key_is_enforced(server):
    _, url = server
    with RolloutClient([url], request_timeout_s=30, max_retries=1) as anonymous:
        assert anonymous.health(url)  # /health is open, as in SGLang
        with pytest.raises(RolloutError, match=r"POST /generate: HTTP 401") as info:
            anonymous.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=2))
        assert url in str(info.value) and info.value.status == 401


def test_the_key_is_on_no_command_line(server):
    """Every local user can read every process's command line (`ps`): the launched server gets
    the key through its environment (embedded) or a 0600 file (SGLang's --config)."""
    import psutil

    shown = [p.pid for p in psutil.process_iter(["cmdline"]) if API_KEY in " ".join(p.info["cmdline"] or [])]
    assert shown == []


def test_control_routes(server, client):
    _, url = server
    assert client.model_info(url)["is_generation"] is True
    client.pause_generation(url, mode="in_place")
    future = client.submit(client.aio.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=2)))
    time.sleep(0.5)
    assert not future.done()  # requests wait while paused
    client.continue_generation(url)
    assert len(future.result(timeout=60)) == 1
    client.flush_cache(url)  # right after an answer: SGLang's scheduler may not be idle yet


def test_a_flush_waits_until_the_engine_is_idle(server, client):
    """A flush sent while a generation runs: SGLang refuses it (``idle_wait_s=0``, one try:
    HTTP 400), and with the client's default the flush is retried until the request finished.
    The embedded engine has no cache to flush: it answers at once."""
    kind, url = server
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    if kind == "sglang":
        future = client.submit(client.aio.generate(PROMPTS[:1], 1, long))
        time.sleep(0.3)
        with pytest.raises(RolloutError, match="HTTP 400"):
            client.flush_cache(url, idle_wait_s=0)
        assert not future.done()
    future = client.submit(client.aio.generate(PROMPTS[:1], 1, long))
    time.sleep(0.3)
    client.flush_cache(url)
    if kind == "sglang":
        assert future.done()  # the flush was retried until the request finished
    assert len(future.result(timeout=60)[0].output_ids) == 200


@pytest.fixture
def perturbed(model_dir, hf_model, client, server):
    """Perturbed copies of the weights; the server gets the checkpoint back afterwards."""
    torch.manual_seed(0)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in hf_model.state_dict().items()}
    yield state
    client.run(client.aio.update_weights_from_disk(server[1], model_dir, weight_version="default"))


def assert_served(client, server, hf_model, state, tol):
    """The server's log-probs equal a transformers model holding ``state``."""
    kind, url = server
    model = type(hf_model)(hf_model.config).eval()
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    samples = client.generate(PROMPTS, 2, SamplingParams(temperature=0.9, max_new_tokens=6))
    deltas = torch.cat([(torch.tensor(s.output_logprobs, dtype=torch.float64)
                         - reference_logprobs(model, s.prompt_ids, s.output_ids, 0.9)).abs() for s in samples])
    assert deltas.mean().item() <= tol


@pytest.fixture
def weight_dir(server, tmp_path):
    """A fresh directory inside the server's run's weight-sync directory (which it trusts)."""
    path = weight_sync_dir(RUN_DIRS[server[0]]) / tmp_path.name
    path.mkdir(parents=True)
    return path


def test_update_weights_from_disk(server, client, hf_model, perturbed, weight_dir):
    from safetensors.torch import save_file

    kind, url = server
    tmp_path = weight_dir
    save_file({k: v.contiguous() for k, v in perturbed.items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(hf_model.config.to_json_string())
    client.run(client.aio.update_weights_from_disk(url, str(tmp_path), weight_version="7"))
    assert client.weight_version(url) == "7"
    assert_served(client, server, hf_model, perturbed, tolerance(kind))


def test_update_weights_from_tensor_needs_the_session(server, client, hf_model, perturbed):
    kind, url = server
    use_file_system_sharing()
    named = [(k, v.contiguous()) for k, v in perturbed.items()]
    payload = [serialize_named_tensors(named)]
    if kind == "embedded":
        with pytest.raises(RolloutError, match="begin_weight_update"):
            client.run(client.aio.update_weights_from_tensor(url, payload))
    client.call("begin_weight_update", {}, url=url)
    try:
        client.run(client.aio.update_weights_from_tensor(url, payload, weight_version="8"))
    finally:
        client.call("end_weight_update", {}, url=url)
    assert client.weight_version(url) == "8"
    assert_served(client, server, hf_model, perturbed, tolerance(kind))


def test_update_weights_from_distributed(server, client, hf_model, perturbed):
    """The flattened buckets exactly as the trainer sends them, inside the begin/end bracket
    (SGLang 0.5.23 refuses a distributed update outside it; the embedded engine likewise)."""
    kind, url = server
    port = free_port()
    group_name = "test_group"
    init = client.submit(client.aio.init_weights_update_group(
        url, master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name=group_name))
    group = init_custom_process_group(backend="gloo", master_address="127.0.0.1", master_port=port,
                                      world_size=2, rank=0, group_name=group_name, timeout_s=60)
    init.result(timeout=60)
    buckets = list(plan_buckets(((k, v.contiguous()) for k, v in perturbed.items()), 16 * 1024))
    assert len(buckets) > 1

    def post(bucket):
        return client.submit(client.aio.update_weights_from_distributed(
            url, names=bucket.names, dtypes=[bucket.dtype_name] * len(bucket.names), shapes=bucket.shapes,
            group_name=group_name, load_format="flattened_bucket", weight_version="9"))

    try:
        with pytest.raises(RolloutError, match="must run between begin_weight_update"):
            post(buckets[0]).result(timeout=60)
        client.call("begin_weight_update", {}, url=url)
        for bucket in buckets:
            posted = post(bucket)
            torch.distributed.broadcast(bucket.pack(), src=0, group=group)
            posted.result(timeout=60)
        client.call("end_weight_update", {}, url=url)
    finally:
        client.call("destroy_weights_update_group", {"group_name": group_name}, url=url)
        destroy_custom_process_group(group)
    assert client.weight_version(url) == "9"
    assert_served(client, server, hf_model, perturbed, tolerance(kind))
    if kind == "embedded":
        names = sorted(perturbed)
        served = client.call("weights_checksum", {"names": names}, url=url)["checksums"]
        assert {n: served[n]["checksum"] for n in names} == {n: tensor_checksum(perturbed[n]) for n in names}


def test_dead_server_fails_fast_with_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    with RolloutClient([url], request_timeout_s=5, max_retries=3) as dead:
        started = time.monotonic()
        with pytest.raises(RolloutError) as info:
            dead.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=2))
        elapsed = time.monotonic() - started
    message = str(info.value)
    assert url in message and "POST /generate" in message and "3 attempts" in message
    assert "\n" not in message
    assert elapsed < 5, elapsed


def test_stop_ids_top_k_and_top_p(server, client, hf_model):
    kind, url = server
    greedy = client.generate(PROMPTS, 1, SamplingParams(temperature=0.0, max_new_tokens=6))
    # top_k=1 and a tiny top_p leave only the argmax: sampling at T=1 then equals greedy
    for params in (SamplingParams(temperature=1.0, top_k=1, max_new_tokens=6),
                   SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=6)):
        assert [s.output_ids for s in client.generate(PROMPTS, 2, params)][::2] == [s.output_ids for s in greedy]
    # a stop id ends the response at that token ("stop"), which is kept in the output
    stop = greedy[0].output_ids[2]
    (s,) = client.generate(PROMPTS[:1], 1, SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[stop]))
    cut = greedy[0].output_ids.index(stop) + 1
    assert s.output_ids == greedy[0].output_ids[:cut] and s.finish_reason == "stop"


def test_prompt_logprobs_are_at_temperature_one(server, client, hf_model):
    """The weight-sync probe's reading: input log-probs ignore the request's temperature."""
    _, url = server
    tokens = PROMPTS[2]
    served = torch.tensor(client.prompt_logprobs(url, tokens), dtype=torch.float64)
    reference = reference_logprobs(hf_model, tokens[:1], tokens[1:], 1.0)
    assert (served - reference).abs().mean().item() <= 1e-5


def test_engine_adapter_verifier_sees_a_stale_tensor(server, client, hf_model):
    """Each adapter's verifier against its real server: what it serves passes, a tensor the
    trainer sent differently is named."""
    from megatron_grpo.generation.adapters import ENGINES
    from megatron_grpo.wire.checksum import tensor_checksum

    kind, url = server
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight" or kind == "sglang"}
    expected = {k: tensor_checksum(v) for k, v in state.items()}
    samples = {k: v[:8].float().clone() for k, v in state.items()}
    adapter = ENGINES[kind]
    assert adapter.verify(client, url, expected, samples) == []
    name = "model.layers.1.mlp.up_proj.weight"
    stale = dict(expected, **{name: "0" * 16})
    samples[name][0, 0] += 1e-3
    assert adapter.verify(client, url, stale, samples) == [name]


def test_release_memory_occupation_is_never_called_without_a_gpu():
    """SGLang's /release_memory_occupation calls CUDA and kills a CPU server (so it is not
    exercised here): the client has no such route, and no code path of the package names it."""
    from pathlib import Path

    from megatron_grpo.generation.client import ROUTES

    assert not any("memory_occupation" in path for _, path in ROUTES.values())
    package = Path(__file__).resolve().parent.parent / "megatron_grpo"
    users = [p for p in package.rglob("*.py") if "memory_occupation" in p.read_text() and p.name != "sglang.py"]
    assert users == []


@pytest.mark.parametrize("transport", ["distributed", "tensor", "disk"])
def test_weight_syncer_transport_against_the_server(server, client, hf_model, perturbed, weight_dir, transport):
    """The trainer's own WeightSync (buckets, bracket, every transport, the engine's
    verifier and, on SGLang, the log-prob probe) pushing weights into the real server."""
    from megatron_grpo.sync.driver import WeightSync
    from megatron_grpo.sync.servers import ServerDelivery

    kind, url = server
    reference = type(hf_model)(hf_model.config).eval()
    reference.load_state_dict(perturbed, strict=False)
    reference.tie_weights()

    def probe(tokens):  # the trainer's log-probs of the probe under the weights it sends
        return reference_logprobs(reference, tokens[:1], tokens[1:], 1.0).tolist()

    cfg = experiment(engine=EngineConfig(kind=kind, api_key=API_KEY, request_timeout_s=120),
                     sync=SyncConfig(transport=transport, bucket_mb=1, verify_logprob_tolerance=1e-5))
    named = [(k, v.contiguous()) for k, v in perturbed.items()]
    syncer = WeightSync(cfg, hf_model.config,
                        ServerDelivery(cfg, [url], hf_model.config, work_dir=weight_dir, client=client),
                        iter_weights=lambda chunks, hf_config: iter(named), probe=probe)
    try:
        stats = syncer.sync([], step=42)
    finally:
        syncer.close()
    assert stats.verified and stats.num_tensors == len(named)
    assert client.weight_version(url) == "42"
    if kind == "sglang":
        assert stats.probe_logprob_abs_diff is not None and stats.probe_logprob_abs_diff <= 1e-5
    assert_served(client, server, hf_model, perturbed, tolerance(kind))
