"""The static decode path (``inference/static_decode.py``) against the eager one (``scheduler.py``).

Both paths get the same requests on the same tiny model (fp32, CPU: the static step runs eagerly
through its static buffers, the only difference from CUDA being the graph capture): greedy
tokens identical, seeded sampled tokens identical with log-probs within 1e-5, kept sets
identical, the same stops when the host checks them only every k tokens, and the same
answers to abort/retract at a check point. The graph path itself is the CUDA-only test at the end.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.config.base import ConfigError, build_section
from megatron_grpo.inference.engine import EmbeddedEngine, EngineError
from megatron_grpo.inference.generation import Sequence
from megatron_grpo.inference.sampling import draw_on_device, resolve_sampling_params, sample_tokens
from megatron_grpo.inference.scheduler import StepControl, run_continuous
from megatron_grpo.inference.static_decode import (StaticBatch, StaticDecoder, batch_buckets, bucket_for,
                                                  cache_length)
from megatron_grpo.generation.adapters import ENGINES
from megatron_grpo.generation.inprocess import start_inprocess
from tools.tiny import save_tiny_model
from megatron_grpo.ops.quantize import scheme_of
from tests.support.engine_runs import run

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20], [21, 22, 23]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("static")
    return save_tiny_model(root / "a", "qwen2", seed=5), save_tiny_model(root / "b", "qwen2", seed=6)


@pytest.fixture(scope="module")
def model(model_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dirs[0], dtype=torch.float32).eval()


def make(specs: list[dict]) -> list[Sequence]:
    """One sequence per spec: ``prompt`` and SGLang ``sampling_params``, plus ``mask`` (kept
    sets, that budget) -- a seeded spec gets its generator as the engine's ``submit`` would."""
    seqs = []
    for i, spec in enumerate(specs):
        params = resolve_sampling_params(spec["params"])
        seq = Sequence(rid=str(i), prompt_ids=list(spec["prompt"]), params=params, return_logprob=True,
                       return_sampling_mask=spec.get("mask", 0) > 0, max_kept=spec.get("mask", 0))
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        seqs.append(seq)
    return seqs


def _admit_all(seqs: list[Sequence]):
    """An ``admit(n)`` that hands out ``seqs`` in order, ``n`` at a time."""
    queue = list(seqs)

    def admit(n):
        taken = queue[:n]
        del queue[:n]
        return taken
    return admit


def decode(model, specs: list[dict], *, static: bool, max_batch_size: int = 8, k: int = 4,
           eos_ids: frozenset[int] = frozenset(), max_context: int = 512,
           control=lambda: StepControl.CONTINUE) -> tuple[list[Sequence], list[Sequence]]:
    """Run the sequences of ``specs`` through one path; returns (sequences, retracted)."""
    seqs = make(specs)
    admit = _admit_all(seqs)
    kwargs = dict(max_batch_size=max_batch_size, eos_ids=eos_ids, pad_id=0,
                  shared_generator=torch.Generator().manual_seed(0), max_context=max_context,
                  control=control, weight_version=lambda: "v")
    if static:
        retracted = StaticDecoder(stop_check_every=k, use_graphs=False).run(model, admit, **kwargs)
    else:
        retracted = run_continuous(model, admit, min_admit=1, **kwargs)
    return seqs, retracted


def assert_same(eager: list[Sequence], static: list[Sequence], tol: float = 1e-5) -> None:
    for e, s in zip(eager, static, strict=True):
        assert s.output_ids == e.output_ids, (e.rid, e.output_ids, s.output_ids)
        assert s.finish_reason == e.finish_reason, (e.rid, e.finish_reason, s.finish_reason)
        assert s.output_versions == e.output_versions
        diff = (torch.tensor(s.output_logprobs, dtype=torch.float64)
                - torch.tensor(e.output_logprobs, dtype=torch.float64)).abs()
        assert len(diff) == 0 or diff.max().item() <= tol, (e.rid, diff.max().item())
        assert s.output_kept_ids == e.output_kept_ids
        assert s.output_log_kept_mass == pytest.approx(e.output_log_kept_mass, abs=tol)


