"""Continuous batching: sequences join and leave the running decode batch as others finish.

One loop (``run_continuous``) owns a ``RunningBatch`` (``batch.py``):

1. admit: when at least ``min_admit`` rows are free (finished rows count as free) it asks the
   engine for up to that many queued sequences, prefills them in their own forward and
   merges their KV rows into the running batch (left padding + mask zeros, explicit
   position ids), so a long response no longer holds back the queue;
2. sample one token per row (``sampling.sample_tokens``, one uniform per row from the row's
   own generator when seeded: a seeded sequence draws the same tokens whatever else is in
   the batch, and whenever it joined);
3. drop finished rows once they are a quarter of the batch (or before a merge);
4. ask the engine's ``control`` what to do between steps (continue, park in place, abort,
   retract), then feed the sampled tokens through the cache.

Prefix sharing: sequences whose prompt (plus tokens already generated) is identical -- the
``n`` samples of one request -- are prefilled ONCE and their cache rows replicated
(``RunningBatch.select`` with repeated rows). On this dense cache that saves the prefill
compute, not the memory: each sample still holds its own copy of the prompt's keys and
values (no paged attention / copy-on-write blocks here, unlike SGLang's radix cache).

Why bunches: every admission costs a prefill forward plus one copy of the whole cache
(``merge``), every drop one more (``select``); admitting and dropping a quarter of the
batch at a time bounds that to a few copies per quarter of the batch that turns over
(measured in ``tools/bench/bench_generation.py``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Optional

import torch

from megatron_grpo.inference.batch import RunningBatch
from megatron_grpo.inference.generation import Sequence, finish_reason_for, left_pad, prompt_logprobs
from megatron_grpo.inference.routing import RoutingRecorder, moe_routers
from megatron_grpo.inference.sampling import draw_uniforms, sample_tokens


class StepControl:
    """What the engine's ``control()`` answers between two decode steps."""

    CONTINUE = "continue"
    ABORT = "abort"
    RETRACT = "retract"


def distinct_prefixes(seqs: list[Sequence]) -> tuple[list[list[int]], list[int]]:
    """The distinct token lists (prompt + output so far) of ``seqs`` and, per sequence, the
    index of its list: the prefills to run once and how to replicate them."""
    index_of: dict[tuple[int, ...], int] = {}
    rows = [index_of.setdefault(tuple(s.prompt_ids + s.output_ids), len(index_of)) for s in seqs]
    return [list(t) for t in index_of], rows


def _records(recorder: Optional[RoutingRecorder], seqs: list[Sequence]) -> bool:
    """Record routing only when a row asked (the hooks cost a copy per MoE layer)."""
    return recorder is not None and any(s.return_routed_experts and not s.finished for s in seqs)


