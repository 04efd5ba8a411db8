"""Batched autoregressive generation with a KV cache over a transformers causal LM.

A "wave" is a batch of sequences run from prefill to the last finished sequence:

* prefill: prompts (plus tokens already generated, for a request resumed after a retract)
  are LEFT-padded into one [B, L] batch with an attention mask and explicit position ids
  (``cumsum(mask) - 1``), so every real token sees exactly the positions and keys it would
  see alone: the log-probs equal an unpadded full forward to float rounding (tested to
  1e-5 against transformers' own forward);
* decode: one token per sequence per step through the ``DynamicCache``; finished rows are
  dropped from the cache once enough of them accumulate (``batch_select_indices``);
* between steps the engine's ``control`` callback may pause the wave in place, abort it,
  or retract its sequences (they are re-queued and re-prefilled later).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_grpo.rollout.embedded.routing import RoutingRecorder
from megatron_grpo.rollout.embedded.sampling import ResolvedSampling, draw_uniforms, sample_next


@dataclass(eq=False)
class Sequence:
    """One response being generated (one item of a /generate request times ``n``)."""

    rid: str
    prompt_ids: list[int]
    params: ResolvedSampling
    return_logprob: bool = False
    logprob_start_len: int = -1
    """>= 0: also report log-probs of the prompt tokens from this index (SGLang semantics)."""
    generator: Optional[torch.Generator] = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: Optional[list[Optional[float]]] = None
    return_routed_experts: bool = False
    routed_blocks: list[torch.Tensor] = field(default_factory=list)
    """Routing of the positions fed so far, int32 [L_fwd, num_moe_layers, k] per forward
    (``routed_experts`` trims the positions fed after the sequence finished)."""
    finish_reason: Optional[dict] = None
    weight_version: str = ""
    created: float = field(default_factory=time.monotonic)
    on_finish: Optional[Callable[["Sequence"], None]] = None

    @property
    def routed_experts(self) -> torch.Tensor:
        """int32 [prompt + response - 1, num_moe_layers, k]: the experts each fed position was
        routed to (the last sampled token is never fed)."""
        return torch.cat(self.routed_blocks)[: len(self.prompt_ids) + len(self.output_ids) - 1]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: dict, weight_version: str) -> None:
        self.finish_reason = reason
        self.weight_version = weight_version
        if self.on_finish is not None:
            self.on_finish(self)


def left_pad(token_lists: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ids, attention mask and position ids, each [B, L] int64."""
    length = max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), length), dtype=torch.long)
    for row, tokens in enumerate(token_lists):
        if tokens:
            ids[row, length - len(tokens):] = torch.tensor(tokens, dtype=torch.long)
            mask[row, length - len(tokens):] = 1
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    return ids, mask, positions


def prompt_logprobs(logits_LV: torch.Tensor, tokens: list[int], start: int,
                    temperature: float) -> list[Optional[float]]:
    """SGLang ``input_token_logprobs`` of one prompt from its prefill logits.

    ``logits_LV`` are the logits at the prompt's own positions (padding removed); entry ``i``
    is the log-prob of ``tokens[start + i]`` under log_softmax(logits / T) of the previous
    position, and ``None`` for the very first token (nothing predicts it).
    """
    out: list[Optional[float]] = []
    logprobs = torch.log_softmax(logits_LV.float() / temperature, dim=-1)
    for i in range(start, len(tokens)):
        out.append(None if i == 0 else float(logprobs[i - 1, tokens[i]]))
    return out


class WaveStep:
    """What ``control()`` tells the wave between two decode steps."""

    CONTINUE = "continue"
    ABORT = "abort"
    RETRACT = "retract"


def finish_reason_for(seq: Sequence, token: int, eos_ids: frozenset[int],
                      max_context: int) -> Optional[dict]:
    """SGLang finish reason after ``token`` was appended, or None to keep going."""
    if token in seq.params.stop_token_ids or (not seq.params.ignore_eos and token in eos_ids):
        return {"type": "stop", "matched": token}
    if len(seq.output_ids) >= seq.params.max_new_tokens:
        return {"type": "length", "length": seq.params.max_new_tokens}
    if len(seq.prompt_ids) + len(seq.output_ids) >= max_context:
        return {"type": "length", "length": len(seq.output_ids)}
    return None


