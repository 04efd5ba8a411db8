"""The running decode batch of the embedded engine: rows, their KV cache, and its reshaping.

A ``RunningBatch`` holds one row per sequence being decoded. The transformers ``DynamicCache``
stores keys/values as [B, heads, T, head_dim] per layer; rows of different lengths are
LEFT-padded to a common T, with ``mask_BT`` zero on the padding columns and explicit
position ids (``next_pos_B``, the count of real tokens), so every row attends exactly to its
own tokens at its own positions: its log-probs equal an unpadded forward to float rounding.

Three reshapes make continuous batching possible on a dense cache:

* ``select(rows)``: keep (or repeat) rows -- drop finished sequences, or replicate a shared
  prompt's prefill for the ``n`` samples of one request;
* ``merge(other)``: append the rows of a freshly prefilled batch, left-padding the shorter
  of the two caches with zero keys/values and mask zeros;
* ``compact()``: drop leading columns that are padding in every row (left after the long
  rows that needed them finished), so the attention width tracks the live rows.

Each reshape copies the whole cache once (index/cat over every layer); the scheduler in
``scheduler.py`` therefore drops and admits rows in bunches, not one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_grpo.inference.generation import Sequence


@dataclass(eq=False)
class RunningBatch:
    """Rows being decoded together.

    seqs: row i's sequence. cache: DynamicCache, [B, heads, T, head_dim] per layer.
    mask_BT: int64 [B, T], 1 where the cache column holds one of the row's tokens.
    next_pos_B: int64 [B], position id of the next token fed to each row.
    last_logits_BV: [B, V], the logits that predict each row's next token.
    """

    seqs: list[Sequence]
    cache: object
    mask_BT: torch.Tensor
    next_pos_B: torch.Tensor
    last_logits_BV: torch.Tensor

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_live(self) -> int:
        return sum(not s.finished for s in self.seqs)

    def select(self, rows: list[int]) -> None:
        """Keep rows ``rows`` in that order (an index may repeat: the row is copied)."""
        self.seqs = [self.seqs[i] for i in rows]
        self.select_rows(rows)

    def select_rows(self, rows: list[int]) -> None:
        """``select`` for the cache and tensors only (the caller sets ``seqs``)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask_BT.device)
        self.cache.batch_select_indices(index)
        self.mask_BT, self.next_pos_B = self.mask_BT[index], self.next_pos_B[index]
        self.last_logits_BV = self.last_logits_BV[index]

    def drop_finished(self) -> list[int]:
        """Keep the live rows; returns their former indices."""
        keep = [i for i, s in enumerate(self.seqs) if not s.finished]
        self.select(keep)
        self.compact()
        return keep

    def compact(self) -> None:
        """Drop the leading cache columns that no row uses."""
        used = self.mask_BT.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else self.mask_BT.shape[1]
        if first == 0:
            return
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
        self.mask_BT = self.mask_BT[:, first:]

    def merge(self, other: "RunningBatch") -> None:
        """Append ``other``'s rows (same model, same device); ``other`` is consumed."""
        width = max(self.mask_BT.shape[1], other.mask_BT.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(theirs.values, width)])
        self.mask_BT = torch.cat([_left_pad_mask(self.mask_BT, width), _left_pad_mask(other.mask_BT, width)])
        self.next_pos_B = torch.cat([self.next_pos_B, other.next_pos_B])
        self.last_logits_BV = torch.cat([self.last_logits_BV, other.last_logits_BV])
        self.seqs = self.seqs + other.seqs


def _left_pad(kv_BHTD: torch.Tensor, width: int) -> torch.Tensor:
    """Zero columns in front of the time axis: [B, H, T, D] -> [B, H, width, D]."""
    return F.pad(kv_BHTD, (0, 0, width - kv_BHTD.shape[2], 0))


def _left_pad_mask(mask_BT: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(mask_BT, (width - mask_BT.shape[1], 0))
