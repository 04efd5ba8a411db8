"""Reducing loss metrics over micro-batches and data-parallel ranks.

``compute_policy_loss`` returns LOCAL metrics: token-denominated ones averaged over the
call's valid tokens, sequence-denominated ones over the call's rows, plus the counts
``num_valid_tokens`` and ``num_sequences``. ``reduce_metrics`` pools any number of such
dicts -- the micro-batches of one rank, then (``group=``) the ranks of a process group -- so
that the result equals the metric of the whole mini-batch computed at once:

* ``num_*``                        -> sum
* ``*_max`` / ``*_min``            -> max / min over parts that hold at least one valid token
* ``*_std`` with a ``*_mean`` twin -> pooled population std (from E[x^2] = std^2 + mean^2)
* ``SEQUENCE_WEIGHTED`` keys       -> mean weighted by ``num_sequences``
* every other key                  -> mean weighted by the valid-token count

A part is either a dict carrying ``num_valid_tokens`` (as ``compute_policy_loss`` returns)
or a ``(dict, num_valid_tokens)`` pair for any other metric dict. The pooled dict carries
the summed counts, so pooling is hierarchical: reduce the micro-batches locally, then
reduce that dict across ranks. Every rank must hold the same keys (checked with no extra
collective: a checksum of the key names rides along the MAX all-reduce).
"""

from __future__ import annotations

import math
import zlib
from typing import Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from megatron_grpo.runtime.device import collective_device

SEQUENCE_WEIGHTED = frozenset(
    {
        "kl_loss",
        "outlier_seq_masked_ratio",
        "outlier_seq_over_high_ratio",
        "outlier_seq_under_low_ratio",
        "tis_seq_clip_high_ratio",
        "geo_sequence_mask_masked_ratio",
        "geo_sequence_mask_over_high_ratio",
        "geo_sequence_mask_under_low_ratio",
        "product_sequence_mask_masked_ratio",
        "product_sequence_mask_over_high_ratio",
        "product_sequence_mask_under_low_ratio",
    }
)
"""Metrics whose local value is a per-row average (denominator = rows of the call)."""

TOKEN_COUNT_KEY = "num_valid_tokens"
SEQUENCE_COUNT_KEY = "num_sequences"

MetricPart = Union[Mapping[str, float], tuple[Mapping[str, float], float]]


def _kind(key: str, keys: frozenset[str]) -> str:
    if key.startswith("num_"):
        return "sum"
    if key.endswith("_max"):
        return "max"
    if key.endswith("_min"):
        return "min"
    if key.endswith("_std") and key[: -len("_std")] + "_mean" in keys:
        return "std"
    if key in SEQUENCE_WEIGHTED:
        return "seq"
    return "tok"


def _split(part: MetricPart) -> tuple[Mapping[str, float], float, float]:
    """(metrics, token weight, sequence weight) of one part."""
    if isinstance(part, tuple):
        metrics, w_tok = part
    else:
        metrics = part
        if TOKEN_COUNT_KEY not in metrics:
            raise ValueError(
                f"metric dict without '{TOKEN_COUNT_KEY}': pass (metrics, num_valid_tokens) pairs"
            )
        w_tok = metrics[TOKEN_COUNT_KEY]
    return metrics, float(w_tok), float(metrics.get(SEQUENCE_COUNT_KEY, w_tok))


def reduce_metrics(
    parts: Iterable[MetricPart],
    group: Optional[dist.ProcessGroup] = None,
) -> dict[str, float]:
    """Pool metric dicts (see the module docstring for the rules); keys sorted.

    parts: non-empty; each a dict with ``num_valid_tokens`` or a ``(dict, weight)`` pair.
    group: None pools the local parts only; a process group (the DP group, or
    ``dist.group.WORLD``) also pools across its ranks -- a collective (two all-reduces) that
    every rank of the group must call with the same keys.
    """
    parts = [_split(p) for p in parts]
    if not parts:
        raise ValueError("reduce_metrics needs at least one metric dict")
    keys = frozenset(parts[0][0])
    for metrics, _, _ in parts[1:]:
        if frozenset(metrics) != keys:
            raise ValueError(f"metric dicts differ in keys: {sorted(keys ^ frozenset(metrics))}")
    ordered = sorted(keys)
    kinds = {k: _kind(k, keys) for k in ordered}
    summed = [k for k in ordered if kinds[k] in ("sum", "tok", "seq", "std")]
    maxed = [k for k in ordered if kinds[k] == "max"]
    minned = [k for k in ordered if kinds[k] == "min"]

    # Weighted sums; *_std accumulate w * E[x^2] = w * (std^2 + mean^2) of their part.
    sums = [0.0] * (2 + len(summed))  # [sum w_tok, sum w_seq, per key...]
    highs = [-math.inf] * len(maxed)
    lows = [math.inf] * len(minned)
    for metrics, w_tok, w_seq in parts:
        sums[0] += w_tok
        sums[1] += w_seq
        for j, k in enumerate(summed):
            v = float(metrics[k])
            if kinds[k] == "sum":
                sums[2 + j] += v
            elif kinds[k] == "seq":
                sums[2 + j] += w_seq * v
            elif kinds[k] == "std":
                mean = float(metrics[k[: -len("_std")] + "_mean"])
                sums[2 + j] += w_tok * (v * v + mean * mean)
            else:
                sums[2 + j] += w_tok * v
        if w_tok > 0:  # an empty part's max/min are placeholders (0), not data
            highs = [max(h, float(metrics[k])) for h, k in zip(highs, maxed)]
            lows = [min(lo, float(metrics[k])) for lo, k in zip(lows, minned)]

    if group is not None:
        sums, highs, lows = _all_reduce(sums, highs, lows, ordered, group)

    w_tok_total, w_seq_total = sums[0], sums[1]
    out: dict[str, float] = {}
    for j, k in enumerate(summed):
        s = sums[2 + j]
        if kinds[k] == "sum":
            out[k] = s
        elif kinds[k] == "seq":
            out[k] = s / w_seq_total if w_seq_total > 0 else 0.0
        elif kinds[k] != "std":
            out[k] = s / w_tok_total if w_tok_total > 0 else 0.0
    for j, k in enumerate(summed):
        if kinds[k] == "std":
            mean = out[k[: -len("_std")] + "_mean"]
            second = sums[2 + j] / w_tok_total if w_tok_total > 0 else 0.0
            out[k] = math.sqrt(max(second - mean * mean, 0.0))
    for k, v in zip(maxed, highs):
        out[k] = v if math.isfinite(v) else 0.0
    for k, v in zip(minned, lows):
        out[k] = v if math.isfinite(v) else 0.0
    return {k: out[k] for k in ordered}


def _all_reduce(sums, highs, lows, ordered, group):
    """One SUM and one MAX all-reduce (mins ride as negated maxes, with a key checksum)."""
    device = collective_device(group)
    checksum = float(zlib.crc32("\n".join(ordered).encode()))
    sum_t = torch.tensor(sums, dtype=torch.float64, device=device)
    max_t = torch.tensor(highs + [-v for v in lows] + [checksum, -checksum], dtype=torch.float64, device=device)
    dist.all_reduce(sum_t, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(max_t, op=dist.ReduceOp.MAX, group=group)
    values = max_t.tolist()
    if values[-2] != -values[-1]:
        raise RuntimeError(f"metric keys differ across ranks; this rank has {ordered}")
    n_max = len(highs)
    return sum_t.tolist(), values[:n_max], [-v for v in values[n_max : n_max + len(lows)]]
