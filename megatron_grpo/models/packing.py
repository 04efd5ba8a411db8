"""Packed sequences: a micro-batch's rows concatenated into one row without padding, optionally
with each shared prompt run once (the shared-prefix forward).

Layout (megatron's ``thd``): the rows are laid out one segment after another, segment s at
``[cu_seqlens[s], cu_seqlens[s + 1])``. Without sharing a segment is one row; position ids
restart at 0 in each row and the core attention keeps each query inside its segment
(``models.attention.SDPAttention``), so every row sees exactly what it sees alone.

Shared prefix (``parallel.share_prefix``; Prefix Grouper, Liu et al. 2025, arXiv 2506.05433):
rows with the same prompt form one segment: their longest common prefix once, then each row's
own tokens (its *branch*), with the position ids each token has in its own row. A query sees a
key of its segment iff the key's position is not after its own and the key is in the prefix
(branch 0) or its own branch, so every row's tokens see exactly what they see alone; RoPE reads
the position ids (``models.forward``), the attention the branches.

Scoring by pairs: row b's shifted position t scores its token t + 1 from the output at the
packed index ``where[b, t]`` of its token t. With a shared prefix several rows read one index
(the prefix's last token scores every row's first response token); the output layer picks
those indices with repeats (``models.forward``) and each pair gets its own log-prob, so each
row's loss and advantage stay its own and the shared positions' gradient is the sum over the
rows, which is what the G separate forwards give. No [B, S, V] logits are ever padded out.

Departure from Prefix Grouper: it splits attention into a prefix pass and a suffix pass over
a padded [groups, ...] layout; here one packed row and one mask (a per-segment mask on CUDA)
carry both, so the rest of the packed path (token budget, pipeline shapes) is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class PackedRows:
    """tokens / position_ids: long[1, T]; cu_seqlens: int32[segments + 1]; branch: long[T]
    (0: seen by every row of its segment (a shared prefix, or a row packed alone); k > 0: one
    row's own tokens); where: long[B, S], the packed index of row b's token t (-1 past the
    row); lengths: each row's length; segment_shared: per segment, whether several rows share
    it (its branches are not all 0); max_seqlen: 1 + the largest position id."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    branch: torch.Tensor
    where: torch.Tensor
    lengths: tuple[int, ...]
    segment_shared: tuple[bool, ...]
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]


@dataclass(frozen=True)
class Pairs:
    """Row ``rows[i]``'s shifted position ``cols[i]`` is scored from the packed output at
    ``index[i]`` (long [R] each; ``index`` repeats where rows share a prefix)."""

    rows: torch.Tensor
    cols: torch.Tensor
    index: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.index.numel())


Group = tuple[tuple[int, ...], int]
"""(rows, shared length): rows packed as one segment whose first ``shared`` tokens are common."""


def shared_prefix_groups(tokens_BS: torch.Tensor, lengths: list[int], prompt_lengths: list[int]) -> list[Group]:
    """Rows with the same prompt (``tokens_BS[b, :prompt_lengths[b]]``, a prompt length of 0:
    the row shares nothing), in order of first appearance, each group with the longest prefix
    common to its rows (at least the prompt; capped at the shortest row). A row alone: shared 0.

    E.g. rows [1, 2, 3, 4], [1, 2, 3, 5], [1, 9, 9], lengths [4, 4, 3], prompts [2, 2, 2] ->
    [((0, 1), 3), ((2,), 0)]."""
    tokens_BS = tokens_BS.cpu()  # one device read, not one per row
    keyed: dict = {}
    for b, (n, p) in enumerate(zip(lengths, prompt_lengths)):
        key = (p, tuple(tokens_BS[b, :p].tolist())) if 0 < p <= n else ("alone", b)
        keyed.setdefault(key, []).append(b)
    groups = []
    for rows in keyed.values():
        if len(rows) == 1:
            groups.append(((rows[0],), 0))
            continue
        shortest = min(lengths[b] for b in rows)
        block = tokens_BS[list(rows), :shortest]
        differs = (block != block[:1]).any(dim=0).nonzero()
        groups.append((tuple(rows), int(differs[0]) if differs.numel() else shortest))
    return groups


