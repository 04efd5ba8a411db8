"""How a rank's rows are cut into micro-batches: a fixed row count, or a token budget.

Fixed (``parallel.max_tokens_per_microbatch: null``): consecutive groups of
``micro_batch_size`` rows, every one padded to the rollout batch's longest sequence S.

Token budget (``max_tokens_per_microbatch: M``; slime's ``--max-tokens-per-gpu`` idea by
sort-and-bucket padding): rows sorted longest first are packed greedily into micro-batches whose
PADDED size ``rows x longest row`` stays within M, each cut to its own longest row. A row longer
than M gets a micro-batch of its own (causal scoring needs the whole prefix). The plan depends on
the lengths only, so the TP and PP ranks of one pipeline build the same plan; DP ranks may get
different numbers of micro-batches, which the loss scaling in ``megatron_step`` allows.

The loss does not change: every denominator comes from the whole mini-batch, never from a
micro-batch's shape, and cut-off positions lie past every response token.

Packed (``parallel.pack_sequences`` with a budget, ``packed_plan``): first-fit decreasing by
SUMMED lengths; the forward concatenates each micro-batch's rows into one row (``models.packing``).
The micro-batch is still cut to its longest row (the loss reads [rows, L - 1]).
Shared prefix (``parallel.share_prefix``, ``shared_plan``): a group costs its prefix once plus
each row's own tokens, first-fit decreasing by that cost; a group over the budget is cut into
consecutive chunks that each pay the prefix again.
Why, and measurements: docs/throughput.md#token-budget-micro-batching.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_grpo.models.packing import Group, shared_prefix_groups
from megatron_grpo.rollout.batch import TrainBatch


@dataclass(frozen=True)
class MicroBatching:
    """How a rank's rows are cut into micro-batches, one value for every pass of a step
    (``parallel.micro_batch_size``, ``max_tokens_per_microbatch``, ``pack_sequences``)."""

    rows: int
    """Rows per micro-batch (without a budget)."""
    max_tokens: Optional[int] = None
    """The token budget (None: fixed rows)."""
    pack: bool = False
    """Each micro-batch's rows run as one packed row (``models.packing``)."""
    share: bool = False
    """Packed rows with the same prompt run it once (``models.packing``, shared prefix)."""

    @classmethod
    def of(cls, parallel) -> "MicroBatching":
        """From the config's ``parallel`` section."""
        return cls(parallel.micro_batch_size, parallel.max_tokens_per_microbatch, parallel.pack_sequences,
                   parallel.share_prefix)

    @classmethod
    def coerce(cls, batching: "MicroBatching | int") -> "MicroBatching":
        """A bare row count is fixed rows, unpacked (the tests' and benchmarks' short form)."""
        return batching if isinstance(batching, MicroBatching) else cls(int(batching))


@dataclass(frozen=True)
class MicroBatchPlan:
    """rows[k]: the batch rows (indices) of micro-batch k; lengths[k]: its sequence length
    (tokens per row, >= 2)."""

    rows: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]

    @property
    def num_padded_tokens(self) -> int:
        """Token slots the forward passes process (rows x length, summed)."""
        return sum(len(r) * n for r, n in zip(self.rows, self.lengths))


def sequence_lengths(batch: TrainBatch) -> torch.Tensor:
    """long[N]: tokens each row needs for its response to be scored: the last response token's
    position + 1 (shifted position t scores token t+1). A row without response tokens needs 2
    (it carries no loss; any cut of it is exact)."""
    t = torch.arange(batch.loss_mask.shape[1], device=batch.loss_mask.device)
    last = torch.where(batch.loss_mask > 0, t, torch.full_like(t, -1)).amax(dim=1)
    return (last + 2).clamp(min=2).cpu()


def prompt_lengths(loss_mask_BW: torch.Tensor) -> list[int]:
    """Each row's prompt length: the tokens before its first scored one (shifted position t
    scores token t + 1), 0 for a row that scores nothing. E.g. loss masks [[0, 1, 1], [0, 0, 0]]
    -> [2, 0]."""
    t = torch.arange(loss_mask_BW.shape[1], device=loss_mask_BW.device)
    first = torch.where(loss_mask_BW > 0, t, torch.full_like(t, loss_mask_BW.shape[1])).amin(dim=1)
    return [0 if f == loss_mask_BW.shape[1] else f + 1 for f in first.tolist()]


def fixed_plan(num_rows: int, seq_length: int, micro_batch_size: int) -> MicroBatchPlan:
    """Consecutive ``micro_batch_size`` rows, all at the batch's full ``seq_length``."""
    rows = tuple(tuple(range(s, min(s + micro_batch_size, num_rows))) for s in range(0, num_rows, micro_batch_size))
    return MicroBatchPlan(rows=rows, lengths=(seq_length,) * len(rows))


