"""Rollout samples -> padded training tensors, and their split over DP ranks and micro-batches.

Layout (N sequences, S = longest prompt+response of the rollout batch, T = S - 1):

* ``tokens[N, S]``: prompt then response, right-padded with ``pad_id``. Right padding keeps
  every real token at the same position ids as in the engine (causal attention never looks
  at later padding), so no attention mask is needed.
* every per-token field is over the T *shifted* positions: position t scores ``tokens[:, t+1]``
  given ``tokens[:, :t+1]``. ``loss_mask[i, t] = 1`` iff ``tokens[i, t+1]`` is a response token.
  In a multi-turn episode the response interleaves model and observation tokens; only the
  model's count (``output_masks``), observation tokens are context.
* ``rollout_log_probs[N, T]``: the engine's log-probs on the response positions, 0 elsewhere.
* ``advantages[N]``: one per sequence (outcome reward).
* ``kept_ids[N, T, K]`` (sampling-mask replay only): the ids the engine's draw of the token at
  t+1 could pick (its top-k/top-p/min-p kept set), -1 padded; a position whose row is all -1
  is scored on the full distribution (not a response token, or a set over the budget);
* ``routed_experts[N, T, L * k]`` (router replay only): the experts the engine routed the input
  token of position t to, MoE layer l's k experts at ``[l * k, (l + 1) * k)`` (the engine's
  layout: the batch is built without the model's k); -1 where the engine routed nothing.

All ranks pad to the same S. How rows are cut into micro-batches (a fixed count at S, or a
token budget with each micro-batch cut to its own longest row) is ``trainer.microbatch``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch


@dataclass
class TrainBatch:
    tokens: torch.Tensor  # long[N, S]
    loss_mask: torch.Tensor  # float[N, T]
    rollout_log_probs: torch.Tensor  # float[N, T]
    advantages: torch.Tensor  # float[N]
    old_log_probs: torch.Tensor | None = None  # float[N, T], filled by the trainer
    ref_log_probs: torch.Tensor | None = None  # float[N, T], only with a KL loss
    teacher_log_probs: torch.Tensor | None = None  # float[N, T], only with distillation.teacher
    routed_experts: torch.Tensor | None = None  # int32[N, T, L*k], only with router replay
    kept_ids: torch.Tensor | None = None  # long[N, T, K], only with sampling-mask replay

    @property
    def num_sequences(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_length(self) -> int:
        return self.tokens.shape[1]

    def select(self, rows: slice | torch.Tensor) -> "TrainBatch":
        """The sub-batch of ``rows`` (every tensor field sliced on dim 0)."""
        return TrainBatch(**{f.name: _rows(getattr(self, f.name), rows) for f in fields(self)})

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def _rows(t: torch.Tensor | None, rows) -> torch.Tensor | None:
    return None if t is None else t[rows]


def build_train_batch(
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    output_logprobs: Sequence[Sequence[float]],
    advantages: torch.Tensor,
    pad_id: int,
    output_masks: Sequence[Sequence[int] | None] | None = None,
) -> TrainBatch:
    """Pack N (prompt, response) pairs into a TrainBatch (see the module docstring).

    prompt_ids / output_ids / output_logprobs: N lists; output_logprobs[i] has the length of
    output_ids[i]. advantages: float[N]. output_masks: None, or N entries each None (every
    response token trains) or a {0,1} list of output_ids[i]'s length (1: model token; 0:
    observation token, which gets loss_mask 0 and rollout log-prob 0).
    """
    n = len(prompt_ids)
    assert len(output_ids) == n == len(output_logprobs) == advantages.shape[0]
    seq_len = max(len(p) + len(o) for p, o in zip(prompt_ids, output_ids))
    seq_len = max(seq_len, 2)
    tokens = torch.full((n, seq_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(n, seq_len - 1)
    rollout_lp = torch.zeros(n, seq_len - 1)
    for i, (p, o, lp) in enumerate(zip(prompt_ids, output_ids, output_logprobs)):
        assert len(lp) == len(o), f"sample {i}: {len(o)} tokens but {len(lp)} log-probs"
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        if o:
            tokens[i, len(p) : len(p) + len(o)] = torch.tensor(o, dtype=torch.long)
            # response token j sits at position len(p)+j, scored at shifted position len(p)+j-1
            loss_mask[i, len(p) - 1 : len(p) - 1 + len(o)] = 1.0
            rollout_lp[i, len(p) - 1 : len(p) - 1 + len(o)] = torch.tensor(lp, dtype=torch.float32)
            mask = output_masks[i] if output_masks is not None else None
            if mask is not None:
                assert len(mask) == len(o), f"sample {i}: {len(o)} tokens but an output mask of {len(mask)}"
                model = torch.tensor(mask, dtype=torch.bool)
                span = slice(len(p) - 1, len(p) - 1 + len(o))
                loss_mask[i, span] = model.float()
                rollout_lp[i, span] = torch.where(model, rollout_lp[i, span], 0.0)
    return TrainBatch(tokens=tokens, loss_mask=loss_mask, rollout_log_probs=rollout_lp,
                      advantages=advantages.float())


def pad_kept_ids(prompt_lengths: Sequence[int], kept: Sequence[Sequence[Sequence[int] | None]],
                 seq_length: int) -> torch.Tensor:
    """N samples' kept sets (per response token: ids, or None when not sent) -> long
    [N, seq_length - 1, K] at the shifted positions of ``build_train_batch`` (response token j
    of row i at ``prompt_lengths[i] - 1 + j``), -1 elsewhere; K = the largest set (>= 1)."""
    width = max([len(ids) for row in kept for ids in row if ids is not None], default=1)
    out = torch.full((len(kept), seq_length - 1, width), -1, dtype=torch.long)
    for i, (start, row) in enumerate(zip(prompt_lengths, kept)):
        for j, ids in enumerate(row):
            if ids is not None:
                out[i, start - 1 + j, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def truncated_log_probs(log_probs: Sequence[float], kept: Sequence[Sequence[int] | None],
                        log_kept_mass: Sequence[float]) -> list[float]:
    """The engine's log-probs of one response under the distribution it sampled from:
    ``log q = log p - log sum_K p`` where the kept set was sent (the trainer then masks to the
    same set), the unfiltered ``log p`` where it was not (scored on the full distribution)."""
    return [lp - m if ids is not None else lp for lp, ids, m in zip(log_probs, kept, log_kept_mass)]


def pad_routed_experts(routed: Sequence[torch.Tensor], seq_length: int) -> torch.Tensor:
    """N engine routings, each int [P_i, num_moe_layers * k] (P_i = prompt + response - 1,
    the client's layout) -> int32 [N, seq_length - 1, num_moe_layers * k], -1 past P_i. All
    rows must have the same width and P_i <= seq_length - 1 (else ValueError naming the row)."""
    width = routed[0].shape[1]
    out = torch.full((len(routed), seq_length - 1, width), -1, dtype=torch.int32)
    for i, r in enumerate(routed):
        if r.dim() != 2 or r.shape[1] != width or r.shape[0] > seq_length - 1:
            raise ValueError(f"sample {i}: routed_experts of shape {tuple(r.shape)} does not fit "
                             f"[<= {seq_length - 1} positions, {width}]")
        out[i, : r.shape[0]] = r
    return out


def mini_batch_order(num_sequences: int, global_batch_size: int, seed: int, step: int) -> torch.Tensor | None:
    """Row order of a rollout batch before it is cut into mini-batches of ``global_batch_size``:
    a permutation long[N] seeded by (``seed``, ``step``) alone, so every rank (which all hold
    the same broadcast batch) and a resumed run draw the same one; None when the batch is a
    single mini-batch (the order inside one optimizer step does not change the update)."""
    if num_sequences <= global_batch_size:
        return None
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randperm(num_sequences, generator=gen)


def dp_shard(batch: TrainBatch, dp_rank: int, dp_size: int, global_batch_size: int) -> TrainBatch:
    """This DP rank's rows of every mini-batch: mini-batch m holds rows
    [m*G, (m+1)*G) and rank d takes the d-th contiguous G/dp of them."""
    n = batch.num_sequences
    assert n % global_batch_size == 0 and global_batch_size % dp_size == 0
    per_rank = global_batch_size // dp_size
    rows = torch.cat([
        torch.arange(m + dp_rank * per_rank, m + (dp_rank + 1) * per_rank)
        for m in range(0, n, global_batch_size)
    ])
    return batch.select(rows)