def pack(tokens_BS: torch.Tensor, lengths: list[int], groups: Optional[list[Group]] = None) -> PackedRows:
    """Rows ``tokens_BS[b, :lengths[b]]`` (1 <= lengths[b] <= S) packed into [1, T]: one segment
    per row, or per group of ``groups`` (``shared_prefix_groups``: each row in exactly one).

    E.g. tokens [[5, 6, 7], [8, 0, 0]], lengths [3, 1] -> tokens [[5, 6, 7, 8]], position_ids
    [[0, 1, 2, 0]], cu_seqlens (0, 3, 4), branch all 0, where [[0, 1, 2], [3, -1, -1]]. With
    groups [((0, 1), 1)] on tokens [[5, 6, 7], [5, 8, 0]], lengths [3, 2] -> tokens
    [[5, 6, 7, 8]], position_ids [[0, 1, 2, 1]], cu_seqlens (0, 4), branch (0, 1, 1, 2),
    where [[0, 1, 2], [0, 3, -1]]."""
    num_rows, width = tokens_BS.shape
    assert len(lengths) == num_rows and all(1 <= n <= width for n in lengths), lengths
    if groups is None:
        groups = [((b,), 0) for b in range(num_rows)]
    assert sorted(b for rows, _ in groups for b in rows) == list(range(num_rows)), groups
    rows_of, cols_of, branches, bounds = [], [], [], [0]
    for rows, shared in groups:
        # the shared prefix read from the group's first row, then each row's own tokens
        rows_of += [rows[0]] * shared
        cols_of += range(shared)
        branches += [0] * shared
        for k, b in enumerate(rows):
            own = lengths[b] - shared
            rows_of += [b] * own
            cols_of += range(shared, lengths[b])
            branches += [k + 1 if len(rows) > 1 else 0] * own
        bounds.append(len(rows_of))
    device = tokens_BS.device
    row = torch.tensor(rows_of, device=device)
    col = torch.tensor(cols_of, device=device)
    where = torch.full((num_rows, width), -1, dtype=torch.long, device=device)
    where[row, col] = torch.arange(row.numel(), device=device)
    for rows, shared in groups:  # the other rows of a group read the prefix at the first row's indices
        # (a copy: when the group's rows are identical and the longest, the source row is the
        # whole written-to block's memory neighbour and torch refuses the overlapping write)
        where[list(rows[1:]), :shared] = where[rows[0], :shared].clone()
    return PackedRows(tokens=tokens_BS[row, col].unsqueeze(0), position_ids=col.unsqueeze(0),
                      cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device),
                      branch=torch.tensor(branches, device=device), where=where, lengths=tuple(lengths),
                      segment_shared=tuple(len(rows) > 1 for rows, _ in groups), max_seqlen=max(lengths))


def pairs(packed: PackedRows, mask_BW: Optional[torch.Tensor] = None) -> Pairs:
    """The (row, shifted position) pairs to score: every position before each row's last token
    (t < lengths[b] - 1), or with ``mask_BW`` ([B, W], W >= max length - 1) those where it is
    non-zero. E.g. lengths (3, 1) -> rows (0, 0), cols (0, 1)."""
    width = packed.where.shape[1] - 1
    t = torch.arange(width, device=packed.where.device)
    keep = t.unsqueeze(0) < torch.tensor(packed.lengths, device=t.device).unsqueeze(1) - 1  # [B, W]
    if mask_BW is not None:
        keep = keep & mask_BW[:, :width].ne(0)
    rows, cols = keep.nonzero(as_tuple=True)
    return Pairs(rows=rows, cols=cols, index=packed.where[rows, cols])


def packed_seq_params(packed: PackedRows):
    """megatron-core's ``PackedSeqParams`` (thd, self-attention: q and kv share boundaries),
    carrying the position ids and branches the shared-prefix mask needs
    (``models.attention.BranchedSeqParams``)."""
    from megatron_grpo.models.attention import BranchedSeqParams  # imports megatron-core: deferred like it

    # the padded boundaries equal the real ones: a row's CP padding is part of its segment
    # (megatron's CP RoPE and TransformerEngine's CP attention read the padded ones)
    return BranchedSeqParams(qkv_format="thd", cu_seqlens_q=packed.cu_seqlens, cu_seqlens_kv=packed.cu_seqlens,
                             cu_seqlens_q_padded=packed.cu_seqlens, cu_seqlens_kv_padded=packed.cu_seqlens,
                             max_seqlen_q=packed.max_seqlen, max_seqlen_kv=packed.max_seqlen,
                             position=packed.position_ids[0], branch=packed.branch,
                             segment_shared=packed.segment_shared)