def seeded(i: int, mask: int = 0, **params) -> dict:
    """Prompt ``i``, seed 100 + i, 12 tokens unless ``params`` say otherwise; ``mask``: kept sets."""
    return {"prompt": PROMPTS[i % len(PROMPTS)], "mask": mask,
            "params": {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 100 + i} | params}


# ---- the pieces ----------------------------------------------------------------------------

def test_buckets_are_powers_of_two_up_to_the_largest_batch():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert [bucket_for(n, 48) for n in (1, 3, 8, 9, 33, 48)] == [1, 4, 8, 16, 48, 48]
    assert [cache_length(n) for n in (1, 16, 17, 100, 1024, 1025)] == [16, 16, 32, 128, 1024, 2048]


def test_a_seeded_row_draws_the_same_token_whatever_the_other_rows_ask():
    """The eager sampler used to draw every row over the sorted order as soon as one row
    filtered or kept sets were asked for, so an unfiltered row's token changed with its
    neighbours; now each row's rule is its own."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=gen) * 3
    u = torch.rand(3, generator=gen, dtype=torch.float64)
    ones, all_k = torch.ones(3), torch.full((3,), 1 << 30)
    alone = sample_tokens(logits, ones, all_k, ones, torch.zeros(3), u)
    mixed = sample_tokens(logits, ones, torch.tensor([1 << 30, 5, 1 << 30]), torch.tensor([1.0, 1.0, 0.9]),
                          torch.zeros(3), u, with_kept=True, max_kept=50)
    assert mixed.tokens[0] == alone.tokens[0]
    assert mixed.logprobs[0] == alone.logprobs[0]
    # the device draw is the same draw, with the kept sets as tensors
    dev = draw_on_device(logits, ones, torch.tensor([1 << 30, 5, 1 << 30]), torch.tensor([1.0, 1.0, 0.9]),
                         torch.zeros(3), u, sorts=True, kept_width=50)
    assert torch.equal(dev.tokens, mixed.tokens)
    assert [ids[:n] for ids, n in zip(dev.kept_ids.tolist(), dev.num_kept.tolist())] == mixed.truncation.kept_ids
    assert dev.num_kept[1] == 5 and int(dev.num_kept[0]) == 50


# ---- static vs eager -----------------------------------------------------------------------

def test_greedy_tokens_are_identical(model):
    specs = [{"prompt": p, "params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}} for p in PROMPTS]
    eager, _ = decode(model, specs, static=False)
    static, _ = decode(model, specs, static=True)
    assert_same(eager, static)
    assert all(len(s.output_ids) == 10 for s in static)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe"])
def test_other_architectures_and_a_moe_model_on_the_eager_path(tmp_path, model_type):
    """Llama and Qwen3 (q/k norms) decode statically to the eager tokens; a MoE model (its
    experts dispatched on the host) is decoded by the eager path, routing replay included."""
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(save_tiny_model(tmp_path / model_type, model_type, seed=2),
                                                 dtype=torch.float32).eval()
    specs = [seeded(i, max_new_tokens=6, top_k=8) for i in range(3)]
    eager = make(specs)
    static = make(specs)
    for seqs in (eager, static):
        for s in seqs:
            s.return_routed_experts = model_type == "qwen3_moe"
    kwargs = dict(max_batch_size=4, eos_ids=frozenset(), pad_id=0, max_context=512,
                  control=lambda: StepControl.CONTINUE, weight_version=lambda: "v")
    run_continuous(other, _admit_all(eager), shared_generator=torch.Generator(), **kwargs)
    decoder = StaticDecoder(stop_check_every=4, use_graphs=False)
    decoder.run(other, _admit_all(static), shared_generator=torch.Generator(), **kwargs)
    assert_same(eager, static)
    assert bool(decoder._states) == (model_type != "qwen3_moe")
    if model_type == "qwen3_moe":
        assert all(torch.equal(e.routed_experts, s.routed_experts) for e, s in zip(eager, static))


@pytest.mark.parametrize("k", [1, 3, 16])
def test_seeded_sampling_with_mixed_parameters_per_row_is_identical(model, k):
    specs = [seeded(0), seeded(1, temperature=0.7, top_k=5), seeded(2, top_p=0.8),
             seeded(3, min_p=0.2, temperature=1.3), seeded(4, temperature=0), seeded(5, top_k=3, top_p=0.9)]
    eager, _ = decode(model, specs, static=False)
    static, _ = decode(model, specs, static=True, k=k)
    assert_same(eager, static)


def test_kept_sets_are_identical(model):
    specs = [seeded(0, mask=64), seeded(1, top_k=4, mask=64), seeded(2, top_p=0.7, mask=3),
             seeded(3, temperature=0, mask=64), seeded(4)]
    eager, _ = decode(model, specs, static=False)
    static, _ = decode(model, specs, static=True, k=5)
    assert_same(eager, static)
    assert static[2].output_kept_ids and any(kept is None for kept in static[2].output_kept_ids)  # over budget
    assert all(len(kept) == 1 for kept in static[3].output_kept_ids)  # greedy


def test_stops_between_check_points_trim_the_tokens_drawn_past_them(model):
    """EOS (a token the greedy run draws), stop ids, max_new_tokens and the context end rows
    between two check points (k = 8): their later draws are dropped."""
    greedy = {"temperature": 0, "max_new_tokens": 20}
    probe, _ = decode(model, [{"prompt": PROMPTS[0], "params": greedy | {"ignore_eos": True}}], static=False)
    eos = probe[0].output_ids[5]  # the 6th token of the first prompt's greedy response
    specs = [{"prompt": PROMPTS[0], "params": greedy},
             {"prompt": PROMPTS[1], "params": greedy | {"stop_token_ids": [probe[0].output_ids[3]]}},
             seeded(2, max_new_tokens=3), seeded(3, max_new_tokens=11), seeded(4, max_new_tokens=40)]
    eager, _ = decode(model, specs, static=False, eos_ids=frozenset({eos}), max_context=30)
    static, _ = decode(model, specs, static=True, k=8, eos_ids=frozenset({eos}), max_context=30)
    assert_same(eager, static)
    assert eager[0].finish_reason == {"type": "stop", "matched": eos} and len(eager[0].output_ids) <= 6
    assert [s.finish_reason["type"] for s in static[2:]] == ["length"] * 3
    assert len(static[4].output_ids) == 30 - len(PROMPTS[4])  # the context


def test_n_samples_of_one_prompt_and_more_sequences_than_the_batch(model):
    """12 seeded samples of two prompts through 4 rows: each admission prefills a prompt once and
    replicates its rows for its samples."""
    specs = [{"prompt": PROMPTS[i // 6], "params": {"max_new_tokens": 3 + i % 5, "ignore_eos": True,
                                                    "sampling_seed": 7 + i}} for i in range(12)]
    eager, _ = decode(model, specs, static=False, max_batch_size=4)
    static, _ = decode(model, specs, static=True, max_batch_size=4, k=2)
    assert_same(eager, static)
    assert len({tuple(s.output_ids) for s in static[:6]}) > 1  # the samples differ


def test_sequences_join_free_rows_of_a_running_static_batch(model, monkeypatch):
    """Long-tailed lengths through a batch of 4 rows: queued sequences are prefilled and copied
    into the rows that finished while the others decode (right-aligned to the write column, the
    cache shifted left over columns no live row uses when the new rows need the room), and
    every sequence draws the eager path's tokens."""
    lengths = [3, 12, 2, 5, 9, 2, 12, 4, 6, 2, 11, 3, 7, 2, 10, 5]
    specs = [{"prompt": PROMPTS[i % len(PROMPTS)], "params": {"max_new_tokens": n, "ignore_eos": True,
                                                               "sampling_seed": 40 + i, "top_p": 0.9}}
             for i, n in enumerate(lengths)]
    shifts, calls = [], []
    shift_left = StaticBatch.shift_left
    monkeypatch.setattr(StaticBatch, "shift_left", lambda self, n: (shifts.append(n), shift_left(self, n)))
    static, eager = make(specs), make(specs)
    admit = _admit_all(static)
    decoder = StaticDecoder(stop_check_every=2, use_graphs=False)
    decoder.run(model, lambda n: calls.append(n) or admit(n), max_batch_size=4, eos_ids=frozenset(), pad_id=0,
                shared_generator=torch.Generator(), max_context=512, control=lambda: StepControl.CONTINUE,
                weight_version=lambda: "v")
    run_continuous(model, _admit_all(eager), max_batch_size=4, eos_ids=frozenset(), pad_id=0,
                   shared_generator=torch.Generator(), max_context=512, control=lambda: StepControl.CONTINUE,
                   weight_version=lambda: "v", min_admit=1)
    assert_same(eager, static)
    assert [len(s.output_ids) for s in static] == lengths
    assert sum(0 < n < 4 for n in calls) >= 3, calls  # admitted while other rows were live
    assert any(n > 0 for n in shifts), shifts
    assert len(decoder._states) == 1  # one static batch served them all


