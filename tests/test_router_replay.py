"""Router replay: the embedded engine's recorded MoE routing, and the trainer's log-prob
passes forced to it (``trainer.router_replay``).

References: (a) the top-k of the router logits of a plain transformers forward over the same
sequence, computed by hand (``hf_topk``, tests/support/engine_runs.py); (b) the engine's own
log-probs, and a transformers forward whose routing is forced by hand to the engine's (hooks
replacing the HF routers' top-k).
"""

import threading

import pytest
import torch

from megatron_grpo.wire import routed_experts
from megatron_grpo.inference import routing
from megatron_grpo.inference.engine import EmbeddedEngine
from megatron_grpo.inference.generation import Sequence
from megatron_grpo.inference.sampling import resolve_sampling_params
from megatron_grpo.inference.server import _render
from tools.tiny import save_tiny_model
from tests.support.engine_runs import hf_topk

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


def test_engine_routing_equals_hf_topk(moe_model):
    _, model_dir = moe_model
    # PROMPTS[0] twice: two samples sharing one prefill (their prompt routing is replicated)
    eng, seqs = generate(model_dir, PROMPTS + PROMPTS[:1])
    try:
        assert seqs[0].output_ids != seqs[-1].output_ids  # own seeds: different responses
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


SCALE = 0.5  # router weight nudge, in units of each router weight's std


def nudge(routers: list, seed: int = 0) -> None:
    """Add the same seeded noise (SCALE x the weight's std) to each router's weight, in layer
    order: applied to the HF routers and to Megatron's, it makes the same change in both."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in routers:
            r.weight += (torch.randn(r.weight.shape, generator=gen) * SCALE * r.weight.std()).to(r.weight.dtype)


def megatron_routers(chunks) -> list:
    from megatron.core.transformer.moe.router import Router

    return sorted((m for c in chunks for m in c.modules() if isinstance(m, Router)), key=lambda r: r.layer_number)


@pytest.fixture(scope="module")
def rollout(moe_model):
    """The engine's rollout as a TrainBatch with its routing, and the references computed from
    the nudged HF model: log-probs with the routing forced to the engine's [N, T] (0 off the
    response) and the hand count of (token, layer) routings that differ from the engine's."""
    from transformers import AutoModelForCausalLM

    from megatron_grpo.rollout.batch import build_train_batch, pad_routed_experts

    _, model_dir = moe_model
    eng, seqs = generate(model_dir, PROMPTS)
    try:
        items = [_render(eng, s, False, 0.0) for s in seqs]
    finally:
        eng.shutdown()
    routed = [routed_experts.decode(it["meta_info"]["routed_experts"], len(s.prompt_ids) + len(s.output_ids) - 1)
              for it, s in zip(items, seqs)]
    batch = build_train_batch([s.prompt_ids for s in seqs], [s.output_ids for s in seqs],
                              [s.output_logprobs for s in seqs], torch.zeros(len(seqs)), pad_id=0)
    batch.routed_experts = pad_routed_experts(routed, batch.seq_length)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    nudge(routing.moe_routers(hf))
    k = hf.config.num_experts_per_tok
    ref = torch.zeros_like(batch.rollout_log_probs)
    mismatched = total = 0
    for i, s in enumerate(seqs):
        seq, p = s.prompt_ids + s.output_ids, len(s.prompt_ids)
        r = routed[i].reshape(len(seq) - 1, -1, k)
        differs = (hf_topk(hf, seq[:-1]).sort(-1).values != r.sort(-1).values).any(-1)[p - 1:]  # scored positions
        mismatched, total = mismatched + int(differs.sum()), total + differs.numel()
        ref[i, p - 1:len(seq) - 1] = forced_hf_log_probs(hf, seq, r)[p - 1:]
    assert mismatched > 0, "the nudge did not change any routing decision"
    return model_dir, batch, ref, mismatched / total


def replayed_log_probs(chunks, batch, replay: bool):
    """(log-probs [N, T] of the old-log-prob pass, moe/routing_mismatch_frac)."""
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs
    from megatron_grpo.trainer.router_replay import RoutingReplay

    rr = RoutingReplay(chunks, replay=replay)
    vocab = chunks[0].hf_config.vocab_size
    lp = compute_log_probs(chunks, batch, 2, ScoringSpec(temperature=1.0, vocab_size=vocab), routing=rr)
    return lp, rr.metrics()["moe/routing_mismatch_frac"]