@functools.cache
def cache_kwarg(model_type: type) -> str:
    """The keyword a transformers causal LM takes its KV cache by: ``cache`` from transformers
    5.2x (``past_key_values`` is deprecated there and goes in 5.40), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


@torch.inference_mode()
def prefill(model: torch.nn.Module, seqs: list[Sequence], *, pad_id: int,
            recorder: Optional[RoutingRecorder]) -> RunningBatch:
    """Prefill each distinct prompt once; one row per sequence of ``seqs`` in the result.

    Also fills ``input_logprobs`` (when asked) and the prompt's routing per sequence.
    """
    from transformers import DynamicCache

    device = next(model.parameters()).device
    distinct, row_of = distinct_prefixes(seqs)
    ids, mask, positions = (t.to(device) for t in left_pad(distinct, pad_id))
    want_prompt = [s.logprob_start_len >= 0 and s.input_logprobs is None and not s.output_ids for s in seqs]
    cache = DynamicCache()
    records = _records(recorder, seqs)
    with recorder.capture() if records else contextlib.nullcontext():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{cache_kwarg(type(model)): cache},
                    use_cache=True, logits_to_keep=0 if any(want_prompt) else 1)
    width = ids.shape[1]
    routed = recorder.take(len(distinct)) if records else None
    for s, row, want in zip(seqs, row_of, want_prompt):
        length = len(s.prompt_ids) + len(s.output_ids)
        if routed is not None and s.return_routed_experts:  # a resumed sequence starts afresh
            s.routed_blocks = [routed[row, width - length:]]  # [L, layers, k], shared rows alias it
        if want:
            own = out.logits[row, width - len(s.prompt_ids):]
            s.input_logprobs = prompt_logprobs(own, s.prompt_ids, s.logprob_start_len, s.params.temperature)
    batch = RunningBatch(seqs=list(seqs), cache=cache, mask_BT=mask, next_pos_B=mask.sum(dim=1),
                         last_logits_BV=out.logits[:, -1])
    if row_of != list(range(len(distinct))):
        batch.select_rows(row_of)  # replicate each shared prompt's rows for its samples
    return batch


def sample_step(batch: RunningBatch, *, shared_generator: torch.Generator, eos_ids: frozenset[int],
                max_context: int, weight_version: Callable[[], str]) -> torch.Tensor:
    """Draw each row's next token, append it to the live sequences, finish those that are
    done. Returns the tokens, int64 [B] (finished rows' entries are never used)."""
    seqs, device = batch.seqs, batch.last_logits_BV.device
    uniforms = draw_uniforms([s.generator for s in seqs], shared_generator).to(device)
    with_kept = any(s.return_sampling_mask for s in seqs)
    version = weight_version()  # the weights that computed last_logits_BV (no update mid-step)
    draw = sample_tokens(
        batch.last_logits_BV,
        torch.tensor([s.params.temperature for s in seqs], device=device),
        torch.tensor([s.params.top_k for s in seqs], device=device),
        torch.tensor([s.params.top_p for s in seqs], device=device),
        torch.tensor([s.params.min_p for s in seqs], device=device),
        uniforms, with_kept=with_kept, max_kept=max((s.max_kept for s in seqs), default=0))
    for b, (s, token, logprob) in enumerate(zip(seqs, draw.tokens.tolist(), draw.logprobs.tolist())):
        if s.finished:
            continue
        s.output_ids.append(token)
        s.output_logprobs.append(logprob)
        s.output_versions.append(version)
        if s.return_sampling_mask:
            kept = draw.truncation.kept_ids[b]
            s.output_kept_ids.append(kept if kept is None or len(kept) <= s.max_kept else None)
            s.output_log_kept_mass.append(draw.truncation.log_kept_mass[b])
        reason = finish_reason_for(s, token, eos_ids, max_context)
        if reason is not None:
            s.finish(reason, weight_version())
    return draw.tokens


@torch.inference_mode()
def decode_step(model: torch.nn.Module, batch: RunningBatch, tokens_B: torch.Tensor,
                recorder: Optional[RoutingRecorder]) -> None:
    """Feed one token per row through the cache; updates the batch's logits and positions."""
    batch.mask_BT = torch.cat([batch.mask_BT, torch.ones_like(batch.mask_BT[:, :1])], dim=1)
    records = _records(recorder, batch.seqs)
    with recorder.capture() if records else contextlib.nullcontext():
        out = model(input_ids=tokens_B.unsqueeze(1), attention_mask=batch.mask_BT,
                    position_ids=batch.next_pos_B.unsqueeze(1), **{cache_kwarg(type(model)): batch.cache},
                    use_cache=True)
    if records:
        routed = recorder.take(len(batch))  # [B, 1, layers, k]
        for row, s in enumerate(batch.seqs):
            if s.return_routed_experts:
                s.routed_blocks.append(routed[row])
    batch.next_pos_B = batch.next_pos_B + 1
    batch.last_logits_BV = out.logits[:, -1]


def start(seqs: list[Sequence], weight_version: Callable[[], str]) -> list[Sequence]:
    """Finish the sequences that need no forward (``max_new_tokens == 0``, no prompt
    log-probs); returns the rest."""
    for s in seqs:
        if s.params.max_new_tokens == 0 and s.logprob_start_len < 0 and not s.finished:
            s.finish({"type": "length", "length": 0}, weight_version())
    return [s for s in seqs if not s.finished]


def run_continuous(
    model: torch.nn.Module,
    admit: Callable[[int], list[Sequence]],
    *,
    max_batch_size: int,
    eos_ids: frozenset[int],
    pad_id: int,
    shared_generator: torch.Generator,
    max_context: int,
    control: Callable[[], str],
    weight_version: Callable[[], str],
    min_admit: Optional[int] = None,
) -> list[Sequence]:
    """Decode until ``admit`` has nothing more and every admitted sequence finished.

    ``admit(k)`` returns up to ``k`` queued sequences (possibly none). Returns the retracted
    sequences when ``control()`` said RETRACT, else [].
    """
    min_admit = min_admit or max(1, max_batch_size // 4)
    recorder = RoutingRecorder(model) if moe_routers(model) else None
    batch: Optional[RunningBatch] = None
    while True:
        live = batch.num_live if batch is not None else 0
        free = max_batch_size - live
        admitted = admit(free) if (live == 0 or free >= min_admit) else []
        newcomers = start(admitted, weight_version)
        if newcomers:
            fresh = prefill(model, newcomers, pad_id=pad_id, recorder=recorder)
            for s in newcomers:  # prompt log-probs only: the prefill was all they needed
                if s.params.max_new_tokens == 0:
                    s.finish({"type": "length", "length": 0}, weight_version())
            if live == 0:
                batch = fresh
            else:
                batch.drop_finished()
                batch.merge(fresh)
        if batch is None or batch.num_live == 0:
            if not admitted:
                return []
            batch = None
            continue
        tokens = sample_step(batch, shared_generator=shared_generator, eos_ids=eos_ids,
                             max_context=max_context, weight_version=weight_version)
        action = control()
        if action == StepControl.ABORT:
            for s in batch.seqs:
                if not s.finished:
                    s.finish({"type": "abort", "message": "generation paused (mode=abort)"}, weight_version())
            return []
        if action == StepControl.RETRACT:
            return [s for s in batch.seqs if not s.finished]
        if batch.num_live == 0:
            batch = None
            continue
        if (len(batch) - batch.num_live) * 4 >= len(batch):
            tokens = tokens[batch.drop_finished()]
        decode_step(model, batch, tokens, recorder)