@pytest.mark.parametrize("action", [StepControl.ABORT, StepControl.RETRACT])
def test_abort_and_retract_at_a_check_point(model, action):
    """control() answers at the second check point (k = 3: the first token is drawn with the
    prefill, so after 1 + 3 + 3 tokens); a retracted sequence resumes (re-prefilled) to the
    same tokens as a run that was never interrupted."""
    specs = [seeded(i, max_new_tokens=10) for i in range(3)]
    calls = []

    def control():
        calls.append(1)
        return action if len(calls) == 2 else StepControl.CONTINUE

    static, retracted = decode(model, specs, static=True, k=3, control=control)
    assert all(len(s.output_ids) == 7 for s in static)
    if action == StepControl.ABORT:
        assert retracted == [] and all(s.finish_reason["type"] == "abort" for s in static)
        return
    assert retracted == static and not any(s.finished for s in static)
    StaticDecoder(stop_check_every=3, use_graphs=False).run(
        model, _admit_all(retracted), max_batch_size=8, eos_ids=frozenset(),
        pad_id=0, shared_generator=torch.Generator(), max_context=512, control=lambda: StepControl.CONTINUE,
        weight_version=lambda: "v")
    whole, _ = decode(model, specs, static=False)
    assert_same(whole, static)


@pytest.mark.parametrize("action", [StepControl.ABORT, StepControl.RETRACT])
def test_a_sequence_waiting_for_room_is_aborted_or_retracted_with_the_batch(model, action):
    """Two rows: the first finishes after 3 tokens and a queued sequence with an 8-token prompt
    is prefilled (its first token drawn) but cannot fit before the write column (3 columns in):
    it waits. Abort ends it too; retract returns it with the live row, and both resume to the
    uninterrupted tokens."""
    specs = [{"prompt": PROMPTS[3], "params": {"max_new_tokens": n, "ignore_eos": True, "sampling_seed": 60 + i}}
             for i, n in enumerate([3, 20])] + [seeded(2, max_new_tokens=20)]
    calls = []

    def control():
        calls.append(1)
        return action if len(calls) == 2 else StepControl.CONTINUE

    static, retracted = decode(model, specs, static=True, max_batch_size=2, k=2, control=control)
    assert [len(s.output_ids) for s in static] == [3, 5, 1]  # the third waited after its first token
    if action == StepControl.ABORT:
        assert retracted == [] and [s.finish_reason["type"] for s in static] == ["length", "abort", "abort"]
        return
    assert retracted == static[1:]
    StaticDecoder(stop_check_every=2, use_graphs=False).run(
        model, _admit_all(retracted), max_batch_size=2, eos_ids=frozenset(), pad_id=0,
        shared_generator=torch.Generator(), max_context=512, control=lambda: StepControl.CONTINUE,
        weight_version=lambda: "v")
    whole, _ = decode(model, specs, static=False, max_batch_size=2)
    assert_same(whole, static)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_engine_static_decode_serves_the_new_weights_after_a_load(model_dirs, quantization):
    """The embedded engine on the static path: after ``load_weights`` of another model's tensors,
    that model's greedy answer, as an eager engine serving it gives (the static batch's buffers
    and, on CUDA, its graph read the parameters in place; int8: the re-quantized copies are new
    tensors, so the graphs are recaptured)."""
    from safetensors.torch import load_file

    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    scheme = scheme_of(quantization)
    static = EmbeddedEngine(model_dirs[0], dtype="float32", max_batch_size=4, decode="static", stop_check_every=3,
                            quantization=scheme)
    eager = EmbeddedEngine(model_dirs[1], dtype="float32", max_batch_size=4, quantization=scheme)
    try:
        before = [s.output_ids for s in run(static, PROMPTS[:3], params, hold=False)]
        assert static._static._states, "the engine decoded on the eager path"
        with static.exclusive():
            static.load_weights(load_file(str(model_dirs[1] / "model.safetensors")).items())
        after = [s.output_ids for s in run(static, PROMPTS[:3], params, hold=False)]
        expected = [s.output_ids for s in run(eager, PROMPTS[:3], params, hold=False)]
    finally:
        static.shutdown()
        eager.shutdown()
    assert after == expected and after != before


