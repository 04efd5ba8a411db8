"""The Megatron side of a GRPO step: log-prob passes and the corrected-loss update.

Both go through megatron-core's ``get_forward_backward_func`` (any TP/PP), with the forward
step every other caller uses (``models.forward.causal_logits``: placement on the rank's
device through ``runtime.device``, position ids, sequence-parallel padding). On the last
pipeline stage the vocab-parallel logits ``[B, S, V/tp]`` are turned into per-token
log-probs and entropies by ``ops.vocab_parallel_log_probs`` (never gathering the vocab),
then into the loss by ``losses.compute_policy_loss``. The output layer runs only from each
micro-batch's first scored position on (``first_scored``; packed rows: at their scored
(row, position) pairs, ``packed_scored``; ``models.forward``): the positions left out get
log-prob 0 and no gradient, which the loss mask gave them anyway.

Loss scaling. Megatron's schedule divides each micro-batch loss by the number of micro-batches
and DDP averages gradients over the dp ranks, while ``compute_policy_loss`` returns per-part
losses that SUM to the mini-batch loss. Each part is therefore multiplied by
``num_microbatches * dp``, so the gradient is exactly that of the global mini-batch loss
whatever the split (docs/loss_spec.md#the-whole-loss-and-the-distributed-contract).

Context parallelism (``parallel.cp``, ``models.context_parallel``): each CP rank runs its
chunks of every sequence, scores the pairs its logits cover (``CPScored``) and sums the [B, T]
log-probs and entropies over the CP group, so the loss is computed on whole sequences,
identically on every CP rank. DDP averages over dp x cp and the schedule multiplies each loss
by cp (the legacy two-output ``loss_func`` path), so the scale stays ``num_microbatches * dp``
(docs/models.md#context-parallelism-parallelcp, "Gradients").
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_grpo.config.algorithm import AlgorithmConfig
from megatron_grpo.config.distillation import DistillationConfig
from megatron_grpo.losses import compute_policy_loss, reduce_metrics
from megatron_grpo.models.fake_quant import fake_quantized
from megatron_grpo.models.context_parallel import cp_group_info, cp_sum, local_index, local_of_global, split_packed
from megatron_grpo.models.forward import (causal_logits, context_parallel_logits, context_parallel_size, logits_start,
                                          packed_logits, padded_length, run_schedule, sequence_multiple)
from megatron_grpo.models.packing import PackedRows, Pairs, pack, pairs, shared_prefix_groups
from megatron_grpo.ops import vocab_parallel_log_probs
from megatron_grpo.ops.quantize import QuantScheme
from megatron_grpo.ops.vocab_parallel import Kernel
from megatron_grpo.runtime.device import all_finite, collective_tensor, to_device
from megatron_grpo.rollout.batch import TrainBatch, build_train_batch
from megatron_grpo.trainer.microbatch import (MicroBatching, plan_micro_batches, prompt_lengths, sequence_lengths,
                                              split, unsplit)
from megatron_grpo.trainer.moe_metrics import RouterLoad
from megatron_grpo.trainer.router_replay import RoutingReplay


@dataclass
class ScoringSpec:
    """How the trainer scores tokens: must match the rollout engine's distribution."""

    temperature: float
    vocab_size: int  # true (unpadded) vocabulary
    chunk_size: Optional[int] = None
    kernel: Kernel = "auto"  # model.logprob_kernel


def first_scored(loss_mask_BT: torch.Tensor) -> int:
    """The first shifted position any row scores (loss_mask [B, T]; 0 when none does): every
    position before it is a prompt position of every row, whose logits are never read. E.g.
    rows scoring from t = 4 and t = 2 -> 2."""
    cols = loss_mask_BT.ne(0).any(dim=0).nonzero()
    return int(cols[0]) if cols.numel() else 0


