"""Loss reductions: per-token losses ``float[B, T]`` -> one scalar (docs/loss_spec.md#reductions), keyed by
``algorithm.loss_reduction``.

Every reduction divides by a GLOBAL denominator handed in by the caller, never by a count
of the tensor in hand. That is what makes the loss additive over parts: the trainer calls
the loss once per micro-batch (and per DP rank) with the denominators of the whole
mini-batch and sums the results, which equals one call on the whole mini-batch -- for the
value and the gradient -- whatever the micro-batch split, DP size, TP or PP.

* ``token_mean``:              sum_{i,t} m l / N
* ``seq_mean_token_mean``:     (1/S) sum_i (sum_t m l) / max(L_i, 1)
* ``seq_mean_token_sum``:      (1/S) sum_i sum_t m l
* ``seq_mean_token_sum_norm``: (1/S) sum_i sum_t m l / H        (Dr.GRPO, H = max_response_length)

N = valid tokens of the mini-batch BEFORE off-policy masking (so tokens dropped by the
off-policy masks leave the numerator only, skyrl 0.4.0 / verl; SkyRL PR #849 renormalises
per micro-batch after masking). S = sequences of the mini-batch INCLUDING empty rows
(SkyRL, TRL; verl counts non-empty rows). L_i = valid tokens of sequence i before
off-policy masking: a sequence is never split across parts, so L_i is always local. Since
every off-policy mask in this package drops whole sequences, using L_i before or after the
masks gives the same value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_grpo.losses.common import masked_sum
from megatron_grpo.losses.registry import Registry


@dataclass(frozen=True)
class Denominators:
    """Global normalisers of one loss call (0-d tensors, already clamped to >= 1)."""

    num_tokens: torch.Tensor
    """N: valid tokens of the whole mini-batch (all micro-batches, all DP ranks), before
    off-policy masking."""

    num_sequences: torch.Tensor
    """S: sequences of the whole mini-batch, empty rows included."""

    seq_lengths: torch.Tensor
    """L_i: ``float[B]`` valid tokens of each local sequence before off-policy masking."""

    horizon: Optional[int]
    """H: the Dr.GRPO constant (algorithm.max_response_length)."""


ReductionFn = Callable[[torch.Tensor, torch.Tensor, Denominators], torch.Tensor]
"""(loss ``float[B, T]``, keep ``bool[B, T]``, denominators) -> scalar."""

REDUCTIONS: Registry[ReductionFn] = Registry("loss reduction")


@REDUCTIONS.register("token_mean")
def token_mean(loss_BT: torch.Tensor, keep_BT: torch.Tensor, den: Denominators) -> torch.Tensor:
    """sum m l / N."""
    return masked_sum(loss_BT, keep_BT) / den.num_tokens


@REDUCTIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(loss_BT: torch.Tensor, keep_BT: torch.Tensor, den: Denominators) -> torch.Tensor:
    """(1/S) sum_i sum_t m l / max(L_i, 1)."""
    per_seq = masked_sum(loss_BT, keep_BT, dim=-1) / den.seq_lengths.clamp(min=1)
    return per_seq.sum() / den.num_sequences


@REDUCTIONS.register("seq_mean_token_sum")
def seq_mean_token_sum(loss_BT: torch.Tensor, keep_BT: torch.Tensor, den: Denominators) -> torch.Tensor:
    """(1/S) sum_i sum_t m l."""
    return masked_sum(loss_BT, keep_BT) / den.num_sequences


@REDUCTIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(loss_BT: torch.Tensor, keep_BT: torch.Tensor, den: Denominators) -> torch.Tensor:
    """(1/S) sum_i sum_t m l / H (Dr.GRPO: a constant horizon removes the length bias)."""
    if den.horizon is None:
        raise ValueError("seq_mean_token_sum_norm needs algorithm.max_response_length (the horizon H)")
    return masked_sum(loss_BT, keep_BT) / (den.num_sequences * den.horizon)