def test_engine_static_decode_retracts_for_a_weight_update_and_resumes_on_the_new_weights(model_dirs):
    """``pause("retract")`` mid-generation on the static path, a weight load and a new version,
    ``resume()``: each sequence's tokens are labelled by the version that drew them, and the
    ones after the update are the new model's greedy continuation of the prefix drawn before."""
    from safetensors.torch import load_file

    params = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
    static = EmbeddedEngine(model_dirs[0], dtype="float32", max_batch_size=4, decode="static", stop_check_every=4)
    reference = EmbeddedEngine(model_dirs[1], dtype="float32", max_batch_size=4)
    try:
        done = threading.Semaphore(0)
        seqs = [Sequence(rid=str(i), prompt_ids=list(p), params=resolve_sampling_params(params),
                         on_finish=lambda s: done.release()) for i, p in enumerate(PROMPTS[:3])]
        static.submit(seqs, hold=False)
        deadline = time.monotonic() + 60
        while len(seqs[0].output_ids) < 8:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        static.pause("retract")
        with static.exclusive():
            static.load_weights(load_file(str(model_dirs[1] / "model.safetensors")).items())
            static.weight_version = "2"
        static.resume()
        for _ in seqs:
            assert done.acquire(timeout=120)
        for s in seqs:
            before = s.output_versions.count("default")
            assert 0 < before < 400 and s.output_versions == ["default"] * before + ["2"] * (400 - before)
            rest = params | {"max_new_tokens": 400 - before}
            expected = run(reference, [s.prompt_ids + s.output_ids[:before]], rest, hold=False)[0].output_ids
            assert s.output_ids[before:] == expected
    finally:
        static.shutdown()
        reference.shutdown()