def _token_scores(logits_BSv: torch.Tensor, mb: TrainBatch, spec: ScoringSpec, with_entropy: bool, start: int = 0):
    """Vocab-parallel logits [B, S_pad - start, V/tp] of positions ``start..`` (S_pad >= S:
    sequence-parallel padding) -> (log_probs [B, T], entropy [B, T] or None), T = S - 1, 0 at
    the positions before ``start`` (never scored: ``first_scored``). With the engine's kept
    sets (``mb.kept_ids``, sampling-mask replay) both describe the truncated distribution the
    engine sampled from -- for pi_old, the reference and the updated policy alike."""
    width = mb.seq_length - 1
    kept = None if mb.kept_ids is None else mb.kept_ids[:, start:]
    lp, ent = _log_probs(logits_BSv[:, : width - start], mb.tokens[:, start + 1:], kept, spec, with_entropy)
    if start == 0:
        return lp, ent
    return _from(lp, start), None if ent is None else _from(ent, start)


def _from(scores_BX: torch.Tensor, start: int) -> torch.Tensor:
    """[B, T - start] scores of positions ``start..`` as [B, T], zeros before (differentiable)."""
    return torch.nn.functional.pad(scores_BX, (start, 0))


def _log_probs(logits: torch.Tensor, targets: torch.Tensor, kept_ids: Optional[torch.Tensor], spec: ScoringSpec,
               with_entropy: bool):
    """The op as the trainer calls it (padded or packed rows alike): vocab-parallel logits
    [..., V/tp], targets [...] and kept sets [..., K] or None -> (log_probs [...], entropy
    [...] or None) at ``spec``'s temperature, with its chunking and kernel."""
    return vocab_parallel_log_probs(
        logits, targets, temperature=spec.temperature, vocab_size=spec.vocab_size, chunk_size=spec.chunk_size,
        kernel=spec.kernel, with_entropy=with_entropy,
        inplace=True,  # the logits are the output layer's fresh output, read only here
        kept_ids=kept_ids,
    )


def packed_scored(mb: TrainBatch, packed: PackedRows) -> Optional[Pairs]:
    """The (row, position) pairs some row scores (its loss mask there > 0) and the packed
    indices they read (``models.packing.pairs``); None when there is none (the output layer
    then runs on every packed index)."""
    scored = pairs(packed, mb.loss_mask)
    return scored if scored.count else None


def _packed_token_scores(logits_1Rv: torch.Tensor, mb: TrainBatch, packed: PackedRows, spec: ScoringSpec,
                         with_entropy: bool, positions: Optional[Pairs] = None):
    """``_token_scores`` of a packed micro-batch: vocab-parallel logits [1, R, V/tp] of the
    pairs ``positions`` (``packed_scored``; None: logits [1, T_packed, V/tp] of every packed
    index, read at every pair of every row) -> (log_probs [B, T], entropy [B, T] or None) in the
    micro-batch's row layout (T = S - 1), 0 at every position not scored. Each pair is scored
    against its own row's next token, so rows sharing a prefix share its logits, not their
    targets. Only the per-token scores are scattered back: no [B, S, V] logits are ever padded
    out."""
    chosen = positions
    if chosen is None:
        chosen = pairs(packed)
        logits_1Rv = logits_1Rv[:, chosen.index]
    targets = mb.tokens[chosen.rows, chosen.cols + 1].unsqueeze(0)
    kept = None if mb.kept_ids is None else mb.kept_ids[chosen.rows, chosen.cols].unsqueeze(0)
    lp, ent = _log_probs(logits_1Rv, targets, kept, spec, with_entropy)
    rows, width = mb.num_sequences, mb.seq_length - 1

    def back(values_1R: torch.Tensor) -> torch.Tensor:  # differentiable: the loss's gradient reaches the R pairs
        return values_1R.new_zeros(rows, width).index_put((chosen.rows, chosen.cols), values_1R[0])

    return back(lp), None if ent is None else back(ent)


@dataclass(frozen=True)
class CPScored:
    """Under context parallelism, what a CP rank's logits score: the local token indices the
    output layer runs on (``columns``, long [R]) and the (row, shifted position) pair of each
    logits row (``rows`` / ``cols``, long [N]: padded rows, every row at each column, N = B x R,
    row-major; packed rows, one pair per column). A ``cols`` of T (= S - 1) marks a value
    nobody reads (a position another rank, or no rank, scores): it is dropped."""

    columns: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor


