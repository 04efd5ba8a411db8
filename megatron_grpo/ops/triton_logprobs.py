"""Triton kernels for the per-rank part of ``vocab_parallel_log_probs`` (``kernel="triton"``).

Two kernels, one program per token row, each one pass over this rank's logits shard:

* ``local_stats``: online softmax statistics over the row's valid columns in blocks of
  ``block_size`` (running max ``m``; ``S = sum e``, ``D = sum e * z`` rescaled when a block raises
  the max; the target's ``z`` when on this rank): exactly the float64 ``[4, N]`` statistics of
  the torch path's ``_local_stats``, so the tensor-parallel combine is shared. Nothing
  logits-sized is written.
* ``logits_grad``: ``grad = a * onehot(t) - p * (a + b * (log p + H))``, ``a = g_lp / T``,
  ``b = g_H / T``, ``log p`` recomputed from the logits, written block by block (into the logits'
  own storage with ``inplace``: each element is read before it is overwritten). Padding columns
  get 0; without an entropy gradient ``b`` is compiled out.

Float32 arithmetic on float32/bf16/fp16 logits; ``S`` and ``D`` accumulated in float64 (``log S``
must stay accurate when ``S`` is close to 1). Shifted logits are floored at the torch path's
``-80`` before ``exp``, so a masked (``kept_ids``) column gives ``e * z = 0``, never ``0 * inf``.

``ops.vocab_parallel`` handles around them the ``kept_ids`` truncation (one masked copy of the
shard, then the kernels run in place on it) and non-contiguous rows (copied first). No fallback
to torch is taken silently: ``kernel="triton"`` always runs these kernels. On CPU tensors they
run only under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is imported
and while they run), which the exactness tests use; ``INTERPRETED`` says whether this process
decorated them for it. Tests and GPU figures: docs/vocab_parallel.md#the-triton-kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# The torch path's exp floor (ops.vocab_parallel._EXP_FLOOR); repeated here so this module
# stays a leaf (the torch path imports it lazily, triton being optional).
EXP_FLOOR = tl.constexpr(-80.0)

# Columns per block on a GPU: one row's block lives in registers (4096 float32 over 8 warps
# is 16 per thread); the vocabulary shard is walked in ceil(V_shard / block) steps.
MAX_BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _stats_kernel(
    logits_ptr, row_stride, local_target_ptr, stats_ptr, num_rows, num_valid, inv_temperature,
    WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    cols = tl.arange(0, BLOCK)
    m = -float("inf")  # running max, raw logit units (float32)
    s = tl.zeros((), dtype=tl.float64)
    d = tl.zeros((), dtype=tl.float64)
    for start in range(0, num_valid, BLOCK):
        idx = start + cols
        valid = idx < num_valid
        x = tl.load(row_ptr + idx, mask=valid, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        z = tl.maximum((x - m_new) * inv_temperature, EXP_FLOOR)
        e = tl.where(valid, tl.exp(z), 0.0)
        # Rescale what was summed relative to the old max (nothing before the first block:
        # delta 0 there keeps -inf * 0 out of D).
        delta = tl.where(m == -float("inf"), 0.0, (m - m_new) * inv_temperature).to(tl.float64)
        scale = tl.exp(delta)
        if WITH_ENTROPY:
            d = scale * (d + delta * s) + tl.sum((e * z).to(tl.float64), axis=0)
        s = s * scale + tl.sum(e.to(tl.float64), axis=0)
        m = m_new
    target = tl.load(local_target_ptr + row)
    owned = target >= 0
    x_t = tl.load(row_ptr + tl.maximum(target, 0)).to(tl.float32)
    t = tl.where(owned, (x_t - m) * inv_temperature, 0.0)
    tl.store(stats_ptr + row, m.to(tl.float64))
    tl.store(stats_ptr + num_rows + row, s)
    tl.store(stats_ptr + 2 * num_rows + row, d)
    tl.store(stats_ptr + 3 * num_rows + row, t.to(tl.float64))


@triton.jit
def _grad_kernel(
    logits_ptr, row_stride, grad_ptr, grad_row_stride, local_target_ptr, max_ptr, log_sum_ptr,
    entropy_ptr, coef_lp_ptr, coef_h_ptr, num_valid, num_cols, inv_temperature,
    HAS_LP: tl.constexpr, HAS_H: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    out_ptr = grad_ptr + row * grad_row_stride
    cols = tl.arange(0, BLOCK)
    max_logit = tl.load(max_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    target = tl.load(local_target_ptr + row)
    a = tl.load(coef_lp_ptr + row) if HAS_LP else 0.0
    if HAS_H:
        b = tl.load(coef_h_ptr + row)
        entropy = tl.load(entropy_ptr + row)
    for start in range(0, num_cols, BLOCK):
        idx = start + cols
        inside = idx < num_cols
        valid = idx < num_valid
        x = tl.load(row_ptr + idx, mask=valid, other=0.0).to(tl.float32)
        x = tl.where(valid, x, max_logit)  # no exp overflow on the masked lanes
        log_p = tl.maximum((x - max_logit) * inv_temperature, EXP_FLOOR) - log_sum
        p = tl.where(valid, tl.exp(log_p), 0.0)
        if HAS_H:
            g = -p * (a + b * (log_p + entropy))
        else:
            g = -p * a
        if HAS_LP:
            g = g + tl.where(idx == target, a, 0.0)
        tl.store(out_ptr + idx, g.to(grad_ptr.dtype.element_ty), mask=inside)


INTERPRETED = isinstance(_stats_kernel, InterpretedFunction)


def _block(num_cols: int, block_size: Optional[int]) -> int:
    if block_size is not None:
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of 2 >= 16, got {block_size}")
        return block_size
    return min(MAX_BLOCK, triton.next_power_of_2(max(num_cols, 16)))


def _launch_options() -> dict:
    return {} if INTERPRETED else {"num_warps": NUM_WARPS}


def local_stats(
    logits_2d: torch.Tensor, local_targets: torch.Tensor, num_valid: int, inv_temperature: float,
    with_entropy: bool, block_size: Optional[int] = None,
) -> torch.Tensor:
    """This rank's statistics relative to its own max, as ``ops.vocab_parallel._local_stats``.

    logits_2d: [N, V_shard] with unit column stride; local_targets: [N] int64, the target's
    column on this rank or -1 where another rank owns it. Returns float64 [4, N]: local max
    m_r (raw logit units; -inf on a rank holding only padding), S_r, D_r (0 without entropy)
    and z_target (0 where not owned)."""
    assert logits_2d.stride(-1) == 1
    num_rows, num_cols = logits_2d.shape
    stats = torch.empty(4, num_rows, dtype=torch.float64, device=logits_2d.device)
    if num_rows == 0:
        return stats
    _stats_kernel[(num_rows,)](
        logits_2d, logits_2d.stride(0), local_targets, stats, num_rows, num_valid, inv_temperature,
        WITH_ENTROPY=with_entropy, BLOCK=_block(num_cols, block_size), **_launch_options(),
    )
    return stats


def logits_grad(
    logits_2d: torch.Tensor, out: torch.Tensor, local_targets: torch.Tensor, max_logit: torch.Tensor,
    log_sum: torch.Tensor, entropy: torch.Tensor, coef_lp: Optional[torch.Tensor],
    coef_h: Optional[torch.Tensor], num_valid: int, inv_temperature: float,
    block_size: Optional[int] = None,
) -> torch.Tensor:
    """d(loss)/d(logits) [N, V_shard] written into ``out`` (may be ``logits_2d`` itself).

    max_logit, log_sum, entropy: float32 [N] global M, log S and H; coef_lp = g_lp / T and
    coef_h = g_H / T: float32 [N] or None (that output has no gradient)."""
    assert logits_2d.stride(-1) == 1 and out.stride(-1) == 1 and out.shape == logits_2d.shape
    num_rows, num_cols = logits_2d.shape
    if num_rows == 0:
        return out
    dummy = max_logit  # never read when its HAS_ flag is off
    _grad_kernel[(num_rows,)](
        logits_2d, logits_2d.stride(0), out, out.stride(0), local_targets, max_logit, log_sum,
        entropy if coef_h is not None else dummy, coef_lp if coef_lp is not None else dummy,
        coef_h if coef_h is not None else dummy, num_valid, num_cols, inv_temperature,
        HAS_LP=coef_lp is not None, HAS_H=coef_h is not None, BLOCK=_block(num_cols, block_size),
        **_launch_options(),
    )
    return out