@torch.inference_mode()
def run_wave(
    model: torch.nn.Module,
    seqs: list[Sequence],
    *,
    eos_ids: frozenset[int],
    pad_id: int,
    shared_generator: torch.Generator,
    max_context: int,
    control: Callable[[], str],
    weight_version: Callable[[], str],
) -> list[Sequence]:
    """Generate until every sequence of ``seqs`` finished; returns the retracted ones (if any)."""
    from transformers import DynamicCache

    active = [s for s in seqs if not s.finished]
    for s in active:
        if s.params.max_new_tokens == 0 and s.logprob_start_len < 0:
            s.finish({"type": "length", "length": 0}, weight_version())
    active = [s for s in active if not s.finished]
    if not active:
        return []
    device = next(model.parameters()).device
    ids, mask, positions = left_pad([s.prompt_ids + s.output_ids for s in active], pad_id)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    want_prompt = [s.logprob_start_len >= 0 and s.input_logprobs is None and not s.output_ids for s in active]
    cache = DynamicCache()
    # routing is recorded only when some sequence asked (the hooks cost a copy per layer)
    recorder = RoutingRecorder(model) if any(s.return_routed_experts for s in active) else None
    with recorder.capture() if recorder else contextlib.nullcontext():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=0 if any(want_prompt) else 1)
    if recorder:
        routed = recorder.take(len(active))  # [B, L_pad, layers, k], left-padded like ids
        for row, s in enumerate(active):  # a resumed sequence is re-prefilled: start afresh
            s.routed_blocks = [routed[row, ids.shape[1] - len(s.prompt_ids) - len(s.output_ids):]]
    for row, s in enumerate(active):
        if want_prompt[row]:
            own = out.logits[row, ids.shape[1] - len(s.prompt_ids):]
            s.input_logprobs = prompt_logprobs(own, s.prompt_ids, s.logprob_start_len, s.params.temperature)
    last_logits = out.logits[:, -1]
    for s in active:  # max_new_tokens == 0 with prompt log-probs: the prefill was all it needed
        if s.params.max_new_tokens == 0:
            s.finish({"type": "length", "length": 0}, weight_version())
    temperature = torch.tensor([s.params.temperature for s in active], device=device)
    top_k = torch.tensor([s.params.top_k for s in active], device=device)
    top_p = torch.tensor([s.params.top_p for s in active], device=device)
    min_p = torch.tensor([s.params.min_p for s in active], device=device)
    rows = list(active)  # rows[i] is the sequence in row i of the cache
    while True:
        uniforms = draw_uniforms([s.generator for s in rows], shared_generator).to(device)
        tokens, logprobs = sample_next(last_logits, temperature, top_k, top_p, min_p, uniforms)
        for s, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
            if s.finished:
                continue
            s.output_ids.append(token)
            s.output_logprobs.append(logprob)
            reason = finish_reason_for(s, token, eos_ids, max_context)
            if reason is not None:
                s.finish(reason, weight_version())
        if all(s.finished for s in rows):
            return []
        action = control()
        if action == WaveStep.ABORT:
            for s in rows:
                if not s.finished:
                    s.finish({"type": "abort", "message": "generation paused (mode=abort)"}, weight_version())
            return []
        if action == WaveStep.RETRACT:
            return [s for s in rows if not s.finished]
        num_done = sum(s.finished for s in rows)
        if num_done * 4 >= len(rows):  # drop finished rows once they are a quarter of the batch
            keep = [i for i, s in enumerate(rows) if not s.finished]
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            rows = [rows[i] for i in keep]
            mask, positions, tokens = mask[index], positions[index], tokens[index]
            temperature, top_k, top_p, min_p = temperature[index], top_k[index], top_p[index], min_p[index]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        with recorder.capture() if recorder else contextlib.nullcontext():
            out = model(input_ids=tokens.unsqueeze(1), attention_mask=mask, position_ids=positions,
                        past_key_values=cache, use_cache=True)
        if recorder:
            routed = recorder.take(len(rows))  # [B, 1, layers, k]
            for row, s in enumerate(rows):
                s.routed_blocks.append(routed[row])
        last_logits = out.logits[:, -1]