def token_budget_plan(lengths: list[int], max_tokens: int) -> MicroBatchPlan:
    """Sort-and-bucket: rows by decreasing length (ties by index, so the plan is
    deterministic), appended to the current micro-batch while ``(rows + 1) x its first
    (longest) row <= max_tokens``, else a new micro-batch starts.

    E.g. lengths [10, 3, 4, 9], max_tokens 20 -> rows ((0, 3), (2, 1)), lengths (10, 4)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows, out_len, current = [], [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > max_tokens:
            rows.append(tuple(current))
            out_len.append(lengths[current[0]])
            current = []
        current.append(i)
    if current:
        rows.append(tuple(current))
        out_len.append(lengths[current[0]])
    return MicroBatchPlan(rows=tuple(rows), lengths=tuple(out_len))


def packed_plan(lengths: list[int], max_tokens: int) -> MicroBatchPlan:
    """First-fit decreasing for packed rows: rows by decreasing length (ties by index), each
    into the first micro-batch whose summed lengths stay ``<= max_tokens``, else a new one (a
    row longer than the budget gets one of its own). Each micro-batch's length is its first
    (longest) row's.

    E.g. lengths [10, 3, 4, 9], max_tokens 20 -> rows ((0, 3), (2, 1)), lengths (10, 4)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    totals: list[int] = []
    for i in order:
        k = next((k for k, total in enumerate(totals) if total + lengths[i] <= max_tokens), len(rows))
        if k == len(rows):
            rows.append([])
            totals.append(0)
        rows[k].append(i)
        totals[k] += lengths[i]
    return MicroBatchPlan(rows=tuple(tuple(r) for r in rows), lengths=tuple(lengths[r[0]] for r in rows))


def shared_plan(groups: list[Group], lengths: list[int], max_tokens: int) -> MicroBatchPlan:
    """Packed micro-batches that keep each group of rows sharing a prefix together
    (``models.packing.shared_prefix_groups``: (rows, shared length)). A group costs shared +
    sum(length - shared) tokens; one over ``max_tokens`` is cut into consecutive chunks that fit
    (a row alone always does), each paying its prefix again; the chunks go first-fit decreasing
    by cost (ties by first row) into micro-batches of at most ``max_tokens``. Each micro-batch's
    length is its longest row's.

    E.g. groups [((0, 1), 3), ((2,), 0)], lengths [5, 4, 6], max_tokens 9 -> chunk (0, 1)
    costs 3 + 2 + 1 = 6, chunk (2,) 6: rows ((0, 1), (2,)), lengths (5, 6)."""
    chunks: list[tuple[int, list[int]]] = []  # (cost, rows)
    for rows, shared in groups:
        cost, current = 0, []
        for b in rows:
            extra = lengths[b] - shared + (0 if current else shared)
            if current and cost + extra > max_tokens:
                chunks.append((cost, current))
                cost, current, extra = 0, [], lengths[b]
            current.append(b)
            cost += extra
        chunks.append((cost, current))
    chunks.sort(key=lambda c: (-c[0], c[1][0]))
    rows_of: list[list[int]] = []
    totals: list[int] = []
    for cost, rows in chunks:
        k = next((k for k, total in enumerate(totals) if total + cost <= max_tokens), len(rows_of))
        if k == len(rows_of):
            rows_of.append([])
            totals.append(0)
        rows_of[k] += rows
        totals[k] += cost
    return MicroBatchPlan(rows=tuple(tuple(r) for r in rows_of),
                          lengths=tuple(max(lengths[b] for b in r) for r in rows_of))


def plan_micro_batches(batch: TrainBatch, micro_batch_size: int, max_tokens: Optional[int], packed: bool = False,
                       shared: bool = False) -> MicroBatchPlan:
    """The plan for ``batch``: fixed when ``max_tokens`` is None, else the token budget
    (``packed``: summed over packed rows, ``packed_plan``; ``shared``: groups sharing a prompt
    kept together, ``shared_plan``)."""
    if max_tokens is None:
        assert not packed, "packed micro-batches need a token budget"
        return fixed_plan(batch.num_sequences, batch.seq_length, micro_batch_size)
    lengths = sequence_lengths(batch).tolist()
    if shared:
        assert packed, "a shared prefix needs packed micro-batches"
        groups = shared_prefix_groups(batch.tokens, lengths, prompt_lengths(batch.loss_mask))
        return shared_plan(groups, lengths, max_tokens)
    return packed_plan(lengths, max_tokens) if packed else token_budget_plan(lengths, max_tokens)


def split(batch: TrainBatch, plan: MicroBatchPlan) -> list[TrainBatch]:
    """The micro-batches of ``plan``: micro-batch k holds ``plan.rows[k]``, cut to
    ``tokens[:, :L_k]`` and per-token fields ``[:, :L_k - 1]``. A fixed plan keeps the rows'
    contiguous slices (no copy)."""
    out = []
    for rows, length in zip(plan.rows, plan.lengths):
        contiguous = rows == tuple(range(rows[0], rows[0] + len(rows)))
        mb = batch.select(slice(rows[0], rows[0] + len(rows)) if contiguous else torch.tensor(rows))
        if length < mb.seq_length:
            mb = _cut(mb, length)
        out.append(mb)
    return out


def _cut(mb: TrainBatch, length: int) -> TrainBatch:
    cut = {}
    for name, t in mb.tensors().items():
        if t.dim() >= 2:  # per-token fields ([N, S] / [N, T] / routed_experts [N, T, L, k])
            cut[name] = t[:, :length] if name == "tokens" else t[:, : length - 1]
        else:
            cut[name] = t
    return TrainBatch(**cut)


def unsplit(parts_BT: list[torch.Tensor], plan: MicroBatchPlan, num_rows: int, width: int) -> torch.Tensor:
    """Per-micro-batch per-token outputs (part k: [len(rows[k]), L_k - 1]) -> [num_rows, width]
    in the batch's row order; positions a micro-batch was cut at are 0 (finite, never scored)."""
    first = parts_BT[0]
    out = torch.zeros(num_rows, width, dtype=first.dtype, device=first.device)
    for part, rows in zip(parts_BT, plan.rows):
        index = torch.tensor(rows, device=first.device)
        out[index, : part.shape[1]] = part
    return out
