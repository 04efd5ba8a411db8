"""Continuous batching in the embedded engine (``inference/scheduler.py``).

References: transformers' own unpadded full forward of each finished sequence (log-probs to
1e-5), the same seeded sequence generated alone (batch invariance), and the row count of
each forward seen by a hook on the embedding (prefix sharing).
"""

import threading
import time
import warnings

import pytest
import torch

from megatron_grpo.inference.engine import EmbeddedEngine
from megatron_grpo.inference.generation import Sequence
from megatron_grpo.inference.sampling import resolve_sampling_params
from megatron_grpo.inference.scheduler import StepControl, run_continuous
from tools.tiny import save_tiny_model
from tests.support.engine_runs import hf_topk, reference_logprobs

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20], [21, 22, 23]]
LENGTHS = [3, 17, 5, 2, 9, 4, 12, 3, 6, 2, 8, 5]  # long-tailed: rows keep finishing and joining


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2", seed=5)
    eng = EmbeddedEngine(model_dir, dtype="float32", max_batch_size=16, seed=0)
    yield eng
    eng.shutdown()


def make(i: int, prompt: list[int], max_new_tokens: int, temperature: float = 1.0) -> Sequence:
    seq = Sequence(rid=str(i), prompt_ids=list(prompt), return_logprob=True,
                   params=resolve_sampling_params({"temperature": temperature, "max_new_tokens": max_new_tokens,
                                                   "ignore_eos": True, "sampling_seed": 100 + i}))
    seq.generator = torch.Generator().manual_seed(seq.params.seed)
    return seq


def generate(model, seqs: list[Sequence], max_batch_size: int, min_admit: int = 1) -> list[tuple[int, int]]:
    """Run ``seqs`` through one continuous batch; returns (k, admitted) per admit() call."""
    queue, calls = list(seqs), []

    def admit(k):
        taken = queue[:k]
        del queue[:k]
        calls.append((k, len(taken)))
        return taken

    retracted = run_continuous(model, admit, max_batch_size=max_batch_size, eos_ids=frozenset(), pad_id=0,
                               shared_generator=torch.Generator().manual_seed(0), max_context=512,
                               control=lambda: StepControl.CONTINUE, weight_version=lambda: "v", min_admit=min_admit)
    assert retracted == [] and all(s.finished for s in seqs)
    return calls


def max_logprob_error(model, seqs: list[Sequence], temperature: float = 1.0) -> float:
    return max((torch.tensor(s.output_logprobs, dtype=torch.float64) - reference_logprobs(model, s, temperature))
               .abs().max().item() for s in seqs)


def test_sequences_joining_mid_batch_are_exact_and_batch_invariant(engine):
    seqs = [make(i, PROMPTS[i % len(PROMPTS)], n) for i, n in enumerate(LENGTHS)]
    calls = generate(engine.model, seqs, max_batch_size=4)
    # newcomers joined a running batch (fewer than max_batch_size rows were free) several times
    assert sum(1 for k, got in calls if 0 < k < 4 and got > 0) >= 3, calls
    assert [len(s.output_ids) for s in seqs] == LENGTHS
    assert max_logprob_error(engine.model, seqs) <= 1e-5
    for i in (1, 6, 10):  # a seeded sequence draws the same tokens alone as in any batch
        alone = make(i, PROMPTS[i % len(PROMPTS)], LENGTHS[i])
        generate(engine.model, [alone], max_batch_size=4)
        assert alone.output_ids == seqs[i].output_ids


def test_generation_passes_the_cache_the_way_this_transformers_takes_it(engine):
    """transformers 5.2x deprecates ``past_key_values=`` for ``cache=`` (removed in 5.40): the
    engine uses whichever keyword the model's forward declares, so no deprecation warning is
    raised and the output is the same as before (the exactness test above)."""
    seqs = [make(i, PROMPTS[i], 3) for i in range(2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(engine.model, seqs, max_batch_size=4)
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]
    assert max_logprob_error(engine.model, seqs) <= 1e-5


def test_samples_of_one_prompt_share_one_prefill(engine):
    rows_per_forward = []
    hook = engine.model.get_input_embeddings().register_forward_hook(
        lambda m, inputs, out: rows_per_forward.append(tuple(inputs[0].shape)))
    try:
        seqs = [make(i, PROMPTS[2], 6, temperature=0.8) for i in range(4)] + [make(4, PROMPTS[0], 6, 0.8)]
        generate(engine.model, seqs, max_batch_size=8)
    finally:
        hook.remove()
    assert rows_per_forward[0] == (2, len(PROMPTS[2]))  # ONE prefill row per distinct prompt
    assert all(shape == (5, 1) for shape in rows_per_forward[1:])  # then every sample decodes
    assert len({tuple(s.output_ids) for s in seqs[:4]}) > 1  # the samples differ (own seeds)
    assert max_logprob_error(engine.model, seqs, 0.8) <= 1e-5


def test_routing_of_rows_that_joined_mid_batch_equals_hf_topk(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=4)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seqs = [make(i, PROMPTS[i % 3], n) for i, n in enumerate([2, 7, 3, 5, 2])] + [make(5, PROMPTS[0], 4)]
    for s in seqs[1::2]:  # rows that record next to rows that do not
        s.return_routed_experts = True
    calls = generate(model, seqs, max_batch_size=2)
    assert sum(1 for k, got in calls if k == 1 and got > 0) >= 2, calls  # joined a running row
    for s in seqs[1::2]:
        tokens = s.prompt_ids + s.output_ids
        ref = hf_topk(model, tokens[:-1])  # [P, layers, k]
        assert torch.equal(s.routed_experts.sort(-1).values, ref.sort(-1).values.int())
    assert not seqs[0].routed_blocks


def test_weight_update_drains_the_batch_and_admits_nothing_meanwhile(engine):
    long = Sequence(rid="long", prompt_ids=PROMPTS[0], return_logprob=True,
                    params=resolve_sampling_params({"max_new_tokens": 300, "ignore_eos": True}))
    late = Sequence(rid="late", prompt_ids=PROMPTS[1], return_logprob=True,
                    params=resolve_sampling_params({"max_new_tokens": 4, "ignore_eos": True}))
    late_done = threading.Event()
    late.on_finish = lambda s: late_done.set()
    engine.submit([long])
    deadline = time.monotonic() + 60
    while len(long.output_ids) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    seen = {}

    def update():
        with engine.exclusive():
            seen.update(long_finished=long.finished, late_tokens=len(late.output_ids))
            engine.weight_version = "v2"

    updater = threading.Thread(target=update)
    updater.start()
    while not engine._updating:
        time.sleep(0.001)
    engine.submit([late])  # the batch has free rows, but an update is waiting
    updater.join(120)
    assert seen == {"long_finished": True, "late_tokens": 0}
    assert late_done.wait(60) and late.weight_version == "v2" and long.weight_version == "default"
