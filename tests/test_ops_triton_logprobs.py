"""The Triton kernels of vocab_parallel_log_probs (kernel="triton") on CPU, under Triton's
interpreter, against the torch path and a float64 full-vocabulary reference.

Every kernel run happens in processes spawned with TRITON_INTERPRET=1 in their environment
(set only around the spawn): triton reads it when it is imported, and the pytest process may
already have imported triton through megatron-core without it. The tp = 1 checks run in one
spawned process (``CHECKS``, each reported back as a traceback or None and asserted by its
own test); tp = 2 in two gloo ranks. The interpreter runs the kernels on CPU tensors (slowly: the shapes are tiny and the
column blocks small, so that every row spans several blocks and the online max rescales).
Covered at tp = 1 (in process) and tp = 2 (two gloo ranks): log-probs, entropies and the
gradient of a loss using both, only the log-prob, only the entropy, and with the entropy
not computed; float32 and bf16 logits; temperature != 1; a vocabulary that is not a
multiple of the block and a rank holding only padding; logits spread far below the exp
floor; rows with a large offset and a peaked row whose maximum lies in the last block;
in-place; truncated sampling (``kept_ids``). Also: which implementation ``kernel`` picks,
the saved state (the logits only), the one-backward contract, and that Triton's compiler
(not only the interpreter) accepts the kernels for a CUDA target.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
import typing
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.config import ModelConfig
from megatron_grpo.ops import vocab_parallel_log_probs
from megatron_grpo.ops.vocab_parallel import KERNELS
from tests.support.distributed import run_distributed
from megatron_grpo.models.packing import pack
from megatron_grpo.trainer.megatron_step import ScoringSpec, _packed_token_scores, _token_scores


# Every test here spawns processes (the kernels run only there) or compiles for ~10 s.
pytestmark = pytest.mark.slow


def _interpreted(fn, world_size: int, **kwargs):
    """run_distributed(fn, world_size) in fresh processes under Triton's interpreter."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        return run_distributed(fn, world_size, timeout_s=600, **kwargs)


# name -> check run in the spawned tp = 1 process (no megatron parallel state: one local rank)
CHECKS: dict = {}


def _in_child(fn):
    """Decorator: ``fn`` runs in the spawned tp = 1 process; the test of its name, in this
    one, asserts that it passed there."""
    CHECKS[fn.__name__] = (fn, ())

    def test(tp1_results):
        _outcome(tp1_results, fn.__name__)

    test.__name__, test.__doc__ = fn.__name__, fn.__doc__
    return test


def _run_checks(rank: int, world_size: int) -> dict:
    from megatron_grpo.ops import triton_logprobs

    assert triton_logprobs.INTERPRETED, "TRITON_INTERPRET=1 did not reach the spawned process"
    out = {}
    for name, (fn, args) in CHECKS.items():
        try:
            fn(*args)
            out[name] = None
        except Exception:  # noqa: BLE001 - reported to the test of that name
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def tp1_results():
    return _interpreted(_run_checks, 1)[0]


def _outcome(results: dict, name: str) -> None:
    if results[name] is not None:
        pytest.fail(f"{name} (in the spawned process):\n{results[name]}", pytrace=False)


NUM_TOKENS = 8
# name -> case; padded 320: tp=2 shards of 160 columns, blocks of 64 or 128 (2-5 per row).
CASES = {
    "plain": dict(padded=320, vocab=320, temperature=1.0, block=128, dtype=torch.float32),
    "temp_pad": dict(padded=320, vocab=301, temperature=0.7, block=64, dtype=torch.float32),
    # At tp=2 rank 1 (columns 160..319) holds only padding.
    "padding_only_rank": dict(padded=320, vocab=150, temperature=0.9, block=64, dtype=torch.float32),
    "bf16": dict(padded=320, vocab=301, temperature=0.7, block=128, dtype=torch.bfloat16),
    "inplace": dict(padded=320, vocab=301, temperature=1.3, block=64, dtype=torch.float32, inplace=True),
    "inplace_bf16": dict(padded=320, vocab=250, temperature=0.8, block=128, dtype=torch.bfloat16, inplace=True),
    # Most shifted logits below the exp floor (-80); nearly one-hot rows (see
    # test_ops_vocab_parallel's "wide" for the entropy tolerance).
    "wide": dict(padded=320, vocab=320, temperature=0.5, block=64, dtype=torch.float32, scale=60.0,
                 entropy_atol=320 * 80 * 1.9e-35),
    # The peaked row's entropy (~5e-14) sums exp(z) at z ~ -67, where float32 z carries a
    # relative error of 67 * 6e-8 = 4e-6 into each term: the torch path's too.
    "extreme_rows": dict(padded=320, vocab=310, temperature=0.6, block=64, dtype=torch.float32, extreme=True,
                         entropy_rtol=1e-5),
}


