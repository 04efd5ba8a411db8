"""vocab_parallel_log_probs against a full-vocabulary float64 reference, at tp = 1, 2, 4.

Every rank builds the same full logits from a seed, keeps its megatron vocabulary slice
[r * V/tp, (r + 1) * V/tp) and runs the op; the parent gathers the per-rank results and
compares them with float64 log_softmax / entropy (and their autograd gradients) computed on
the full, unpadded vocabulary. The float64 reference starts from the same float32 (or
bf16) values the op sees, so only the op's arithmetic is measured.
"""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.ops import vocab_parallel_log_probs
from tests.support.distributed import run_distributed

# name -> case. Leading shape [S, B] = [3, 2] (6 tokens); tiny vocabularies.
CASES = {
    "plain": dict(padded=256, vocab=256, temperature=1.0, chunk=None, dtype=torch.float32),
    "temp_pad_chunk": dict(padded=256, vocab=250, temperature=0.7, chunk=4, dtype=torch.float32),
    "hot_chunk1": dict(padded=256, vocab=256, temperature=1.6, chunk=1, dtype=torch.float32),
    # At tp=4 (shard 64) rank 3 holds only padding and rank 2 is partly padded.
    "mostly_padding": dict(padded=256, vocab=150, temperature=0.9, chunk=2, dtype=torch.float32),
    "bf16": dict(padded=256, vocab=250, temperature=0.7, chunk=5, dtype=torch.bfloat16),
    # inplace=True: the op overwrites the logits; the entropy gradient then uses log(exps).
    "inplace": dict(padded=256, vocab=150, temperature=0.7, chunk=4, dtype=torch.float32, inplace=True),
    "inplace_bf16": dict(padded=256, vocab=250, temperature=1.3, chunk=None, dtype=torch.bfloat16, inplace=True),
    # Logits spread over hundreds: most shifted logits fall below the op's exp floor (-80),
    # the distribution is nearly one-hot and the entropy tiny; targets are far in the tail.
    # Each floored column adds at most 80 * exp(-80) = 1.4e-33 to the entropy (float32
    # cannot hold exp(-104) at all): entropies of ~1e-42 come out as 3.7e-31 here.
    "wide": dict(padded=256, vocab=256, temperature=0.5, chunk=3, dtype=torch.float32, scale=60.0,
                 entropy_atol=256 * 80 * 1.9e-35),
    # tp_group passed explicitly instead of taken from megatron's parallel state.
    "explicit_group": dict(padded=256, vocab=256, temperature=1.0, chunk=2, dtype=torch.float32, explicit_group=True),
}
LEAD = (3, 2)


def _inputs(case: dict, seed: int = 0):
    """Full logits [S, B, V_padded] in the case's dtype (padded columns hold finite junk, as
    megatron's padded output rows do), targets [S, B] < vocab, loss weights w_lp, w_h [S, B]."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*LEAD, case["padded"], generator=gen) * case.get("scale", 4.0)).to(case["dtype"])
    targets = torch.randint(0, case["vocab"], LEAD, generator=gen)
    targets[0, 0] = case["vocab"] - 1  # the last real token, next to the padding
    w_lp, w_h = torch.randn(2, *LEAD, generator=gen, dtype=torch.float64)
    return logits, targets, w_lp, w_h


def _reference(case: dict):
    """float64 log p(target), entropy and d(sum(w_lp * lp + w_h * H))/d logits [S, B, V_padded]."""
    logits, targets, w_lp, w_h = _inputs(case)
    full = logits.double().requires_grad_()
    log_p = torch.log_softmax(full[..., : case["vocab"]] / case["temperature"], dim=-1)
    lp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    (w_lp * lp + w_h * entropy).sum().backward()
    return lp.detach(), entropy.detach(), full.grad


def _run_case(case: dict, rank: int, tp: int):
    """This rank's (log_probs, entropy, grad shard) for one case, tp_group from megatron."""
    logits, targets, w_lp, w_h = _inputs(case)
    shard = case["padded"] // tp
    mine = logits[..., rank * shard : (rank + 1) * shard].clone().requires_grad_()
    inplace = case.get("inplace", False)
    # In place, the op's input is a non-leaf, as logits straight from the output layer are.
    x = mine.clone() if inplace else mine
    group = torch.distributed.group.WORLD if case.get("explicit_group") else None
    lp, entropy = vocab_parallel_log_probs(
        x, targets, group, temperature=case["temperature"], vocab_size=case["vocab"],
        chunk_size=case["chunk"], inplace=inplace,
    )
    (w_lp * lp.double() + w_h * entropy.double()).sum().backward()
    return lp.detach(), entropy.detach(), mine.grad


