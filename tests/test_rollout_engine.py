"""The embedded engine in-process: exact log-probs, greedy = HF generate, seeds, pause modes.

References are transformers' own: a full forward of each finished sequence (no padding, no
cache) scored with log_softmax(logits / T) in float64, and ``model.generate`` for greedy.
"""

import threading
import time

import pytest
import torch

from megatron_grpo.inference.engine import EmbeddedEngine
from megatron_grpo.inference.generation import Sequence
from megatron_grpo.inference.sampling import resolve_sampling_params
from tools.tiny import save_tiny_model
from tests.support.engine_runs import reference_logprobs, run

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2", seed=3)
    eng = EmbeddedEngine(model_dir, dtype="float32", max_batch_size=16, seed=0)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("params", [
    {"temperature": 0.7, "max_new_tokens": 12},
    {"temperature": 1.3, "top_p": 0.8, "top_k": 40, "max_new_tokens": 12},
])
def test_logprobs_equal_full_forward(engine, params):
    seqs = run(engine, PROMPTS * 3, params)
    deltas = []
    for s in seqs:
        assert len(s.output_ids) == len(s.output_logprobs) >= 1
        ref = reference_logprobs(engine.model, s, params["temperature"])
        deltas.append((torch.tensor(s.output_logprobs, dtype=torch.float64) - ref).abs())
    delta = torch.cat(deltas)
    assert delta.max().item() <= 1e-5, delta.max().item()


def test_prompt_logprobs_equal_full_forward(engine):
    (s,) = run(engine, [PROMPTS[2]], {"temperature": 0.9, "max_new_tokens": 2}, logprob_start_len=0)
    assert s.input_logprobs[0] is None and len(s.input_logprobs) == len(s.prompt_ids)
    with torch.no_grad():
        logits = engine.model(torch.tensor([s.prompt_ids])).logits[0].double()
    ref = torch.log_softmax(logits / 0.9, dim=-1)
    for i in range(1, len(s.prompt_ids)):
        assert abs(s.input_logprobs[i] - ref[i - 1, s.prompt_ids[i]].item()) <= 1e-5


def test_greedy_equals_hf_generate(engine):
    seqs = run(engine, PROMPTS, {"temperature": 0.0, "max_new_tokens": 10})
    for s in seqs:
        with torch.no_grad():
            ref = engine.model.generate(torch.tensor([s.prompt_ids]), do_sample=False, max_new_tokens=10,
                                        pad_token_id=engine.pad_id)
        assert s.output_ids == ref[0, len(s.prompt_ids):].tolist()


def test_stop_ids_and_finish_reasons(engine):
    greedy = run(engine, [PROMPTS[0]], {"temperature": 0.0, "max_new_tokens": 6})[0]
    stop = greedy.output_ids[2]
    (s,) = run(engine, [PROMPTS[0]], {"temperature": 0.0, "max_new_tokens": 6, "stop_token_ids": [stop]})
    first = greedy.output_ids.index(stop)
    assert s.output_ids == greedy.output_ids[: first + 1]  # the matched token is the last output
    assert s.finish_reason == {"type": "stop", "matched": stop}
    assert greedy.finish_reason == {"type": "length", "length": 6}


def test_sampling_seed_is_reproducible_whatever_the_batch(engine):
    params = {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 1234}
    alone = run(engine, [PROMPTS[1]], params)[0]
    batched = run(engine, [PROMPTS[0], PROMPTS[1], PROMPTS[2]], params)[1]
    other = run(engine, [PROMPTS[1]], dict(params, sampling_seed=99))[0]
    assert alone.output_ids == batched.output_ids
    assert alone.output_ids != other.output_ids


def test_a_request_that_holds_everything_skips_the_batching_window(engine):
    """hold=False (the client's skip_batch_window) admits at once; held sequences wait the
    window, and the same seeds give the same tokens either way."""
    params = {"temperature": 1.0, "max_new_tokens": 2, "sampling_seed": 5}
    window, engine.batch_window_s = engine.batch_window_s, 1.0
    try:
        t0 = time.monotonic()
        now = run(engine, PROMPTS, params, hold=False)
        t1 = time.monotonic()
        held = run(engine, PROMPTS, params)
        t2 = time.monotonic()
    finally:
        engine.batch_window_s = window
    assert t2 - t1 >= 1.0  # the window was waited
    assert t1 - t0 < 0.5, t1 - t0  # tiny model, 2 tokens: far below the window however loaded
    assert [s.output_ids for s in now] == [s.output_ids for s in held]