def experiment(embedded: dict) -> ExperimentConfig:
    raw = {"model": {"hf_dir": "m"}, "data": {"train_file": "d.jsonl"}, "trainer": {"run_dir": "r"},
           "rollout": {"num_generations": 2, "prompts_per_step": 4}, "engine": {"embedded": embedded}}
    return build_section(ExperimentConfig, raw)


def test_the_switch_is_checked_at_load_and_reaches_the_launched_engine(model_dirs):
    cfg = experiment({"decode": "static", "stop_check_every": 4})
    cmd = ENGINES["embedded"].launch_command(cfg, "m", "127.0.0.1", 1)
    assert cmd[cmd.index("--decode") + 1] == "static" and cmd[cmd.index("--stop-check-every") + 1] == "4"
    assert experiment({}).engine.embedded.decode == "eager"  # CPU behaviour unchanged by default
    with pytest.raises(ConfigError, match=r"engine.embedded.decode"):
        experiment({"decode": "graphs"})
    with pytest.raises(ConfigError, match=r"engine.embedded.stop_check_every: must be >= 1"):
        experiment({"stop_check_every": 0})
    with pytest.raises(EngineError, match="decode must be one of"):
        EmbeddedEngine(model_dirs[0], decode="graphs")
    inprocess = start_inprocess(cfg.engine, model_dir=str(model_dirs[0]))  # engine.kind: inprocess
    try:
        assert inprocess._static is not None and inprocess._static.stop_check_every == 4
    finally:
        inprocess.shutdown()