def _cp_padded(mb: TrainBatch, multiple: int, start: int, cp: int, rank: int) -> CPScored:
    """``CPScored`` of padded rows: this rank's tokens of the rows padded to ``multiple``
    (``models.forward.context_parallel_logits``), the output layer on those at positions
    ``start`` .. T-1 (at least one column, so every rank's loss reaches its logits)."""
    device, width = mb.tokens.device, mb.seq_length - 1
    positions = local_index([padded_length(mb.seq_length, multiple)], cp, rank).to(device)
    scored = (positions >= start) & (positions < width)
    wanted = scored.nonzero()[:, 0]
    columns = wanted if wanted.numel() else torch.zeros(1, dtype=torch.long, device=device)
    cols = torch.where(scored[columns], positions[columns], width)
    rows = torch.arange(mb.num_sequences, device=device).repeat_interleave(columns.numel())
    return CPScored(columns=columns, rows=rows, cols=cols.repeat(mb.num_sequences))


def _cp_packed(mb: TrainBatch, cp: int, rank: int) -> tuple[PackedRows, CPScored]:
    """This rank's share of ``mb`` packed (each row cut to its scored length, then padded to a
    multiple of 2 x cp: ``models.context_parallel.split_packed``) and the scored pairs it holds."""
    lengths = [padded_length(n, 2 * cp) for n in sequence_lengths(mb).tolist()]
    width = max(max(lengths), mb.seq_length)
    tokens = torch.nn.functional.pad(mb.tokens, (0, width - mb.seq_length))
    mask = torch.nn.functional.pad(mb.loss_mask, (0, width - mb.seq_length))
    whole = pack(tokens, lengths)
    scored = pairs(whole, mask)
    local = local_of_global(lengths, cp, rank).to(mb.tokens.device)[scored.index]
    mine = local >= 0
    if not mine.any():  # one dropped pair, so that this rank's loss still reaches its logits
        zero = torch.zeros(1, dtype=torch.long, device=mb.tokens.device)
        return split_packed(whole, cp, rank), CPScored(columns=zero, rows=zero, cols=zero + mb.seq_length - 1)
    return split_packed(whole, cp, rank), CPScored(columns=local[mine], rows=scored.rows[mine], cols=scored.cols[mine])