def _inputs(case: dict, seed: int = 0):
    """Full logits [N, padded] in the case's dtype, targets [N] < vocab, loss weights [2, N]
    float64. ``extreme``: row 1 offset by +3e4, row 2 by -3e4, row 3 peaked (+40 at a column
    of the last block, its target), row 4 with every logit equal."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(NUM_TOKENS, case["padded"], generator=gen) * case.get("scale", 4.0)
    targets = torch.randint(0, case["vocab"], (NUM_TOKENS,), generator=gen)
    targets[0] = case["vocab"] - 1  # the last real token, next to the padding
    if case.get("extreme"):
        logits[1] += 3e4
        logits[2] -= 3e4
        peak = case["vocab"] - 3
        logits[3, peak] += 40.0
        targets[3] = peak
        logits[4] = 1.5
    w = torch.randn(2, NUM_TOKENS, generator=gen, dtype=torch.float64)
    return logits.to(case["dtype"]), targets, w


def _reference(case: dict, use=("lp", "h")):
    """float64 log p(target), entropy and the gradient of the weighted sum of ``use``."""
    logits, targets, w = _inputs(case)
    full = logits.double().requires_grad_()
    log_p = torch.log_softmax(full[:, : case["vocab"]] / case["temperature"], dim=-1)
    lp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    loss = sum(w[i] * v for i, (name, v) in enumerate((("lp", lp), ("h", entropy))) if name in use)
    loss.sum().backward()
    return lp.detach(), entropy.detach(), full.grad


def _run(case: dict, rank: int, tp: int, kernel: str, use=("lp", "h"), with_entropy: bool = True):
    """This rank's (log-probs, entropy or None, grad shard) for one case and kernel."""
    logits, targets, w = _inputs(case)
    shard = case["padded"] // tp
    mine = logits[:, rank * shard : (rank + 1) * shard].clone().requires_grad_()
    inplace = case.get("inplace", False)
    x = mine.clone() if inplace else mine  # in place, the input is a non-leaf (the output layer's)
    lp, entropy = vocab_parallel_log_probs(
        x, targets, temperature=case["temperature"], vocab_size=case["vocab"], inplace=inplace,
        with_entropy=with_entropy, kernel=kernel, block_size=case["block"], chunk_size=5,
    )
    parts = [w[0] * lp.double()] if "lp" in use else []
    parts += [w[1] * entropy.double()] if "h" in use else []
    sum(parts).sum().backward()
    return lp.detach(), None if entropy is None else entropy.detach(), mine.grad


def _check_against_reference(case: dict, lp, entropy, grad, use=("lp", "h"), name=""):
    ref_lp, ref_h, ref_grad = _reference(case, use)
    assert lp.dtype == torch.float32, name
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=0, msg=f"{name}: log-probs")
    if entropy is not None:
        assert entropy.dtype == torch.float32, name
        torch.testing.assert_close(entropy.double(), ref_h, rtol=case.get("entropy_rtol", 1e-6),
                                   atol=case.get("entropy_atol", 0.0),
                                   msg=f"{name}: entropy")
    assert grad.dtype == case["dtype"] and torch.isfinite(grad).all(), name
    assert (grad[:, case["vocab"] :] == 0).all(), f"{name}: padded columns got gradient"
    if case["dtype"] == torch.float32:
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6, msg=f"{name}: grad")
    else:  # the gradient is returned in bf16
        torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-2, atol=1e-3, msg=f"{name}: grad")


def _check_against_torch(ours, theirs, dtype, name):
    """The kernels against the torch path on the same inputs: same float32 statistics up to
    the order of the sums."""
    for a, b, what in zip(ours[:2], theirs[:2], ("log-probs", "entropy")):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"{name}: {what}")
    # bf16: both gradients are rounded to bf16, and the torch path's in-place entropy
    # gradient uses log of the bf16 exps: the reference's bf16 tolerance.
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(ours[2], theirs[2], **tol, msg=f"{name}: grad")


