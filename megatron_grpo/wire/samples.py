"""What the trainer sends to and gets back from a rollout engine, independent of which engine.

``SamplingParams`` mirrors the subset of SGLang's ``sampling_params`` that GRPO uses;
``Sample`` is one generated response in the trainer's terms (token ids and the engine's
log-probs of them). ``RolloutError`` is the one exception the client raises: its message is
one line naming the server and the route.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


class RolloutError(RuntimeError):
    """A rollout server request failed: ``"<server> <METHOD> <route>: <what happened>"``."""

    def __init__(self, server: str, route: str, message: str, *, status: Optional[int] = None):
        self.server = server
        self.route = route
        self.status = status
        super().__init__(f"rollout server {server} {route}: {message}")


@dataclass(kw_only=True)
class SamplingParams:
    """Per-request sampling parameters, SGLang semantics (``temperature < 1e-6`` is greedy)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_mask_max_kept: int = 0
    """> 0: ask the engine for each draw's kept set (at most this many ids per position) and
    log kept mass, for sampling-mask replay (the embedded engine's extension; 0: not asked)."""

    def to_json(self, *, sampling_seed: Optional[int] = None) -> dict[str, Any]:
        """The ``sampling_params`` dict of one /generate item (n is expanded by the client)."""
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "max_new_tokens": self.max_new_tokens,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if sampling_seed is not None:
            out["sampling_seed"] = sampling_seed
        return out

    @classmethod
    def from_rollout_config(cls, rollout_cfg) -> "SamplingParams":
        """The sampling parameters of a ``RolloutConfig`` (kept sets asked for when it
        truncates and replays the sampling mask)."""
        replay = rollout_cfg.sampling_mask_replay and rollout_cfg.truncates
        return cls(
            temperature=rollout_cfg.temperature,
            top_p=rollout_cfg.top_p,
            top_k=rollout_cfg.top_k,
            min_p=rollout_cfg.min_p,
            max_new_tokens=rollout_cfg.max_new_tokens,
            stop_token_ids=list(rollout_cfg.stop_token_ids),
            sampling_mask_max_kept=rollout_cfg.sampling_mask_max_kept if replay else 0,
        )


@dataclass(kw_only=True)
class Sample:
    """One response. ``output_logprobs[i]`` is the engine's log-prob of ``output_ids[i]``
    under log_softmax(logits / temperature) (SGLang's definition), float32 precision."""

    prompt_index: int
    """Index of the prompt in the ``generate`` call."""
    sample_index: int
    """Index of this response among the prompt's ``n``."""
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    """``stop`` (EOS or a stop id, which is the last output token), ``length`` or ``abort``."""
    weight_version: str
    """The engine's weight version when the response finished (the trainer step after a sync)."""
    server: str = ""
    """URL of the server that generated it."""
    routed_experts: Optional[Any] = None
    """Only when requested (router replay): the engine's MoE routing, int32 tensor
    [prompt + response - 1, num_moe_layers * k] (``wire.routed_experts``)."""
    kept_ids: Optional[list[Optional[list[int]]]] = None
    """Only when requested (sampling-mask replay): per output token, the ids its draw could
    pick (the engine's top-k/top-p/min-p kept set, holding the token), or None where the set
    was over the request's budget and not sent."""
    log_kept_mass: Optional[list[float]] = None
    """With ``kept_ids``: per output token, log of the kept set's probability under the
    unfiltered distribution (0 when nothing was cut)."""
    output_versions: Optional[list[Optional[str]]] = None
    """Per output token, the weight version that drew it (its ``output_logprobs`` entry is
    that version's behaviour log-prob): the embedded engine's ``output_token_versions``
    (rollout.mode async, where a weight update may fall between two tokens of one response);
    None where the engine does not report them; None entries for observation tokens."""
    output_mask: Optional[list[int]] = None
    """Multi-turn episodes: 1 where ``output_ids[i]`` is a model token (the engine's, with its
    log-prob), 0 where it is an observation token (context: log-prob 0, no loss). None: every
    output token is the model's."""

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)
