"""The sequences the embedded engine generates, and the small pure helpers of generation.

``Sequence`` is one response being generated (one item of a /generate request times ``n``);
``left_pad`` builds a prefill batch (LEFT padding, attention mask, explicit position ids
``cumsum(mask) - 1``, so every real token sees exactly the positions and keys it would see
alone); ``prompt_logprobs`` and ``finish_reason_for`` follow SGLang's semantics. The decode
loop that schedules sequences is ``scheduler.py``; the KV-cache batch it runs is ``batch.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatron_grpo.inference.sampling import ResolvedSampling


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
    output_versions: list[str] = field(default_factory=list)
    """Per output token, the weight version whose logits it was drawn from (a weight update
    between two tokens of a retracted sequence shows here; ``output_logprobs`` are that
    version's)."""
    input_logprobs: Optional[list[Optional[float]]] = None
    return_sampling_mask: bool = False
    """Also report each draw's kept set and log kept mass (``sampling.sample_tokens``)."""
    max_kept: int = 0
    """Kept sets longer than this are not sent (their log kept mass is)."""
    output_kept_ids: list[Optional[list[int]]] = field(default_factory=list)
    output_log_kept_mass: list[float] = field(default_factory=list)
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
