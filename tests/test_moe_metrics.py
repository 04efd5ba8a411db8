"""Router load metrics (``trainer.moe_metrics``): the tokens-per-expert counts of the old-policy
log-prob pass equal a hand count from the HF model's own router logits (top-k of every scored
position, layer by layer), and the balance metrics follow their definitions."""

import math

import pytest
import torch

from megatron_grpo.trainer.moe_metrics import load_metrics


def test_load_metrics_by_hand():
    m = load_metrics(torch.tensor([[2, 2, 2, 2], [8, 0, 0, 0]]))
    assert m["moe/expert_load_max_over_mean"] == pytest.approx((1 + 4) / 2)
    assert m["moe/expert_load_max_over_mean_worst_layer"] == pytest.approx(4)
    assert m["moe/expert_load_cv"] == pytest.approx((0 + math.sqrt(3)) / 2)
    assert m["moe/expert_load_min_fraction"] == 0


def _batch():
    from megatron_grpo.rollout.batch import build_train_batch

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(7, 200, (n,), generator=gen).tolist() for n in (3, 5, 4, 2, 6)]
    outputs = [torch.randint(7, 200, (n,), generator=gen).tolist() for n in (4, 1, 3, 6, 2)]
    return build_train_batch(prompts, outputs, [[0.0] * len(o) for o in outputs], torch.zeros(5), pad_id=0)


def _hand_counts(hf_dir, batch) -> torch.Tensor:
    """[L, E] (token, expert) assignments of the HF router at the loss-mask positions."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    k, num_experts = model.config.num_experts_per_tok, model.config.num_experts
    with torch.no_grad():
        out = model(batch.tokens, output_router_logits=True)
    n, s = batch.tokens.shape
    scored = torch.zeros(n, s, dtype=torch.bool)
    scored[:, : s - 1] = batch.loss_mask > 0
    counts = []
    for logits in out.router_logits:  # [N * S, E], rows ordered n * S + s
        top = logits.reshape(n, s, num_experts)[scored].topk(k, dim=-1).indices
        counts.append(torch.bincount(top.reshape(-1), minlength=num_experts))
    return torch.stack(counts)


def test_router_load_equals_hand_count(single_rank, tmp_path):
    from megatron_grpo.models import build_model, load_hf_config, load_hf_weights
    from tools.tiny import save_tiny_model
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs
    from megatron_grpo.trainer.moe_metrics import RouterLoad

    hf_dir = str(save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=7))
    cfg = load_hf_config(hf_dir)
    chunks = build_model(cfg, init_weights=False)
    load_hf_weights(chunks, hf_dir, cfg)
    batch = _batch()
    load = RouterLoad(chunks)
    assert load.active and len(load.routers) == cfg.num_hidden_layers
    compute_log_probs(chunks, batch, 2, ScoringSpec(temperature=1.0, vocab_size=cfg.vocab_size), router_load=load)
    got = torch.stack([load.counts[layer] for layer in sorted(load.counts)])
    want = _hand_counts(hf_dir, batch)
    assert torch.equal(got, want), (got, want)
    assert int(got.sum()) == cfg.num_experts_per_tok * cfg.num_hidden_layers * int(batch.loss_mask.sum())
    assert load.metrics(sequence_parallel=False) == load_metrics(want)
    # a dense model has no routers: no metrics, no hooks
    dense = RouterLoad(build_model(load_hf_config(str(save_tiny_model(tmp_path / "d", "qwen2"))), init_weights=False))
    assert not dense.active and dense.metrics(sequence_parallel=False) == {}