def _megatron_ce(rank: int, tp: int):
    """-(megatron vocab_parallel_cross_entropy) and our log-probs, plus both gradients of
    sum(w * log p), on the same shard ("plain": no padding and T = 1, which is all
    megatron's op supports)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits, targets, w_lp, _ = _inputs(CASES["plain"])
    shard = logits.shape[-1] // tp
    mine = logits[..., rank * shard : (rank + 1) * shard]
    # megatron works in place on its input: hand it its own copy.
    theirs_in = mine.clone().requires_grad_()
    ours_in = mine.clone().requires_grad_()
    theirs = -vocab_parallel_cross_entropy(theirs_in.clone(), targets)
    (w_lp.float() * theirs).sum().backward()
    ours, _ = vocab_parallel_log_probs(ours_in, targets, with_entropy=False)
    (w_lp.float() * ours).sum().backward()
    return theirs.detach(), ours.detach(), theirs_in.grad, ours_in.grad


def _worker(rank: int, world_size: int, names: list[str]):
    out = {name: _run_case(CASES[name], rank, world_size) for name in names}
    out["megatron"] = _megatron_ce(rank, world_size)
    return out


def _check(per_rank: list[dict], names: list[str]):
    for name in names:
        case = CASES[name]
        ref_lp, ref_h, ref_grad = _reference(case)
        grad = torch.cat([r[name][2] for r in per_rank], dim=-1)
        for r in per_rank:  # every rank returns the same full log-probs and entropy
            # float32 whatever the logits' dtype: bf16 logits, fp32 math (rtol 1e-6 below
            # against float64 of the same bf16 values; bf16 arithmetic would be off by ~1e-2)
            assert r[name][0].dtype == r[name][1].dtype == torch.float32, name
            lp, entropy = r[name][0].double(), r[name][1].double()
            torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=0, msg=f"{name}: log-probs")
            torch.testing.assert_close(
                entropy, ref_h, rtol=1e-6, atol=case.get("entropy_atol", 0.0), msg=f"{name}: entropy"
            )
        assert torch.isfinite(grad).all(), name
        assert grad.dtype == case["dtype"], name
        assert (grad[..., case["vocab"] :] == 0).all(), f"{name}: padded columns got gradient"
        if case["dtype"] == torch.float32:
            torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6, msg=name)
        else:  # the gradient is returned in bf16: 8 mantissa bits
            torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-2, atol=1e-3, msg=name)
    for r in per_rank:
        theirs, ours, grad_theirs, grad_ours = r["megatron"]
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad_ours, grad_theirs, rtol=1e-5, atol=1e-6)


ALL = list(CASES)


def test_tp1_matches_full_vocab_reference():
    _check(run_distributed(_worker, 1, ALL, tp=1, timeout_s=300), ALL)


def test_tp2_matches_full_vocab_reference():
    _check(run_distributed(_worker, 2, ALL, tp=2, timeout_s=300), ALL)


@pytest.mark.slow
def test_tp4_matches_full_vocab_reference_with_padding_only_rank():
    _check(run_distributed(_worker, 4, ALL, tp=4, timeout_s=300), ALL)


# ---- single process, no megatron parallel state: tp_group=None means one local rank ----


def test_local_without_parallel_state_and_chunking_invariance():
    case = CASES["temp_pad_chunk"]
    ref_lp, ref_h, ref_grad = _reference(case)
    results = []
    for chunk in (None, 1, 4, 1000):
        lp, entropy, grad = _run_case(dict(case, chunk=chunk), rank=0, tp=1)
        torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=0)
        torch.testing.assert_close(entropy.double(), ref_h, rtol=1e-6, atol=0)
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)
        results.append((lp, entropy, grad))
    for lp, entropy, grad in results[1:]:  # chunking changes no value beyond float32 noise
        torch.testing.assert_close(lp, results[0][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, results[0][2], rtol=1e-6, atol=1e-7)


def test_gradient_of_one_output_only():
    """Only log-probs (or only entropy) in the loss: the other output's gradient is absent,
    and the result equals the reference gradient of that output alone."""
    case = CASES["temp_pad_chunk"]
    logits, targets, w_lp, w_h = _inputs(case)
    for use_lp in (True, False):
        full = logits.double().requires_grad_()
        log_p = torch.log_softmax(full[..., : case["vocab"]] / case["temperature"], dim=-1)
        ref = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1) if use_lp else -(log_p.exp() * log_p).sum(-1)
        (w_lp * ref).sum().backward()
        x = logits.clone().requires_grad_()
        lp, entropy = vocab_parallel_log_probs(
            x, targets, temperature=case["temperature"], vocab_size=case["vocab"], chunk_size=4
        )
        ((lp if use_lp else entropy).double() * w_lp).sum().backward()
        torch.testing.assert_close(x.grad.double(), full.grad, rtol=1e-5, atol=1e-6)


def test_without_entropy_returns_none_and_same_log_probs():
    case = CASES["temp_pad_chunk"]
    logits, targets, _, _ = _inputs(case)
    kw = dict(temperature=case["temperature"], vocab_size=case["vocab"])
    lp, entropy = vocab_parallel_log_probs(logits, targets, with_entropy=False, **kw)
    assert entropy is None
    torch.testing.assert_close(lp, vocab_parallel_log_probs(logits, targets, **kw)[0], rtol=0, atol=0)


def test_inplace_reuses_the_logits_storage_for_the_gradient():
    logits = torch.randn(16, 64, requires_grad=True)
    x = logits.clone()
    lp, entropy = vocab_parallel_log_probs(x, torch.randint(0, 60, (16,)), vocab_size=60, inplace=True)
    (grad,) = torch.autograd.grad(lp.sum() + entropy.sum(), x)
    assert grad.data_ptr() == x.data_ptr()


def test_saved_state_is_one_shard_that_becomes_the_gradient():
    """Autograd keeps the input logits (shared, no copy), one logits-shaped buffer in the
    logits' dtype, which backward returns as the gradient (no second shard), and O(tokens)
    statistics."""
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(64, 512, dtype=dtype, requires_grad=True)
        targets = torch.randint(0, 500, (64,))
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, entropy = vocab_parallel_log_probs(logits, targets, vocab_size=500, chunk_size=8)
        big = [t for t in saved if t.numel() >= logits.numel()]
        assert sorted(t.data_ptr() == logits.data_ptr() for t in big) == [False, True]
        buffer = next(t for t in big if t.data_ptr() != logits.data_ptr())
        assert buffer.dtype == dtype
        assert sum(t.numel() for t in saved if t.numel() < logits.numel()) <= 8 * 64
        (lp.sum() + entropy.sum()).backward(retain_graph=True)
        assert logits.grad.data_ptr() == buffer.data_ptr()
        with pytest.raises(RuntimeError, match="backward ran twice"):
            lp.sum().backward()


def test_rejects_bad_arguments():
    logits, targets = torch.randn(4, 16), torch.randint(0, 16, (4,))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(logits, targets, temperature=0.0)
    with pytest.raises(ValueError, match="vocab_size"):
        vocab_parallel_log_probs(logits, targets, vocab_size=17)
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_log_probs(logits, targets, chunk_size=0)
    with pytest.raises(ValueError, match="leading shape"):
        vocab_parallel_log_probs(logits, targets[:3])
