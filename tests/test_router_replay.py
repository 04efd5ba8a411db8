"""Router replay: the embedded engine's recorded MoE routing, and the trainer's log-prob
passes forced to it (``trainer.router_replay``).

References: (a) the top-k of the router logits of a plain transformers forward over the same
sequence, computed here by hand; (b) the engine's own log-probs, and a transformers forward
whose routing is forced by hand to the engine's (hooks replacing the HF routers' top-k).
"""

import threading

import pytest
import torch

from megatron_grpo.rollout import routed_experts
from megatron_grpo.rollout.embedded import routing
from megatron_grpo.rollout.embedded.engine import EmbeddedEngine
from megatron_grpo.rollout.embedded.generation import Sequence
from megatron_grpo.rollout.embedded.sampling import resolve_sampling_params
from megatron_grpo.rollout.embedded.server import _render
from megatron_grpo.testing.tiny_models import save_tiny_model
from tests.test_models_equivalence import single_rank  # noqa: F401

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
            got = routed_experts.decode(item["meta_info"]["routed_experts"], len(seq) - 1)
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


# ---- (b) the trainer's log-prob pass replays the engine's routing -------------------------------
def forced_hf_log_probs(model, seq: list[int], forced_PLK: torch.Tensor) -> torch.Tensor:
    """float [P]: log-probs of ``seq[1:]`` from an HF forward whose routers keep their own
    probabilities but take the experts ``forced_PLK`` [P, layers, k] (written here by hand,
    following the transformers router: softmax, gather, renormalise where the model does)."""
    routers = routing.moe_routers(model)

    def force(layer):
        def hook(router, inputs, output):
            logits = output[0]
            idx = forced_PLK[:, layer].long()
            top = logits.float().softmax(dim=-1).gather(1, idx)
            if getattr(router, "norm_topk_prob", True):  # mixtral always renormalises
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), idx
        return hook

    handles = [r.register_forward_hook(force(i)) for i, r in enumerate(routers)]
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq[:-1]])).logits[0].float()
    finally:
        for h in handles:
            h.remove()
    return logits.log_softmax(-1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]


def perturb_routers(hf_model, chunks, scale: float, seed: int = 0) -> None:
    """The same small change to every router's weight in the HF model and the Megatron model."""
    from megatron.core.transformer.moe.router import Router

    gen = torch.Generator().manual_seed(seed)
    mg = sorted((m for c in chunks for m in c.modules() if isinstance(m, Router)), key=lambda r: r.layer_number)
    hf = routing.moe_routers(hf_model)
    assert len(mg) == len(hf)
    with torch.no_grad():
        for a, b in zip(hf, mg):
            delta = torch.randn(a.weight.shape, generator=gen) * scale * a.weight.std()
            a.weight += delta
            b.weight += delta.to(b.weight.dtype)


def test_trainer_replays_engine_routing(moe_model, single_rank):
    from transformers import AutoModelForCausalLM

    from megatron_grpo.trainer.batch import build_train_batch, pad_routed_experts
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs
    from megatron_grpo.trainer.router_replay import RoutingReplay
    from tests.test_models_equivalence import build_and_load

    _, model_dir = moe_model
    eng, seqs = generate(model_dir, PROMPTS)
    eng.shutdown()
    cfg, chunks = build_and_load(model_dir)
    num_layers, k = cfg.num_hidden_layers, cfg.num_experts_per_tok
    routed = [routed_experts.decode(_render(eng, s, False, 0.0)["meta_info"]["routed_experts"],
                             len(s.prompt_ids) + len(s.output_ids) - 1) for s in seqs]
    batch = build_train_batch([s.prompt_ids for s in seqs], [s.output_ids for s in seqs],
                              [s.output_logprobs for s in seqs], torch.zeros(len(seqs)), pad_id=0)
    batch.routed_experts = pad_routed_experts(routed, batch.seq_length)
    spec = ScoringSpec(temperature=1.0, vocab_size=cfg.vocab_size)
    mask = batch.loss_mask > 0

    def trainer_log_probs(replay: bool):
        rr = RoutingReplay(chunks, replay=replay)
        lp = compute_log_probs(chunks, batch, 2, spec, routing=rr)
        return lp, rr.metrics()["moe/routing_mismatch_frac"]

    # same weights as the engine: replay changes nothing, the log-probs are the engine's
    lp, frac = trainer_log_probs(True)
    assert frac == 0.0
    assert (lp - batch.rollout_log_probs)[mask].abs().max() <= 1e-5

    # routers nudged: the trainer's own routing differs from the engine's on some tokens
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    perturb_routers(hf, chunks, scale=0.5)
    replayed, frac = trainer_log_probs(True)
    own, frac_own = trainer_log_probs(False)
    assert frac == frac_own
    mismatched = total = 0
    max_replay_vs_ref = max_own_vs_ref = 0.0
    for i, s in enumerate(seqs):
        seq = s.prompt_ids + s.output_ids
        p, r = len(s.prompt_ids), routed[i].reshape(len(seq) - 1, num_layers, k)
        mine = hf_topk(hf, seq[:-1])  # the perturbed model's own routing
        differs = (mine.sort(-1).values != r.sort(-1).values).any(-1)[p - 1:]  # scored positions
        mismatched, total = mismatched + int(differs.sum()), total + differs.numel()
        ref = forced_hf_log_probs(hf, seq, r)[p - 1:]
        n = len(s.output_ids)
        max_replay_vs_ref = max(max_replay_vs_ref, float((replayed[i, p - 1:p - 1 + n] - ref).abs().max()))
        max_own_vs_ref = max(max_own_vs_ref, float((own[i, p - 1:p - 1 + n] - ref).abs().max()))
    assert mismatched > 0, "the perturbation did not change any routing decision"
    assert frac == pytest.approx(mismatched / total)
    assert max_replay_vs_ref <= 1e-5
    assert max_own_vs_ref > 1e-3
    print(f"mismatch {frac:.3f}; |replay - forced HF| {max_replay_vs_ref:.2e}; |own - forced HF| {max_own_vs_ref:.2e}")


# ---- (c) configuration ------------------------------------------------------------------------
def test_router_replay_config_checks(tmp_path):
    import yaml

    from megatron_grpo.config import ConfigError, load_config
    from tests.test_config import with_change

    def load(raw, name):
        p = tmp_path / name
        p.write_text(yaml.safe_dump(raw))
        return p, lambda: load_config(p)

    raw = with_change("algorithm.router_replay", True)
    assert load(raw, "ok.yaml")[1]().algorithm.router_replay is True
    raw["rollout"]["engine"] = "sglang"
    path, go = load(raw, "sglang.yaml")
    with pytest.raises(ConfigError, match=rf"^{path}: algorithm.router_replay: needs an engine .*'sglang'"):
        go()
    raw = with_change("algorithm.router_replay", True)
    raw["model"]["recompute_activations"] = True
    path, go = load(raw, "recompute.yaml")
    with pytest.raises(ConfigError, match=rf"^{path}: algorithm.router_replay: cannot be combined with "
                                          r"model.recompute_activations"):
        go()