def test_server_info_says_which_path_decoded(model_dirs):
    """/get_server_info's ``decode``: the mode, and for ``static`` the interval, whether graphs
    are captured (never off CUDA) and what ran on the static path; an eager engine says eager."""
    from fastapi.testclient import TestClient

    from megatron_grpo.inference.server import build_app

    static = EmbeddedEngine(model_dirs[0], dtype="float32", max_batch_size=4, decode="static", stop_check_every=3)
    eager = EmbeddedEngine(model_dirs[0], dtype="float32", max_batch_size=4)
    try:
        with TestClient(build_app(static)) as client:
            body = {"input_ids": PROMPTS[:3], "sampling_params": {"temperature": 0, "max_new_tokens": 5,
                                                                    "ignore_eos": True}}
            assert client.post("/generate", json=body).status_code == 200
            info = client.get("/get_server_info").json()["decode"]
        with TestClient(build_app(eager)) as client:
            assert client.get("/get_server_info").json()["decode"] == {"mode": "eager"}
    finally:
        static.shutdown()
        eager.shutdown()
    assert info["mode"] == "static" and info["stop_check_every"] == 3 and info["cuda_graphs"] is False
    assert info["static_sequences"] == 3 and info["static_batches"] >= 1, info
    assert info["graph_captures"] == 0 and info["eager_sequences"] == 0, info


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_path_greedy_equals_eager_and_follows_a_weight_load(model_dirs):
    from transformers import AutoModelForCausalLM

    gpu = AutoModelForCausalLM.from_pretrained(model_dirs[0], dtype=torch.float32).eval().cuda()
    specs = [{"prompt": p, "params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}} for p in PROMPTS]
    eager, _ = decode(gpu, specs, static=False)
    graphed = StaticDecoder(stop_check_every=4, use_graphs=True)
    seqs = make(specs)

    def go(seqs):
        graphed.run(gpu, _admit_all(seqs), max_batch_size=8,
                    eos_ids=frozenset(), pad_id=0, shared_generator=torch.Generator(), max_context=512,
                    control=lambda: StepControl.CONTINUE, weight_version=lambda: "v")
        return seqs

    go(seqs)
    assert any(state.graph is not None for state in graphed._states.values())
    assert_same(eager, seqs, tol=1e-4)
    other = AutoModelForCausalLM.from_pretrained(model_dirs[1], dtype=torch.float32).eval().cuda()
    with torch.no_grad():
        for p, q in zip(gpu.parameters(), other.parameters()):
            p.copy_(q)
    expected, _ = decode(other, specs, static=False)
    assert_same(expected, go(make(specs)), tol=1e-4)