def _cp_scores(logits_BRv: torch.Tensor, mb: TrainBatch, scored: CPScored, spec: ScoringSpec, with_entropy: bool,
               group) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Vocab-parallel logits [B, R, V/tp] (padded) or [1, R, V/tp] (packed) of ``scored``'s
    columns -> (log_probs [B, T], entropy [B, T] or None) of the WHOLE sequences: this rank's
    pairs, zeros elsewhere, summed over the CP group (``cp_sum``: every rank then holds the
    values CP1 computes, 0 where CP1 gives 0)."""
    num_rows, width = mb.num_sequences, mb.seq_length - 1
    safe = scored.cols.clamp(max=width - 1)
    targets = mb.tokens[scored.rows, safe + 1].unsqueeze(0)
    kept = None if mb.kept_ids is None else mb.kept_ids[scored.rows, safe].unsqueeze(0)
    lp, ent = _log_probs(logits_BRv.reshape(1, -1, logits_BRv.shape[-1]), targets, kept, spec, with_entropy)

    def whole(values_1N: torch.Tensor) -> torch.Tensor:  # column T collects the dropped values
        local = values_1N.new_zeros(num_rows, width + 1).index_put((scored.rows, scored.cols), values_1N[0])
        return cp_sum(local[:, :width], group)

    return whole(lp), None if ent is None else whole(ent)


MicroBatch = tuple[TrainBatch, Optional[PackedRows], "int | Optional[Pairs] | CPScored"]
"""A micro-batch, its packed layout (None: padded rows; under CP this rank's share) and where
its logits are needed: the first scored position (padded rows, ``first_scored``), the scored
pairs (``packed_scored``) or, under context parallelism, this rank's ``CPScored``."""


def _micro_batches(batch: TrainBatch, plan, batching: MicroBatching, model) -> list[MicroBatch]:
    """The plan's micro-batches, each with its packed layout (rows cut to their own scored
    length, ``trainer.microbatch.sequence_lengths``; rows with one prompt sharing it with
    ``batching.share``) when packing, else None, and its scored positions. Those are found
    here, once before the schedule, not in the forward step: each is a host read of a device
    tensor, which there would wait for the previous micro-batch's backward to finish.
    ``model``: a chunk (its sequence multiple and context-parallel size)."""
    mbs = split(batch, plan)
    cp, rank, _ = cp_group_info()
    if cp > 1 and batching.pack:
        return [(mb, *_cp_packed(mb, cp, rank)) for mb in mbs]
    if cp > 1:
        multiple = sequence_multiple(model)
        return [(mb, None, _cp_padded(mb, multiple, logits_start(model, first_scored(mb.loss_mask)), cp, rank))
                for mb in mbs]
    if not batching.pack:
        return [(mb, None, first_scored(mb.loss_mask)) for mb in mbs]
    items = []
    for mb in mbs:
        lengths = sequence_lengths(mb).tolist()
        groups = (shared_prefix_groups(mb.tokens, lengths, prompt_lengths(mb.loss_mask))
                  if batching.share else None)
        packed = pack(mb.tokens, lengths, groups)
        items.append((mb, packed, packed_scored(mb, packed)))
    return items


def _forward(model, mb: TrainBatch, packed: Optional[PackedRows], scored):
    """The chunk's output for ``mb`` and the positions its logits cover (``models.forward``,
    logits of the scored positions only): padded rows, the first one (an int: ``scored`` where
    the model allows); packed rows, the packed indices of the pairs ``scored``; under context
    parallelism, this rank's columns (``CPScored``)."""
    if isinstance(scored, CPScored):
        if packed is not None:
            return packed_logits(model, packed, scored.columns), scored
        return context_parallel_logits(model, mb.tokens, scored.columns), scored
    if packed is not None:
        return packed_logits(model, packed, None if scored is None else scored.index), scored
    start = logits_start(model, scored)
    return causal_logits(model, mb.tokens, start), start


def _scores(output, mb: TrainBatch, packed: Optional[PackedRows], spec: ScoringSpec, with_entropy: bool,
            positions=0):
    """``_forward``'s output and positions -> (log_probs [B, T], entropy [B, T] or None)."""
    if isinstance(positions, CPScored):
        return _cp_scores(output, mb, positions, spec, with_entropy, cp_group_info()[2])
    if packed is None:
        return _token_scores(output, mb, spec, with_entropy, positions)
    return _packed_token_scores(output, mb, packed, spec, with_entropy, positions)


def _run_schedule(model_chunks, items: list[MicroBatch], forward_step, forward_only: bool):
    # token-budget micro-batches (and packed rows) differ in shape: the pipeline stages then
    # exchange shapes
    # (the whole sequence's length: megatron's schedule divides it by cp)
    cp = context_parallel_size(model_chunks[0])
    shapes = [tuple(mb.tokens.shape) if packed is None else (1, packed.num_tokens * cp) for mb, packed, _ in items]
    return run_schedule(model_chunks, items, forward_step, forward_only=forward_only, num_microbatches=len(items),
                        seq_length=shapes[0][1], micro_batch_size=shapes[0][0],
                        variable_seq_lengths=len(set(shapes)) > 1)


def old_log_probs_needed(num_iterations: int, num_mini_batches: int) -> bool:
    """Whether the policy can move between the old-log-prob pass and an update. With one
    epoch over one mini-batch, the update runs on the very weights the pass would score, so
    pi_old = pi_theta: ``train_mini_batch`` then uses the detached current log-probs (same
    value, same gradient) and the extra forward pass is skipped (TRL does the same)."""
    return num_iterations > 1 or num_mini_batches > 1


def compute_log_probs(model_chunks, batch: TrainBatch, batching: MicroBatching | int, spec: ScoringSpec,
                      router_load: Optional[RouterLoad] = None, routing: Optional[RoutingReplay] = None):
    """Forward-only scoring of ``batch``: float[N, T] log-probs on the last PP stage, None on
    the others (the loss is computed where the logits are). Micro-batches as in
    ``train_mini_batch`` (``trainer.microbatch``); positions past a row's last response
    token may be 0 under a token budget (they are never scored). ``router_load``: counts the
    MoE routing of the scored positions (``trainer.moe_metrics``). ``routing``: replays
    ``batch.routed_experts`` and counts mismatches (``trainer.router_replay``).
    ``batching``: the micro-batches (``trainer.microbatch.MicroBatching``; an int: fixed rows)."""
    from megatron.core import parallel_state

    def forward_step(data_iterator, model):
        mb, packed, scored = next(data_iterator)
        if router_load is not None:
            router_load.set_micro_batch(mb.loss_mask)
        _set_routing(routing, mb)
        logits, positions = _forward(model, mb, packed, scored)

        def loss_func(output):
            lp, _ = _scores(output, mb, packed, spec, with_entropy=False, positions=positions)
            return torch.zeros((), device=lp.device), {"log_probs": lp}

        return logits, loss_func

    batch = to_device(batch)  # the batch is built on the CPU (rank 0) and broadcast
    for c in model_chunks:
        c.eval()
    batching = MicroBatching.coerce(batching)
    plan = plan_micro_batches(batch, batching.rows, batching.max_tokens, batching.pack,
                              batching.share)
    mbs = _micro_batches(batch, plan, batching, model_chunks[0])
    with torch.no_grad(), (router_load.counting(len(mbs)) if router_load else contextlib.nullcontext()), \
            _routing_applied(routing, batch):
        outs = _run_schedule(model_chunks, mbs, forward_step, True)
    for c in model_chunks:
        c.train()
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return unsplit([o["log_probs"] for o in outs], plan, batch.num_sequences, batch.seq_length - 1)


def train_mini_batch(
    model_chunks,
    optimizer,
    mini: TrainBatch,
    cfg: AlgorithmConfig,
    spec: ScoringSpec,
    batching: MicroBatching | int,
    num_tokens: int,
    num_sequences: int,
    dp_size: int,
    dp_group,
    routing: Optional[RoutingReplay] = None,
    distillation: Optional[DistillationConfig] = None,
) -> tuple[dict[str, float] | None, bool, float]:
    """One optimizer step on this rank's share of a mini-batch.

    num_tokens / num_sequences: valid tokens / sequences of the GLOBAL mini-batch.
    batching: the micro-batches (``trainer.microbatch.MicroBatching``: fixed rows or a token
    budget, packed or not; an int: fixed rows). ``mini.old_log_probs`` None means pi_old = pi_theta
    (``old_log_probs_needed``): the detached current log-probs stand in.
    ``routing``: replays ``mini.routed_experts`` in the forward (``trainer.router_replay``).
    ``distillation``: with ``mini.teacher_log_probs``, the teacher's term (``losses.distill``).
    The metrics carry ``num_padded_tokens`` / ``num_sequence_tokens`` (token slots run /
    real prompt+response tokens), whose ratio gives the padding fraction.
    Returns (metrics pooled over micro-batches and dp on the last stage else None,
    whether the update was applied (False when the loss or a gradient was non-finite),
    the gradient norm).
    """
    from megatron.core import parallel_state

    mini = to_device(mini)
    batching = MicroBatching.coerce(batching)
    plan = plan_micro_batches(mini, batching.rows, batching.max_tokens, batching.pack, batching.share)
    mbs = _micro_batches(mini, plan, batching, model_chunks[0])
    # dp ranks may differ in len(mbs): each scales by its own. Under CP megatron's schedule
    # multiplies by cp itself (DDP averages over dp x cp ranks: module docstring)
    cp = context_parallel_size(model_chunks[0])
    scale = len(mbs) * dp_size
    want_entropy_grad = cfg.entropy_coef > 0

    def forward_step(data_iterator, model):
        mb, packed, scored = next(data_iterator)
        _set_routing(routing, mb)
        logits, positions = _forward(model, mb, packed, scored)

        def loss_func(output):
            lp, ent = _scores(output, mb, packed, spec, with_entropy=True, positions=positions)
            old = mb.old_log_probs if mb.old_log_probs is not None else lp.detach()
            loss, metrics = compute_policy_loss(
                lp, old, mb.advantages, mb.loss_mask, cfg,
                rollout_log_probs=mb.rollout_log_probs, ref_log_probs=mb.ref_log_probs,
                entropy=ent if want_entropy_grad else ent.detach(),
                num_tokens=num_tokens, num_sequences=num_sequences,
                teacher_log_probs=mb.teacher_log_probs,
                distillation=distillation,  # with mb.teacher_log_probs, or the loss refuses it
            )
            metrics["loss"] = float(loss.detach())
            metrics["num_padded_tokens"] = float(mb.tokens.numel() if packed is None else packed.num_tokens * cp)
            metrics["num_sequence_tokens"] = float(sequence_lengths(mb).sum())
            return loss * scale, metrics

        return logits, loss_func

    for c in model_chunks:
        c.zero_grad_buffer()
    optimizer.zero_grad()
    with _routing_applied(routing, mini):
        outs = _run_schedule(model_chunks, mbs, forward_step, False)

    finite = _all_finite(model_chunks, outs)
    if not finite:
        for c in model_chunks:
            c.zero_grad_buffer()
        optimizer.zero_grad()
        grad_norm = float("nan")
    else:
        ok, grad_norm, _ = optimizer.step()
        finite = bool(ok)
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")

    metrics = None
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        metrics = reduce_metrics(outs, group=dp_group)
        # the parts' losses SUM to the mini-batch loss (not a token-weighted mean)
        metrics["loss"] = _sum_over(sum(m["loss"] for m in outs), dp_group)
    return metrics, finite, grad_norm


def _set_routing(routing: Optional[RoutingReplay], mb: TrainBatch) -> None:
    if routing is not None and mb.routed_experts is not None:
        routing.set_micro_batch(mb.routed_experts, mb.loss_mask)


def _routing_applied(routing: Optional[RoutingReplay], batch: TrainBatch):
    """Router replay over the passes run inside when the batch carries the rollout's routing."""
    if routing is None or not routing.active or batch.routed_experts is None:
        return contextlib.nullcontext()
    return routing.applied()


def _sum_over(value: float, group) -> float:
    t = collective_tensor([value], group)
    dist.all_reduce(t, group=group)
    return float(t.item())


def _all_finite(model_chunks, outs) -> bool:
    """True iff every rank's loss values and gradients are finite: the per-parameter checks
    are queued on the device, then one all-reduce and one host sync (``runtime.device``)."""
    losses_ok = all(math.isfinite(m["loss"]) for m in outs or [])
    grads = (getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
             for chunk in model_chunks for p in chunk.parameters())
    return all_finite(grads, extra_ok=losses_ok)


def probe_log_probs(model_chunks, token_ids: list[int], spec: ScoringSpec,
                    quantization: Optional[QuantScheme] = None) -> Optional[list[float]]:
    """The policy's log-probs of ``token_ids[1:]`` at temperature 1 (the weight-sync probe).

    ``quantization``: the engine's (``engine.quantization``): the forward runs through the same
    fake quantization (``models.fake_quant``), so a quantized engine is held to the probe's
    tolerance instead of a wider one. Collective over the model-parallel group like
    ``compute_log_probs``; a list of len(token_ids) - 1 floats on the last pipeline stage,
    None on the others.
    """
    batch = build_train_batch([token_ids[:1]], [token_ids[1:]], [[0.0] * (len(token_ids) - 1)],
                              torch.zeros(1), pad_id=0)
    at_t1 = dataclasses.replace(spec, temperature=1.0)
    with fake_quantized(model_chunks, quantization):
        out = compute_log_probs(model_chunks, batch, 1, at_t1)
    return None if out is None else out[0, : len(token_ids) - 1].tolist()
