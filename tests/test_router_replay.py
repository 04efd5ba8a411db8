"""Router replay: the embedded engine's recorded MoE routing, and the trainer's log-prob
passes forced to it (``trainer.router_replay``).

References: (a) the top-k of the router logits of a plain transformers forward over the same
sequence, computed here by hand; (b) the engine's own log-probs, and a transformers forward
whose routing is forced by hand to the engine's (hooks replacing the HF routers' top-k).
"""

import threading

import pytest
import torch

from megatron_grpo.rollout.embedded import routing
from megatron_grpo.rollout.embedded.engine import EmbeddedEngine
from megatron_grpo.rollout.embedded.generation import Sequence
from megatron_grpo.rollout.embedded.sampling import resolve_sampling_params
from megatron_grpo.rollout.embedded.server import _render
from megatron_grpo.testing.tiny_models import save_tiny_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19]]
PARAMS = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_model(request, tmp_path_factory):
    return request.param, save_tiny_model(tmp_path_factory.mktemp(request.param) / "m", request.param, seed=4)


def generate(model_dir, prompts, params=PARAMS, routed=True):
    """The engine's sequences for ``prompts`` (one wave, sampled, routing recorded)."""
    eng = EmbeddedEngine(model_dir, dtype="float32", max_batch_size=16, seed=0)
    try:
        done = threading.Semaphore(0)
        seqs = [Sequence(rid=str(i), prompt_ids=list(p), params=resolve_sampling_params(params | {"sampling_seed": i}),
                         return_logprob=True, return_routed_experts=routed, on_finish=lambda s: done.release())
                for i, p in enumerate(prompts)]
        eng.submit(seqs)
        for _ in seqs:
            assert done.acquire(timeout=120), "generation did not finish"
        return eng, seqs
    except BaseException:
        eng.shutdown()
        raise


def hf_topk(model, token_ids: list[int]) -> torch.Tensor:
    """int [P, num_moe_layers, k]: top-k of softmax(router logits) of a plain HF forward,
    computed here from the logits the routers return (their own indices are ignored)."""
    logits = []
    routers = routing.moe_routers(model)
    handles = [r.register_forward_hook(lambda m, i, o: logits.append(o[0].detach())) for r in routers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([token_ids]))
    finally:
        for h in handles:
            h.remove()
    k = routers[0].top_k
    probs = torch.stack(logits, dim=1).float().softmax(dim=-1)  # [P, layers, E]
    return probs.topk(k, dim=-1).indices


def test_engine_routing_equals_hf_topk(moe_model):
    _, model_dir = moe_model
    eng, seqs = generate(model_dir, PROMPTS)
    try:
        for s in seqs:
            seq = s.prompt_ids + s.output_ids
            item = _render(eng, s, with_text=False, latency=0.0)
            got = routing.decode(item["meta_info"]["routed_experts"], len(seq) - 1)
            ref = hf_topk(eng.model, seq[:-1])
            assert got.shape == (len(seq) - 1, ref.shape[1] * ref.shape[2])
            assert torch.equal(got.reshape(ref.shape).sort(-1).values, ref.sort(-1).values.int())
        # opt-in: a request that does not ask gets no routing
        assert "routed_experts" not in _render(eng, generate_plain(eng), with_text=False, latency=0.0)["meta_info"]
    finally:
        eng.shutdown()


def generate_plain(eng):
    done = threading.Semaphore(0)
    s = Sequence(rid="plain", prompt_ids=[5, 6], params=resolve_sampling_params(PARAMS), return_logprob=True,
                 on_finish=lambda s: done.release())
    eng.submit([s])
    assert done.acquire(timeout=120)
    assert not s.routed_blocks
    return s
