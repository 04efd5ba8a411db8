"""Tensor layouts: how one Megatron parameter shard is made from Hugging Face tensors and back.

Every Megatron parameter is described by a ``Layout`` over an ordered tuple of HF tensors:

* ``to_shard(hf, tp_rank, tp)``: the full HF tensors -> this TP rank's Megatron shard;
* ``from_shards(shards)``: the Megatron shards of ALL TP ranks (ordered by rank) -> the full HF
  tensors, in the same order as the HF names.

The two are exact inverses (pure slicing and concatenation, no arithmetic), which is what
makes the HF -> Megatron -> HF round trip bitwise. ``replicated`` layouts have the same shard
on every TP rank, so callers skip the gather for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


class Layout:
    """Base: a parameter that is identical on all TP ranks and equal to one HF tensor."""

    replicated: bool = True

    def to_shard(self, hf: list[Tensor], tp_rank: int, tp: int) -> Tensor:
        (t,) = hf
        return t

    def from_shards(self, shards: list[Tensor]) -> list[Tensor]:
        return [shards[0].clone()]  # a copy: callers may keep it past the next optimizer step


@dataclass(frozen=True)
class Replicated(Layout):
    """Norm weights: one HF tensor, the same on every TP rank."""


@dataclass(frozen=True)
class TPSplit(Layout):
    """A plain tensor-parallel split along ``dim`` (0: column-parallel, 1: row-parallel)."""

    dim: int
    replicated = False

    def to_shard(self, hf, tp_rank, tp):
        (t,) = hf
        return _chunk(t, self.dim, tp, tp_rank)

    def from_shards(self, shards):
        return [torch.cat(shards, dim=self.dim)]


@dataclass(frozen=True)
class VocabSplit(Layout):
    """Word embeddings / output layer [V, H]: rows padded with zeros to ``padded_vocab_size``
    (a multiple of tp, see ``builder.padded_vocab_size``), then split by rows. The export
    drops the padding rows again."""

    vocab_size: int
    padded_vocab_size: int
    replicated = False

    def to_shard(self, hf, tp_rank, tp):
        (t,) = hf  # [V, H]
        _expect_rows(t, self.vocab_size, "vocabulary rows")
        padded = torch.zeros((self.padded_vocab_size,) + tuple(t.shape[1:]), dtype=t.dtype)
        padded[: self.vocab_size] = t
        return _chunk(padded, 0, tp, tp_rank)

    def from_shards(self, shards):
        parts, keep = [], self.vocab_size
        for s in shards:  # drop the padding rows before concatenating: no oversized copy
            parts.append(s[: max(0, min(s.shape[0], keep))])
            keep -= s.shape[0]
        return [torch.cat(parts, dim=0)]


@dataclass(frozen=True)
class GatedFC1(Layout):
    """SwiGLU ``linear_fc1``: HF (gate [F, H], up [F, H]) -> per TP rank [gate_r; up_r]
    ([2F/tp, H]), which is what megatron's gated MLP splits in two halves on each rank."""

    replicated = False

    def to_shard(self, hf, tp_rank, tp):
        gate, up = hf
        if gate.shape != up.shape:
            raise ValueError(f"gate {list(gate.shape)} and up {list(up.shape)} differ")
        return torch.cat([_chunk(gate, 0, tp, tp_rank), _chunk(up, 0, tp, tp_rank)], dim=0)

    def from_shards(self, shards):
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]


@dataclass(frozen=True)
class FusedQKV(Layout):
    """Megatron's fused ``linear_qkv`` (weight [(nq + 2 nkv) hd, H] or bias [(nq + 2 nkv) hd]).

    Rows are grouped by query group g = 0..nkv-1, each group being
    [q heads of g (nq/nkv * hd rows); k_g (hd rows); v_g (hd rows)]. Groups are contiguous, so
    the TP split is a plain row chunk (tp must divide nkv, which megatron requires).
    """

    num_heads: int
    num_query_groups: int
    head_dim: int
    replicated = False

    def to_shard(self, hf, tp_rank, tp):
        q, k, v = hf
        g, hd = self.num_query_groups, self.head_dim
        rest = tuple(q.shape[1:])  # (H,) for weights, () for biases
        _expect_rows(q, self.num_heads * hd, "q rows (num_attention_heads * head_dim)")
        _expect_rows(k, g * hd, "k rows (num_key_value_heads * head_dim)")
        _expect_rows(v, g * hd, "v rows (num_key_value_heads * head_dim)")
        fused = torch.cat(
            [q.reshape((g, -1) + rest), k.reshape((g, hd) + rest), v.reshape((g, hd) + rest)],
            dim=1,
        )  # [g, (nq/g + 2) hd, *rest]
        return _chunk(fused.reshape((-1,) + rest), 0, tp, tp_rank)

    def from_shards(self, shards):
        full = torch.cat(shards, dim=0)
        g, hd = self.num_query_groups, self.head_dim
        rest = tuple(full.shape[1:])
        q_rows = self.num_heads // g * hd
        grouped = full.reshape((g, q_rows + 2 * hd) + rest)
        q, k, v = grouped.split([q_rows, hd, hd], dim=1)
        # own, contiguous storage each (safetensors refuses tensors that share memory)
        return [t.reshape((-1,) + rest).clone(memory_format=torch.contiguous_format)
                for t in (q, k, v)]


def _chunk(t: Tensor, dim: int, tp: int, tp_rank: int) -> Tensor:
    if t.shape[dim] % tp != 0:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} is not divisible by tp={tp}")
    return t.chunk(tp, dim=dim)[tp_rank]


def _expect_rows(t: Tensor, rows: int, what: str) -> None:
    if t.shape[0] != rows:
        raise ValueError(f"expected {rows} {what}, got shape {list(t.shape)}")