# ---- tp = 2: two gloo ranks; every rank returns its results for every case ----

# "plain" and "inplace" are left to tp = 1: the interpreter is slow.
TP2_CASES = [name for name in CASES if name not in ("plain", "inplace")]


def _tp_worker(rank: int, world_size: int):
    out = {}
    for name in TP2_CASES:
        for kernel in ("triton", "torch"):
            out[name, kernel] = _run(CASES[name], rank, world_size, kernel)
    out["kept"] = [_run_kept(rank, world_size, kernel) for kernel in ("triton", "torch")]
    return out


def test_tp2_matches_torch_path_and_full_vocab_reference():
    per_rank = _interpreted(_tp_worker, 2, tp=2)
    for name in TP2_CASES:
        case = CASES[name]
        grad = torch.cat([r[name, "triton"][2] for r in per_rank], dim=-1)
        grad_torch = torch.cat([r[name, "torch"][2] for r in per_rank], dim=-1)
        for r in per_rank:  # every rank holds the full log-probs and entropies
            _check_against_reference(case, r[name, "triton"][0], r[name, "triton"][1], grad, name=f"tp2 {name}")
            _check_against_torch((*r[name, "triton"][:2], grad), (*r[name, "torch"][:2], grad_torch),
                                 case["dtype"], f"tp2 {name}")
    grads = [torch.cat([r["kept"][i][2] for r in per_rank], dim=-1) for i in (0, 1)]
    _check_kept(per_rank[0]["kept"][0][:2], grads[0])
    _check_against_torch((*per_rank[0]["kept"][0][:2], grads[0]), (*per_rank[0]["kept"][1][:2], grads[1]),
                         torch.float32, "tp2 kept")


# ---- tp = 1: one spawned process runs every check below; each test asserts its outcome ----


def _tp1_case(name):
    case = CASES[name]
    ours = _run(case, 0, 1, "triton")
    _check_against_reference(case, *ours, name=name)
    _check_against_torch(ours, _run(case, 0, 1, "torch"), case["dtype"], name)


CHECKS.update({f"case {name}": (_tp1_case, (name,)) for name in CASES})


@pytest.mark.parametrize("name", list(CASES))
def test_tp1_matches_torch_path_and_full_vocab_reference(tp1_results, name):
    _outcome(tp1_results, f"case {name}")


VARIANTS = {"both": dict(), "lp_only": dict(use=("lp",)), "h_only": dict(use=("h",)),
            "no_entropy": dict(use=("lp",), with_entropy=False)}


def _tp1_variant(variant):
    kw = VARIANTS[variant]
    lp, entropy, grad = _run(CASES["temp_pad"], 0, 1, "triton", **kw)
    assert (entropy is None) == (kw.get("with_entropy") is False)
    _check_against_reference(CASES["temp_pad"], lp, entropy, grad, use=kw.get("use", ("lp", "h")), name=variant)


CHECKS.update({f"variant {variant}": (_tp1_variant, (variant,)) for variant in VARIANTS})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp1_gradient_of_one_output(tp1_results, variant):
    """Log-prob only, entropy only, and entropy not computed (None, log-prob gradient only)."""
    _outcome(tp1_results, f"variant {variant}")


