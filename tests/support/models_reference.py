"""Megatron models built from the HF references of ``models_fixtures`` and probed against them,
on every rank (tests/test_models_equivalence.py, test_models_moe.py, test_vpp.py,
test_router_replay.py): built and loaded from an HF directory or a Megatron checkpoint, their
logits and their weights exported back to HF compared with the HF model's."""

from __future__ import annotations

import torch

from tests.support.models_fixtures import PROBE_IDS, hf_tensors

TOL = 1e-5
"""Largest |Δlogits| allowed between Megatron's fp32 logits and the HF model's."""


def build_and_load(hf_dir, **build_kwargs):
    from megatron_grpo.models import build_model, load_hf_config, load_hf_weights

    cfg = load_hf_config(hf_dir)
    chunks = build_model(cfg, init_weights=False, **build_kwargs)
    load_hf_weights(chunks, hf_dir, cfg)
    return cfg, chunks


def build_from_checkpoint(hf_dir, ckpt_dir, **build_kwargs):
    """A NaN-filled model loaded from ``ckpt_dir``: any parameter it misses stays NaN."""
    from megatron_grpo.models import build_model, checkpoint_hf_config, load_megatron_checkpoint

    cfg = checkpoint_hf_config(ckpt_dir)
    chunks = build_model(cfg, init_weights=False, **build_kwargs)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.fill_(float("nan"))
    extra = load_megatron_checkpoint(chunks, ckpt_dir)
    return cfg, chunks, extra


def probe(cfg, chunks, hf_dir):
    """(full logits on the last stage's TP rank 0 or None, round-trip report of this rank)."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.models import forward_logits, gather_vocab, iter_hf_weights

    logits = forward_logits(chunks, PROBE_IDS)
    if logits is not None:
        logits = gather_vocab(logits, cfg.vocab_size)
        if ps.get_tensor_model_parallel_rank() != 0:
            logits = None
    original = hf_tensors(hf_dir)
    exported, not_bitwise = [], []
    for name, tensor in iter_hf_weights(chunks, cfg):
        exported.append(name)
        ref = original.get(name)
        if ref is None or ref.dtype != tensor.dtype or not torch.equal(ref, tensor):
            not_bitwise.append(name)
    return logits, {"exported": exported, "not_bitwise": not_bitwise}


def assert_matches(results, hf_dir, ref):
    """``results``: the ranks' ``probe`` results. Every logits holder (one per dp replica)
    matches HF; the union of exported names is the HF state dict, every tensor bitwise."""
    logits = [r[0] for r in results if r[0] is not None]
    assert logits
    for got in logits:
        delta = (got - ref).abs().max().item()
        assert delta <= TOL, f"max |Δlogits| = {delta}"
    not_bitwise = {n for r in results for n in r[1]["not_bitwise"]}
    assert not not_bitwise, f"not bitwise after the round trip: {sorted(not_bitwise)}"
    exported = {n for r in results for n in r[1]["exported"]}
    assert sorted(exported) == sorted(hf_tensors(hf_dir))