def test_trainer_replays_engine_routing(rollout, single_rank):
    from tests.support.models_reference import build_and_load

    model_dir, batch, ref, frac_by_hand = rollout
    mask = batch.loss_mask > 0
    _, chunks = build_and_load(model_dir)
    # the engine's weights: replay changes nothing, the log-probs are the engine's
    lp, frac = replayed_log_probs(chunks, batch, True)
    assert frac == 0.0
    assert (lp - batch.rollout_log_probs)[mask].abs().max() <= 1e-5
    # routers nudged: the trainer's own routing differs from the engine's on some tokens
    nudge(megatron_routers(chunks))
    replayed, frac = replayed_log_probs(chunks, batch, True)
    own, frac_own = replayed_log_probs(chunks, batch, False)
    assert frac == frac_own == pytest.approx(frac_by_hand)
    replay_err = float((replayed - ref)[mask].abs().max())
    own_err = float((own - ref)[mask].abs().max())
    assert replay_err <= 1e-5
    assert own_err > 1e-3
    print(f"mismatch {frac:.3f}; |replay - forced HF| {replay_err:.2e}; |own - forced HF| {own_err:.2e}")


def _ep_worker(rank, world_size, model_dir, batch):
    from tests.support.models_reference import build_and_load

    _, chunks = build_and_load(model_dir)
    nudge(megatron_routers(chunks))
    return replayed_log_probs(chunks, batch, True)  # both dp ranks score the whole batch


@pytest.mark.slow
def test_trainer_replays_engine_routing_ep2(rollout, moe_model):
    from tests.support.distributed import run_distributed

    if moe_model[0] != "qwen3_moe":
        pytest.skip("one architecture is enough at EP2 (both at TP1)")
    model_dir, batch, ref, frac_by_hand = rollout
    mask = batch.loss_mask > 0
    for lp, frac in run_distributed(_ep_worker, 2, model_dir, batch, tp=1, ep=2, timeout_s=400):
        assert (lp - ref)[mask].abs().max() <= 1e-5
        assert frac == pytest.approx(frac_by_hand)


# ---- (c) configuration ------------------------------------------------------------------------
def test_router_replay_config_checks(tmp_path):
    import yaml

    from megatron_grpo.config import ConfigError
    from megatron_grpo.preflight import load_experiment
    from tests.support.configs import with_change

    def load(raw, name):
        p = tmp_path / name
        p.write_text(yaml.safe_dump(raw))
        return p, lambda: load_experiment(p)

    raw = with_change("algorithm.router_replay", True)
    assert load(raw, "ok.yaml")[1]().algorithm.router_replay is True
    raw["engine"]["kind"] = "sglang"
    path, go = load(raw, "sglang.yaml")
    with pytest.raises(ConfigError, match=rf"^{path}: algorithm.router_replay: needs an engine .*'sglang'"):
        go()
    raw = with_change("algorithm.router_replay", True)
    raw["model"]["recompute_activations"] = True
    path, go = load(raw, "recompute.yaml")
    with pytest.raises(ConfigError, match=rf"^{path}: algorithm.router_replay: cannot be combined with "
                                          r"model.recompute_activations"):
        go()


def test_router_replay_refused_for_a_dense_model(single_rank, tmp_path):
    from megatron_grpo.models.errors import ModelError
    from megatron_grpo.trainer.router_replay import RoutingReplay
    from tests.support.models_reference import build_and_load

    _, chunks = build_and_load(save_tiny_model(tmp_path / "dense", "qwen2", seed=1))
    with pytest.raises(ModelError, match=r"^algorithm.router_replay needs a mixture-of-experts model; "
                                         r"model_type 'qwen2' has no router"):
        RoutingReplay(chunks, replay=True)


@pytest.mark.slow
def test_train_with_router_replay_end_to_end(tmp_path):
    """`megatron-grpo train` on a tiny Qwen3-MoE with router replay, at EP2 (2 gloo ranks):
    the routing travels engine -> client -> batch -> both log-prob passes, and is logged."""
    import subprocess
    import sys

    from megatron_grpo.data.synthetic import generate as problems, write_jsonl
    from tests.support.demo_run import ENV, ROOT, read_metrics

    model = save_tiny_model(tmp_path / "model", "qwen3_moe", seed=4)
    write_jsonl(problems(64, 0, 5, ("+",)), tmp_path / "data.jsonl")
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "train", "--config", "yaml_configs/demo_cpu.yaml",
           f"model.hf_dir={model}", f"data.train_file={tmp_path / 'data.jsonl'}", "eval.sets=[]",
           f"trainer.run_dir={tmp_path / 'run'}", "trainer.num_steps=2", "logging.progress_bar=false",
           "parallel.tp=1", "parallel.ep=2", "parallel.world_size=2", "parallel.micro_batch_size=4",
           "parallel.global_batch_size=8", "rollout.prompts_per_step=4", "rollout.num_generations=4",
           "rollout.max_new_tokens=4", "algorithm.router_replay=true", "engine.kind=embedded"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=ENV, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # same weights in engine and trainer (fp32): no routing differs, log-probs agree
        assert r["moe/routing_mismatch_frac"] == 0.0
        assert r["rollout_train_logprobs_abs_diff_mean"] < 1e-5