def start(engine, prompt, params):
    """Submit one sequence; returns it and an Event set when it finishes."""
    finished = threading.Event()
    seq = Sequence(rid="p", prompt_ids=list(prompt), params=resolve_sampling_params(params),
                   return_logprob=True, on_finish=lambda s: finished.set())
    engine.submit([seq])
    deadline = time.monotonic() + 60
    while len(seq.output_ids) < 3:  # running: its wave is past prefill
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return seq, finished


LONG = {"temperature": 1.0, "max_new_tokens": 480, "ignore_eos": True}


def test_pause_in_place_then_continue(engine):
    seq, finished = start(engine, PROMPTS[0], LONG)
    engine.pause("in_place")
    n = len(seq.output_ids)
    time.sleep(0.3)
    assert not finished.is_set() and len(seq.output_ids) == n  # parked, not generating
    engine.resume()
    assert finished.wait(120)
    assert seq.finish_reason == {"type": "length", "length": 480}


def test_pause_abort_and_retract(engine):
    seq, finished = start(engine, PROMPTS[0], LONG)
    engine.pause("abort")
    assert finished.wait(10)
    engine.resume()
    assert seq.finish_reason["type"] == "abort" and len(seq.output_ids) < 480

    seq, finished = start(engine, PROMPTS[0], LONG)
    engine.pause("retract")
    n = len(seq.output_ids)
    time.sleep(0.2)
    assert not finished.is_set() and len(seq.output_ids) == n
    engine.resume()
    assert finished.wait(120)
    assert seq.finish_reason == {"type": "length", "length": 480}
    # A retracted sequence is re-prefilled with the same weights: log-probs stay exact.
    ref = reference_logprobs(engine.model, seq, 1.0)
    assert (torch.tensor(seq.output_logprobs, dtype=torch.float64) - ref).abs().max().item() <= 1e-5


def test_server_info_counts_generate_requests_in_flight_and_answered(engine):
    """/get_server_info's ``generate_requests``: a request is in flight while it generates and
    answered once it has returned, counted also per weight version; a refused one is neither
    (what tests/test_process_lifetime.py waits on to signal a run after a step's generation)."""
    from fastapi.testclient import TestClient

    from megatron_grpo.inference.server import build_app

    with TestClient(build_app(engine)) as client:
        def requests() -> dict:
            return client.get("/get_server_info").json()["generate_requests"]

        engine.weight_version = "7"
        assert requests() == {"in_flight": 0, "answered": 0, "answered_on_weight_version": 0}
        body = {"input_ids": PROMPTS[0], "sampling_params": {**LONG, "max_new_tokens": 4000}}
        answer: list = []
        worker = threading.Thread(target=lambda: answer.append(client.post("/generate", json=body)))
        worker.start()
        deadline = time.monotonic() + 60
        while requests()["in_flight"] == 0:
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.01)
        assert requests() == {"in_flight": 1, "answered": 0, "answered_on_weight_version": 0}
        worker.join(timeout=120)
        assert answer and answer[0].status_code == 200, answer
        assert requests() == {"in_flight": 0, "answered": 1, "answered_on_weight_version": 1}
        refused = client.post("/generate", json={"sampling_params": {"max_new_tokens": 2}})
        assert refused.status_code == 400, refused.text
        assert requests() == {"in_flight": 0, "answered": 1, "answered_on_weight_version": 1}
        assert client.post("/update_weight_version", json={"new_version": "8"}).status_code == 200
        assert requests() == {"in_flight": 0, "answered": 1, "answered_on_weight_version": 0}
        assert client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 2}}).status_code == 200
        assert requests() == {"in_flight": 0, "answered": 2, "answered_on_weight_version": 1}
