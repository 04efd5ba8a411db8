"""Context parallelism (``parallel.cp``): each sequence split over the cp ranks of a CP group.

Layout (megatron-core's load-balanced causal layout): a sequence is right-padded to a multiple
of 2 x cp tokens and cut into 2 x cp equal chunks; CP rank r keeps chunks r and 2cp-1-r, in
that order, so every rank holds as much early (cheap) as late (expensive) causal work. Packed
rows (``models.packing``) are split segment by segment the same way, each segment padded to a
multiple of 2 x cp (megatron's ``cu_seqlens_q_padded``). Padding sits at the end of its
sequence, so causal attention hides it from every real position, and it is never scored.

What runs where:
* the decoder runs on the rank's tokens only; RoPE gives them their true positions (megatron's
  own CP RoPE, fed the whole padded length); attention is exact over the whole sequence:
  ``sdpa_context_parallel`` all-gathers keys and values over the CP group (the all-gather form
  of CP: simple and exact, K/V memory O(sequence) per rank; the backward reduce-scatters dK/dV)
  and masks by the tokens' true positions;
* the output layer and the log-softmax run on the rank's scored positions only;
* the per-token log-probs and entropies, [B, T] with zeros where another rank scores, are summed
  over the CP group (``cp_sum``: all-reduce forward, identity backward), so every CP rank
  computes the very loss, metrics and sequence-level quantities CP1 computes. Each rank's
  gradient is that of the whole loss through its own tokens; DDP's 1/(dp x cp) is undone by
  megatron's schedule (x cp) and the trainer's loss scale (x micro-batches x dp).

Departure from megatron-core's TransformerEngine CP (ring attention, ``cp_comm_type: p2p``):
the keys and values are gathered whole instead of passed round a ring, so K/V memory is not
divided by cp (the rest is). More: docs/models.md#context-parallelism-parallelcp.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from megatron_grpo.models.packing import PackedRows


def padded_to(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``. E.g. (5, 4) -> 8, (8, 4) -> 8."""
    return -(-length // multiple) * multiple


@dataclass(frozen=True)
class Chunk:
    """One chunk a rank holds: its segment starts at ``segment_start`` of the whole layout, the
    chunk at ``start`` (both global indices), ``length`` tokens; ``local_start``: where it lies
    in the rank's local layout."""

    segment_start: int
    start: int
    length: int
    local_start: int


def rank_chunks(segment_lengths: list[int], cp: int, rank: int) -> list[Chunk]:
    """The chunks CP rank ``rank`` holds of segments of ``segment_lengths`` (each a multiple of
    2 x cp, laid end to end), in local order: per segment, chunk ``rank`` then chunk
    ``2cp-1-rank``. E.g. ([8], cp 2, rank 1) -> chunks [2, 4) and [4, 6) of the one segment."""
    chunks, offset, local = [], 0, 0
    for length in segment_lengths:
        assert length % (2 * cp) == 0, (length, cp)
        size = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            chunks.append(Chunk(offset, offset + c * size, size, local))
            local += size
        offset += length
    return chunks


def local_index(segment_lengths: list[int], cp: int, rank: int) -> Tensor:
    """long [sum(lengths) / cp]: the global index of each of rank ``rank``'s tokens, in local
    order. E.g. ([8], 2, 0) -> (0, 1, 6, 7); ([8], 2, 1) -> (2, 3, 4, 5)."""
    parts = [torch.arange(c.start, c.start + c.length) for c in rank_chunks(segment_lengths, cp, rank)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def cp_group_info(group=None) -> tuple[int, int, Optional[object]]:
    """(cp size, this rank's CP rank, the CP group) from megatron's parallel state; (1, 0, None)
    without it or at cp 1."""
    from megatron.core import parallel_state as ps

    if group is None:
        if not ps.model_parallel_is_initialized():
            return 1, 0, None
        group = ps.get_context_parallel_group(check_initialized=False)
    if group is None or dist.get_world_size(group) == 1:
        return 1, 0, None
    return dist.get_world_size(group), dist.get_rank(group), group


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (rank-major) forward; the backward sums every rank's
    gradient of this rank's slice (a reduce-scatter; gloo has none, so an all-reduce and a
    slice there)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        if dist.get_backend(group) == "nccl":
            dist.all_gather_into_tensor(out, x, group=group)
        else:
            dist.all_gather(list(out.chunk(world)), x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            mine = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
            dist.reduce_scatter_tensor(mine, grad, group=group)
            return mine, None
        total = grad.clone()
        dist.all_reduce(total, group=group)
        return total.chunk(world)[rank].contiguous(), None


class _SumIdentityBackward(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: every rank then computes the same loss from
    the sum, so the gradient each rank needs for its own summand is the loss's, unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def cp_sum(x: Tensor, group) -> Tensor:
    """``x`` summed over the CP group (differentiable: identity backward; see ``_SumIdentityBackward``).
    No-op without a group."""
    return x if group is None else _SumIdentityBackward.apply(x, group)


def gather_whole(x_local: Tensor, segment_lengths: list[int], group) -> Tensor:
    """The whole layout [sum(lengths), ...] from every CP rank's local tokens ``x_local``
    [sum(lengths) / cp, ...] (dim 0 is the sequence; differentiable, see ``_GatherSequence``)."""
    gathered = _GatherSequence.apply(x_local, group)  # [cp * local, ...], rank-major
    order = _whole_order(tuple(segment_lengths), dist.get_world_size(group), str(x_local.device))
    return gathered.index_select(0, order)


@functools.lru_cache(maxsize=2)
def _whole_order(segment_lengths: tuple[int, ...], cp: int, device: str) -> Tensor:
    """long [sum(lengths)]: where each global index sits in the rank-major gather of every
    rank's local tokens; built once per layout, not twice per layer (keys and values)."""
    held = torch.cat([local_index(list(segment_lengths), cp, r) for r in range(cp)])
    return torch.argsort(held).to(device)


def cp_attention_mask(segment_lengths: list[int], query_index: Tensor) -> Tensor:
    """bool [q, total]: True where the local query at global index ``query_index[i]`` may attend
    to key j: same segment and j <= the query's index (causal over the whole sequence)."""
    ends = torch.tensor(segment_lengths, device=query_index.device).cumsum(0)
    keys = torch.arange(sum(segment_lengths), device=query_index.device)

    def segment_of(index: Tensor) -> Tensor:
        return torch.searchsorted(ends, index, right=True)

    same = segment_of(query_index).unsqueeze(1) == segment_of(keys).unsqueeze(0)
    return same & (keys.unsqueeze(0) <= query_index.unsqueeze(1))


@functools.lru_cache(maxsize=2)
def _layout_mask(segment_lengths: tuple[int, ...], cp: int, rank: int, device: str) -> Tensor:
    """``cp_attention_mask`` of a layout, built once for every layer of a forward (and its
    backward), not once per layer: each layer keeps it for its backward."""
    return cp_attention_mask(list(segment_lengths), local_index(list(segment_lengths), cp, rank).to(device))


_QUERY_BLOCK = 256
"""Queries per SDPA call of ``_BlockedMaskedSDPA``: the math kernel's [heads, block, keys] weights
are the transient memory (e.g. 9 heads x 256 x 8192 keys x 4 bytes = 75 MB)."""


class _BlockedMaskedSDPA(torch.autograd.Function):
    """SDPA with a boolean mask, ``_QUERY_BLOCK`` queries at a time, whose backward recomputes
    each block's forward. A mask sends CPU SDPA to its math kernel, which materialises the
    [heads, q, k] attention weights and keeps them for the backward: quadratic, at 8k tokens more
    than a whole CP1 layer (whose causal call runs the flash kernel). Here a layer keeps only q,
    k, v and the mask, and the weights exist for one block at a time.
    q [b, np, q, hn], k/v [b, ng, k, hn], mask bool [q, k] -> [b, np, q, hn]."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, gqa: bool) -> Tensor:
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale, ctx.gqa = scale, gqa
        return torch.cat([F.scaled_dot_product_attention(q[:, :, a:a + _QUERY_BLOCK], k, v, attn_mask=mask[a:a + _QUERY_BLOCK],
                                                         scale=scale, enable_gqa=gqa)
                          for a in range(0, q.shape[2], _QUERY_BLOCK)], dim=2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, mask = ctx.saved_tensors
        k, v = k.detach().requires_grad_(), v.detach().requires_grad_()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a in range(0, q.shape[2], _QUERY_BLOCK):
            block = q[:, :, a:a + _QUERY_BLOCK].detach().requires_grad_()
            with torch.enable_grad():
                out = F.scaled_dot_product_attention(block, k, v, attn_mask=mask[a:a + _QUERY_BLOCK], scale=ctx.scale,
                                                     enable_gqa=ctx.gqa)
            dq_block, dk_block, dv_block = torch.autograd.grad(out, (block, k, v), grad[:, :, a:a + _QUERY_BLOCK])
            dq[:, :, a:a + _QUERY_BLOCK] = dq_block
            dk += dk_block
            dv += dv_block
        return dq, dk, dv, None, None, None


def sdpa_context_parallel(q: Tensor, k_whole: Tensor, v_whole: Tensor, segment_lengths: list[int], cp: int,
                          rank: int, scale: float, gqa: bool, per_chunk: bool) -> Tensor:
    """Exact causal attention of a rank's query chunks against the whole sequences' keys/values.

    q [b, np, q_local, hn] (the rank's tokens, local order), k/v [b, ng, total, hn] (global
    order, ``gather_whole``) -> [b, np, q_local, hn]. per_chunk False: one SDPA call with the
    [q_local, total] mask a query block at a time (``cp_attention_mask``, ``_BlockedMaskedSDPA``:
    the CPU path); True: one call per chunk against
    its segment's keys up to the chunk's end, bottom-right causal (flash-capable: the CUDA
    path). Both compute the same function."""
    if not per_chunk:
        mask = _layout_mask(tuple(segment_lengths), cp, rank, str(q.device))
        return _BlockedMaskedSDPA.apply(q, k_whole, v_whole, mask, scale, gqa)
    from torch.nn.attention.bias import causal_lower_right

    outs = []
    for c in rank_chunks(segment_lengths, cp, rank):
        end = c.start + c.length
        keys = slice(c.segment_start, end)
        bias = causal_lower_right(c.length, end - c.segment_start)
        outs.append(F.scaled_dot_product_attention(
            q[:, :, c.local_start:c.local_start + c.length], k_whole[:, :, keys], v_whole[:, :, keys],
            attn_mask=bias, scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


def local_of_global(segment_lengths: list[int], cp: int, rank: int) -> Tensor:
    """long [sum(lengths)]: each global index's position in rank ``rank``'s local layout, -1 where
    another rank holds it. E.g. ([8], 2, 1) -> (-1, -1, 0, 1, 2, 3, -1, -1)."""
    index = local_index(segment_lengths, cp, rank)
    out = torch.full((sum(segment_lengths),), -1, dtype=torch.long)
    out[index] = torch.arange(index.numel())
    return out


def split_packed(packed: PackedRows, cp: int, rank: int) -> PackedRows:
    """Rank ``rank``'s share of ``packed`` (``models.packing.pack`` of rows padded to multiples of
    2 x cp, so every segment is): its tokens, position ids and branches in local order; the
    segment boundaries ``cu_seqlens`` stay the whole layout's (megatron's padded ``cu_seqlens``,
    which its CP RoPE and ``sdpa_context_parallel`` read), as do ``where`` and ``lengths``."""
    lengths = (packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]).tolist()
    assert all(n % (2 * cp) == 0 for n in lengths), (lengths, cp)
    index = local_index(lengths, cp, rank).to(packed.tokens.device)
    return dataclasses.replace(packed, tokens=packed.tokens.index_select(1, index),
                               position_ids=packed.position_ids.index_select(1, index),
                               branch=packed.branch.index_select(0, index))