@_in_child
def test_block_size_does_not_change_values():
    case = CASES["temp_pad"]
    results = [_run(dict(case, block=block), 0, 1, "triton") for block in (32, 64, 512)]
    for lp, entropy, grad in results[1:]:
        torch.testing.assert_close(lp, results[0][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(entropy, results[0][1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, results[0][2], rtol=1e-6, atol=1e-7)


# ---- truncated sampling: kept_ids (a masked copy of the shard, then the kernels in place) ----

KEPT_VOCAB, KEPT_PADDED, KEPT_T = 120, 128, 0.7


def _kept_inputs():
    """Logits [8, 128], targets, kept ids [8, 6]: token 0 untruncated, token 1's set on the
    first half of the vocabulary only (tp=2: rank 1 holds none of it), token 2 the target
    alone."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, KEPT_PADDED, generator=gen) * 3.0
    targets = torch.randint(0, KEPT_VOCAB, (8,), generator=gen)
    kept = torch.full((8, 6), -1, dtype=torch.long)
    for t in range(3, 8):
        ids = torch.unique(torch.cat([torch.randperm(KEPT_VOCAB, generator=gen)[:4], targets[t : t + 1]]))
        kept[t, : len(ids)] = ids
    targets[1] = 5
    kept[1, :3] = torch.tensor([0, 5, 40])
    kept[2, 0] = targets[2]
    w = torch.randn(2, 8, generator=gen, dtype=torch.float64)
    return logits, targets, kept, w


def _run_kept(rank: int, tp: int, kernel: str):
    logits, targets, kept, w = _kept_inputs()
    shard = KEPT_PADDED // tp
    mine = logits[:, rank * shard : (rank + 1) * shard].clone().requires_grad_()
    lp, entropy = vocab_parallel_log_probs(mine, targets, temperature=KEPT_T, vocab_size=KEPT_VOCAB,
                                           kept_ids=kept, kernel=kernel, block_size=16)
    (w[0] * lp.double() + w[1] * entropy.double()).sum().backward()
    return lp.detach(), entropy.detach(), mine.grad


def _check_kept(outputs, grad):
    logits, targets, kept, w = _kept_inputs()
    full = logits.double().requires_grad_()
    lps, entropies = [], []
    for t in range(len(targets)):
        ids = kept[t][kept[t] >= 0]
        ids = torch.arange(KEPT_VOCAB) if len(ids) == 0 else ids
        log_q = torch.log_softmax(full[t, ids] / KEPT_T, dim=-1)
        lps.append(log_q[(ids == targets[t]).nonzero()[0, 0]])
        entropies.append(-(log_q.exp() * log_q).sum())
    lp, entropy = torch.stack(lps), torch.stack(entropies)
    (w[0] * lp + w[1] * entropy).sum().backward()
    torch.testing.assert_close(outputs[0].double(), lp.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(outputs[1].double(), entropy.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad.double(), full.grad, rtol=1e-5, atol=1e-6)


@_in_child
def test_tp1_kept_ids_match_truncated_reference():
    ours = _run_kept(0, 1, "triton")
    _check_kept(ours[:2], ours[2])
    _check_against_torch(ours, _run_kept(0, 1, "torch"), torch.float32, "kept")


# ---- dispatch, memory design and contract ----


def _backend(lp) -> str:
    """Which autograd Function produced ``lp`` (under the reshape to the leading shape)."""
    op = lp.grad_fn.next_functions[0][0]
    return "triton" if "Triton" in type(op).__name__ else "torch"


def _op_in_graph(out) -> str:
    """Which of the op's autograd Functions ``out`` was computed through, anywhere upstream
    (a packed micro-batch's scores are scattered back after the op)."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if "VocabParallelLogProbs" in name:
            return "triton" if "Triton" in name else "torch"
        todo.extend(n for n, _ in node.next_functions)
    raise AssertionError("the log-prob op is not in the graph")


@_in_child
def test_kernel_argument_picks_the_implementation():
    logits = torch.randn(4, 64, requires_grad=True)
    targets = torch.randint(0, 64, (4,))
    assert _backend(vocab_parallel_log_probs(logits, targets, kernel="triton")[0]) == "triton"
    assert _backend(vocab_parallel_log_probs(logits, targets, kernel="torch")[0]) == "torch"
    # the default is torch; auto: triton only for CUDA logits (CPU logits take the torch path
    # even under the interpreter)
    assert _backend(vocab_parallel_log_probs(logits, targets)[0]) == "torch"
    assert _backend(vocab_parallel_log_probs(logits, targets, kernel="auto")[0]) == "torch"
    with pytest.raises(ValueError, match="kernel must be one of auto, torch, triton"):
        vocab_parallel_log_probs(logits, targets, kernel="cuda")
    # the config's values are the op's
    assert typing.get_args(typing.get_type_hints(ModelConfig)["logprob_kernel"]) == KERNELS
    with pytest.raises(ValueError, match="block_size"):
        vocab_parallel_log_probs(logits, targets, kernel="triton", block_size=48)


@_in_child
def test_the_trainer_scores_with_the_configured_kernel():
    """model.logprob_kernel reaches the op through ScoringSpec (the trainer's one call of the
    op), for padded and for packed micro-batches."""
    mb = SimpleNamespace(seq_length=5, num_sequences=2, tokens=torch.randint(0, 60, (2, 5)), kept_ids=None)
    logits = torch.randn(2, 6, 64, requires_grad=True)
    packed = pack(mb.tokens, [5, 3])
    packed_logits = torch.randn(1, packed.num_tokens, 64, requires_grad=True)
    for kernel in ("torch", "triton"):
        spec = ScoringSpec(temperature=0.7, vocab_size=60, kernel=kernel)
        lp, _ = _token_scores(logits.clone(), mb, spec, with_entropy=False)
        assert lp.shape == (2, 4) and _backend(lp) == kernel
        lp, _ = _packed_token_scores(packed_logits.clone(), mb, packed, spec, with_entropy=False)
        assert lp.shape == (2, 4) and _op_in_graph(lp) == kernel


@_in_child
def test_triton_on_cpu_without_the_interpreter_is_refused():
    from megatron_grpo.ops import triton_logprobs

    logits, targets = torch.randn(4, 64), torch.randint(0, 64, (4,))
    triton_logprobs.INTERPRETED = False
    try:
        with pytest.raises(ValueError, match="kernel='triton' needs CUDA logits, got logits on cpu"):
            vocab_parallel_log_probs(logits, targets, kernel="triton")
    finally:
        triton_logprobs.INTERPRETED = True


@_in_child
def test_saved_state_is_the_logits_only_and_backward_runs_once():
    """Forward writes nothing logits-sized: autograd keeps the input logits (shared) and
    O(tokens) statistics; backward allocates the gradient (in place: none)."""
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(16, 200, dtype=dtype, requires_grad=True)
        targets = torch.randint(0, 190, (16,))
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, entropy = vocab_parallel_log_probs(logits, targets, vocab_size=190, kernel="triton", block_size=64)
        big = [t for t in saved if t.numel() >= logits.numel()]
        assert [t.data_ptr() for t in big] == [logits.data_ptr()]
        assert sum(t.numel() for t in saved if t.numel() < logits.numel()) <= 4 * 16
        (lp.sum() + entropy.sum()).backward(retain_graph=True)
        assert logits.grad.dtype == dtype
        with pytest.raises(RuntimeError, match="backward ran twice"):
            lp.sum().backward()


@_in_child
def test_inplace_writes_the_gradient_into_the_logits_storage():
    leaf = torch.randn(16, 100, requires_grad=True)
    x = leaf.clone()
    lp, entropy = vocab_parallel_log_probs(x, torch.randint(0, 90, (16,)), vocab_size=90, inplace=True,
                                           kernel="triton", block_size=32)
    (grad,) = torch.autograd.grad(lp.sum() + entropy.sum(), x)
    assert grad.data_ptr() == x.data_ptr()


# ---- the interpreter is lenient: the kernels must also pass Triton's compiler ----

_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_grpo.ops import triton_logprobs as k

assert not k.INTERPRETED
for dt in ("fp32", "bf16"):
    stats = {"logits_ptr": f"*{dt}", "row_stride": "i64", "local_target_ptr": "*i64", "stats_ptr": "*fp64",
             "num_rows": "i32", "num_valid": "i32", "inv_temperature": "fp32", "WITH_ENTROPY": "constexpr",
             "BLOCK": "constexpr"}
    grad = {"logits_ptr": f"*{dt}", "row_stride": "i64", "grad_ptr": f"*{dt}", "grad_row_stride": "i64",
            "local_target_ptr": "*i64", "max_ptr": "*fp32", "log_sum_ptr": "*fp32", "entropy_ptr": "*fp32",
            "coef_lp_ptr": "*fp32", "coef_h_ptr": "*fp32", "num_valid": "i32", "num_cols": "i32",
            "inv_temperature": "fp32", "HAS_LP": "constexpr", "HAS_H": "constexpr", "BLOCK": "constexpr"}
    sources = [ASTSource(k._stats_kernel, stats, {"WITH_ENTROPY": True, "BLOCK": k.MAX_BLOCK})]
    sources += [ASTSource(k._grad_kernel, grad, {"HAS_LP": lp, "HAS_H": h, "BLOCK": k.MAX_BLOCK})
                for lp, h in ((True, True), (True, False), (False, True))]
    for src in sources:
        assert "ptx" in triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": k.NUM_WARPS}).asm
print("compiled")
"""


def test_kernels_compile_for_a_cuda_target(tmp_path):
    """Triton's compiler (to PTX for sm_90, no GPU needed) accepts the kernels as the GPU runs
    them: the interpreter accepts code the compiler rejects (non-constexpr globals, loop
    variables changing type). In a subprocess: this process decorated them for the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile, do not reuse a cached binary
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
