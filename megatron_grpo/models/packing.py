"""Packed sequences: a micro-batch's rows concatenated into one row without padding.

Layout (megatron's ``thd``): rows of lengths l_0 .. l_{n-1} become one row of T = sum(l_r)
tokens, row r at ``[cu_seqlens[r], cu_seqlens[r + 1])``. Position ids restart at 0 in each row
(megatron's thd RoPE reads ``cu_seqlens`` to restart the rotary phases; the ids are passed
too, for learned position embeddings); the core attention keeps each query inside its row
(``models.attention.SDPAttention``). So every row sees exactly what it sees alone.

Scoring: packed position p of row r at offset j scores the row's token j + 1, which is the
packed token p + 1 while j + 1 < l_r; the last position of each row scores nothing.
``next_tokens`` / ``scored`` give those targets and positions, ``unpack`` scatters per-token
values back to the [B, W] layout of ``rollout.batch`` (W = S - 1 for scores), so no padded
[B, S, V] logits are ever materialised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRows:
    """tokens / position_ids: long[1, T]; cu_seqlens: int32[n + 1] (0, l_0, l_0 + l_1, .., T);
    row / position: long[T], the source row of each packed token and its position there
    (the index to unpack); max_seqlen: max(l_r)."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    row: torch.Tensor
    position: torch.Tensor
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]


def pack(tokens_BS: torch.Tensor, lengths: list[int]) -> PackedRows:
    """Rows ``tokens_BS[r, :lengths[r]]`` (1 <= lengths[r] <= S) concatenated into [1, T].

    E.g. tokens [[5, 6, 7], [8, 0, 0]], lengths [3, 1] -> tokens [[5, 6, 7, 8]], position_ids
    [[0, 1, 2, 0]], cu_seqlens (0, 3, 4), row (0, 0, 0, 1), position (0, 1, 2, 0)."""
    assert len(lengths) == tokens_BS.shape[0] and all(1 <= n <= tokens_BS.shape[1] for n in lengths), lengths
    device = tokens_BS.device
    counts = torch.tensor(lengths, device=device)
    row = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)  # [T]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(counts, 0)
    position = torch.arange(row.shape[0], device=device) - cu[:-1].long()[row]  # [T]
    return PackedRows(tokens=tokens_BS[row, position].unsqueeze(0), position_ids=position.unsqueeze(0),
                      cu_seqlens=cu, row=row, position=position, max_seqlen=max(lengths))


def next_tokens(packed: PackedRows) -> torch.Tensor:
    """long[1, T]: the token each packed position scores (the packed token after it; the last
    position of each row gets an arbitrary in-vocabulary id, never ``scored``)."""
    return torch.roll(packed.tokens, -1, dims=1)


def scored(packed: PackedRows) -> torch.Tensor:
    """bool[T]: positions that score a token of their own row (all but each row's last)."""
    last = packed.cu_seqlens[1:].long() - 1
    keep = torch.ones(packed.num_tokens, dtype=torch.bool, device=packed.tokens.device)
    keep[last] = False
    return keep


def unpack(values_T: torch.Tensor, packed: PackedRows, num_rows: int, width: int) -> torch.Tensor:
    """Per-token values [T, ...] of the ``scored`` positions -> [num_rows, width, ...], 0 at
    every position no packed position fills (each row's tail). width >= max(l_r) - 1."""
    keep = scored(packed)
    out = values_T.new_zeros((num_rows, width, *values_T.shape[1:]))
    out[packed.row[keep], packed.position[keep]] = values_T[keep]
    return out


def gather_rows(values_BW: torch.Tensor, packed: PackedRows, fill) -> torch.Tensor:
    """The inverse direction for per-token inputs: [B, W, ...] -> [1, T, ...], the value at
    (row, position) for ``scored`` positions and ``fill`` elsewhere (e.g. the sampling-mask
    replay's kept ids, -1 = unrestricted)."""
    keep = scored(packed)
    width = values_BW.shape[1]
    out = values_BW[packed.row, packed.position.clamp(max=width - 1)]
    out[~keep] = fill
    return out.unsqueeze(0)


def packed_seq_params(packed: PackedRows):
    """megatron-core's ``PackedSeqParams`` (thd, self-attention: q and kv share boundaries)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_kv=packed.cu_seqlens,
                           max_seqlen_q=packed.max_seqlen, max_seqlen_kv=packed.max_seqlen)
