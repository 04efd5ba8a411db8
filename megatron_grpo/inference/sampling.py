"""Sampling with SGLang 0.5.23's semantics (its pure-torch sampler), as small pure functions.

* ``temperature < 1e-6`` means greedy: SGLang rewrites it to ``temperature = 1, top_k = 1``,
  so a greedy request's log-probs are the raw ``log_softmax(logits)``.
* ``top_k = -1`` means all tokens.
* the token is drawn from softmax(logits / T) after zeroing, in descending-probability order,
  ranks ``>= top_k``, tokens whose *exclusive* cumulative mass exceeds ``top_p``, and tokens
  below ``min_p`` times the top probability (SGLang's ``top_k_top_p_min_p_sampling_from_probs_torch``).
* the returned log-prob is ``log_softmax(logits / T)`` of the drawn token, computed BEFORE the
  top-k/top-p filtering (what SGLang reports, and what the trainer must score).

With ``return_sampling_mask`` (this engine's extension of SGLang's /generate) the engine also
reports each draw's kept set ``K`` -- the ids the draw could pick, in the order the draw sorted
them -- and ``log sum_K p``, the log of the kept mass under softmax(logits / T): the trainer
then scores ``log q = log p - log sum_K p`` over the same set (sampling-mask replay, see
docs/loss_spec.md). The set is the engine's own, never rebuilt by the trainer from a threshold
on its (slightly different) logits. A set longer than the request's budget is not sent (None);
its log kept mass still is.

Randomness comes from one uniform number per row (inverse-CDF sampling), and whether a row
draws over the sorted, filtered probabilities or the plain vocabulary depends on its own
parameters only, so a sequence with its own seeded generator draws the same tokens whatever else
is in the batch, and whether or not kept sets are asked for. ``draw_on_device`` is the draw
without any host read (the static decode path, ``static_decode.py``, captures it in a CUDA graph);
``sample_tokens`` (the eager scheduler's) is the same draw plus the host's reading of the kept sets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30
INT64_MAX = 2**63 - 1  # seeds, top_k and token ids go into int64 tensors and generators
FLOAT32_MAX = float(torch.finfo(torch.float32).max)

# SGLang sampling_params keys, with the values this engine supports. Unsupported keys are
# accepted only at their SGLang default (so SGLang-shaped requests pass), anything else is
# a 400 naming the key.
_UNSUPPORTED_DEFAULTS = {
    "stop": None,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
}
_IGNORED = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval"}


@dataclass(kw_only=True)
class ResolvedSampling:
    """Sampling parameters of one sequence after SGLang's normalisation."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    n: int = 1
    seed: Optional[int] = None
    skip_special_tokens: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.top_k == 1


def _number(raw: dict, key: str, default: float, accepts: Callable[[float], bool], accepted: str) -> float:
    """``raw[key]`` as a finite float for which ``accepts`` holds (``accepted`` says which)."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"sampling_params.{key} must be a number {accepted}, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an integer past float's range
        value = math.inf
    if not math.isfinite(value) or not accepts(value):
        raise ValueError(f"sampling_params.{key} must be a finite number {accepted}, got {value!r}")
    return value


def _integer(raw: dict, key: str, default: Optional[int], low: int, *, accepted: str = "") -> Optional[int]:
    """``raw[key]`` as an int in [low, 2**63-1] (what torch's int64 tensors and generators take)."""
    value = raw.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= INT64_MAX:
        raise ValueError(f"sampling_params.{key} must be {accepted or f'an integer in [{low}, 2**63-1]'}, "
                         f"got {value!r}")
    return value


def _flag(raw: dict, key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"sampling_params.{key} must be true or false, got {value!r}")
    return value


def resolve_sampling_params(raw: Optional[dict]) -> ResolvedSampling:
    """SGLang ``sampling_params`` dict -> ResolvedSampling. A ValueError names the bad key and
    what it accepts: every value is type-checked and range-checked here, so nothing a request
    sends reaches torch (int64 tensors, generator seeds) out of range, or as inf or nan."""
    if raw is not None and not isinstance(raw, dict):
        raise ValueError(f"sampling_params must be a JSON object (or a list of one per input), got {raw!r:.80}")
    raw = dict(raw or {})
    known = {"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop_token_ids",
             "ignore_eos", "n", "sampling_seed"} | set(_UNSUPPORTED_DEFAULTS) | _IGNORED
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"sampling_params: unknown key(s) {unknown}")
    for key, default in _UNSUPPORTED_DEFAULTS.items():
        if key in raw and raw[key] not in (default, [], {}):
            raise ValueError(f"sampling_params.{key}={raw[key]!r} is not supported by the embedded engine")
    # at most float32's largest: the sampler divides float32 logits by it
    temperature = _number(raw, "temperature", 1.0, lambda t: 0 <= t <= FLOAT32_MAX,
                          "in [0, 3.4e38] (below 1e-6: greedy)")
    top_p = _number(raw, "top_p", 1.0, lambda p: 0 < p <= 1, "in (0, 1]")
    top_k = _integer(raw, "top_k", -1, -1, accepted="-1 (all tokens) or an integer in [1, 2**63-1]")
    if top_k == 0:
        raise ValueError("sampling_params.top_k must be -1 (all tokens) or an integer in [1, 2**63-1], got 0")
    min_p = _number(raw, "min_p", 0.0, lambda p: 0 <= p <= 1, "in [0, 1]")
    max_new_tokens = _integer(raw, "max_new_tokens", 128, 0)
    n = _integer(raw, "n", 1, 1)
    seed = _integer(raw, "sampling_seed", None, 0)
    stop_token_ids = raw.get("stop_token_ids")
    stop_token_ids = [] if stop_token_ids is None else stop_token_ids
    if not isinstance(stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX for t in stop_token_ids):
        raise ValueError("sampling_params.stop_token_ids must be a list of token ids (integers in "
                         f"[0, 2**63-1]), got {raw.get('stop_token_ids')!r:.80}")
    ignore_eos = _flag(raw, "ignore_eos", False)
    skip_special_tokens = _flag(raw, "skip_special_tokens", True)
    _flag(raw, "spaces_between_special_tokens", True)  # accepted and ignored, but well-formed
    _flag(raw, "no_stop_trim", False)
    if raw.get("stream_interval") is not None:
        _integer(raw, "stream_interval", None, 1)
    if top_k == -1:
        top_k = TOP_K_ALL
    if temperature < SAMPLING_EPS:  # SGLang: greedy = top-1 at temperature 1
        temperature, top_k = 1.0, 1
    return ResolvedSampling(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_new_tokens=max_new_tokens,
        stop_token_ids=frozenset(stop_token_ids),
        ignore_eos=ignore_eos,
        n=n,
        seed=seed,
        skip_special_tokens=skip_special_tokens,
    )


def scaled_logprobs(logits_BV: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) in float32: [B, V] -> [B, V]."""
    return torch.log_softmax(logits_BV.float() / temperature_B.float().unsqueeze(1), dim=-1)


def filter_sorted_probs(probs_sorted_BV: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor,
                        min_p_B: torch.Tensor) -> torch.Tensor:
    """Zero the filtered tail of descending-sorted probabilities (SGLang's rule). [B, V] -> [B, V].

    ``masked_fill``, not boolean-index assignment: the latter may read the mask on the host,
    which a CUDA graph cannot capture."""
    exclusive_cumsum = probs_sorted_BV.cumsum(dim=-1) - probs_sorted_BV
    ranks = torch.arange(probs_sorted_BV.shape[-1], device=probs_sorted_BV.device).unsqueeze(0)
    probs = probs_sorted_BV.masked_fill(ranks >= top_k_B.unsqueeze(1), 0.0)
    probs = probs.masked_fill(exclusive_cumsum > top_p_B.unsqueeze(1), 0.0)
    return probs.masked_fill(probs < (probs_sorted_BV[:, :1] * min_p_B.unsqueeze(1)), 0.0)


def inverse_cdf(probs_BV: torch.Tensor, uniform_B: torch.Tensor) -> torch.Tensor:
    """Column drawn from each row of unnormalised non-negative weights: [B, V], [B] -> [B].

    The column is the first whose cumulative weight exceeds ``u * total``; zero-weight
    columns are never drawn.
    """
    cdf = probs_BV.double().cumsum(dim=-1)
    target = uniform_B.double().unsqueeze(1) * cdf[:, -1:]
    col = torch.searchsorted(cdf, target, right=True).squeeze(1)
    last_nonzero = probs_BV.shape[-1] - 1 - (probs_BV.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(col, last_nonzero)


@dataclass
class Truncation:
    """What each row's draw could pick (see the module docstring)."""

    kept_ids: list[Optional[list[int]]]
    """Per row: the kept ids in descending-probability order, or None when over the budget."""
    log_kept_mass: list[float]
    """Per row: log of the kept ids' total probability under softmax(logits / T) (<= 0)."""


@dataclass
class Draw:
    tokens: torch.Tensor
    """int64 [B]."""
    logprobs: torch.Tensor
    """float32 [B]: log softmax(logits / T) of the token, unfiltered (SGLang's definition)."""
    truncation: Optional[Truncation] = None
    """With ``with_kept`` only."""


@dataclass
class DeviceDraw:
    """``draw_on_device``'s answer: every field a tensor on the logits' device (no host read)."""

    tokens: torch.Tensor
    """int64 [B]."""
    logprobs: torch.Tensor
    """float32 [B]: log softmax(logits / T) of the token, unfiltered."""
    num_kept: Optional[torch.Tensor] = None
    """int64 [B]: size of each row's kept set (with ``kept_width > 0`` only)."""
    log_kept_mass: Optional[torch.Tensor] = None
    """float64 [B]: log of the kept set's mass under softmax(logits / T)."""
    kept_ids: Optional[torch.Tensor] = None
    """int64 [B, min(kept_width, V)]: the first ids of each row's kept set (a prefix of the
    descending order; only the first ``num_kept`` of a row are its set)."""


def filtering_rows(top_k_B: torch.Tensor, top_p_B: torch.Tensor, min_p_B: torch.Tensor,
                   vocab_size: int) -> torch.Tensor:
    """bool [B]: the rows whose top-k/top-p/min-p can cut a token (drawn from the sorted order).
    Also one row's answer (a Python bool) from its scalar parameters."""
    return (top_k_B < vocab_size) | (top_p_B < 1.0) | (min_p_B > 0)


def kept_set_width(max_kept: int, vocab_size: int) -> int:
    """Kept ids stored per row and draw for a kept-set budget of ``max_kept`` (at least one, at
    most the vocabulary): the draw's ``kept_width``."""
    return min(max(max_kept, 1), vocab_size)


def draw_on_device(logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor,
                   top_p_B: torch.Tensor, min_p_B: torch.Tensor, uniform_B: torch.Tensor, *,
                   sorts: bool, kept_width: int = 0) -> DeviceDraw:
    """One token per row from logits [B, V] with no host synchronisation (capturable in a CUDA
    graph); ``sample_tokens`` is this plus the host's reading of the kept sets.

    Each row's draw depends on its own row only (so a seeded row draws the same token whatever
    else is in the batch): a row that filters (``filtering_rows``) draws by inverse CDF over the
    descending-sorted, filtered probabilities; any other row over the unsorted vocabulary;
    greedy rows (``top_k == 1``) take the argmax. ``sorts`` (decided by the caller from
    parameters it knows): sort at all -- required when any row filters or ``kept_width > 0``.
    ``kept_width > 0``: also each row's kept set (its first ``kept_width`` ids), size and mass.
    """
    assert sorts or kept_width == 0, "kept sets come from the sorted order"
    logprobs_BV = scaled_logprobs(logits_BV, temperature_B)
    probs_BV = logprobs_BV.exp()
    tokens = inverse_cdf(probs_BV, uniform_B)
    num_kept = log_kept_mass = kept_ids = None
    if sorts:
        sorted_probs, order = probs_BV.sort(dim=-1, descending=True)
        kept = filter_sorted_probs(sorted_probs, top_k_B, top_p_B, min_p_B)
        drawn_sorted = order.gather(1, inverse_cdf(kept, uniform_B).unsqueeze(1)).squeeze(1)
        tokens = torch.where(filtering_rows(top_k_B, top_p_B, min_p_B, probs_BV.shape[-1]), drawn_sorted, tokens)
        if kept_width > 0:
            num_kept = (kept > 0).sum(dim=-1)
            log_kept_mass = kept.double().sum(dim=-1).log()
            kept_ids = order[:, :kept_width]
    greedy = top_k_B == 1
    tokens = torch.where(greedy, logits_BV.argmax(dim=-1), tokens)
    logprobs = logprobs_BV.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if kept_width > 0:  # a greedy row's set is its token (argmax may break a tie unlike the sort)
        num_kept = torch.where(greedy, torch.ones_like(num_kept), num_kept)
        log_kept_mass = torch.where(greedy, logprobs.double(), log_kept_mass)
        first = torch.where(greedy, tokens, kept_ids[:, 0]).unsqueeze(1)
        kept_ids = torch.cat([first, kept_ids[:, 1:]], dim=1)
    return DeviceDraw(tokens, logprobs, num_kept, log_kept_mass, kept_ids)


def kept_sets(num_kept: list[int], kept_ids_BW: torch.Tensor, max_kept: int) -> list[Optional[list[int]]]:
    """Host side of ``DeviceDraw``'s kept sets: each row's ids, None when over ``max_kept``.

    Only the ``num_kept`` ids of the rows that send a set become lists: an unfiltered row's set
    is the whole vocabulary (None), and reading all ``[B, W]`` ids every token (W = max_kept,
    1024 by default) would cost the eager loop more than the draw."""
    return [kept_ids_BW[b, :n].tolist() if n <= max_kept else None for b, n in enumerate(num_kept)]


def sample_tokens(logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor,
                  top_p_B: torch.Tensor, min_p_B: torch.Tensor, uniform_B: torch.Tensor, *,
                  with_kept: bool = False, max_kept: int = 0) -> Draw:
    """Draw one token per row from logits [B, V]; with ``with_kept`` also each row's kept set
    (at most ``max_kept`` ids sent) and log kept mass.

    ``top_k_B == 1`` rows are greedy (argmax of the logits; their kept set is that token).
    The log-prob is that of the temperature-scaled, unfiltered distribution (see the module
    docstring). The draw is ``draw_on_device``'s; this reads whether to sort, and the kept
    sets, on the host.
    """
    vocab_size = logits_BV.shape[-1]
    sorts = with_kept or bool(filtering_rows(top_k_B, top_p_B, min_p_B, vocab_size).any())
    draw = draw_on_device(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B, uniform_B,
                          sorts=sorts, kept_width=kept_set_width(max_kept, vocab_size) if with_kept else 0)
    truncation = None
    if with_kept:
        truncation = Truncation(kept_ids=kept_sets(draw.num_kept.tolist(), draw.kept_ids, max_kept),
                                log_kept_mass=draw.log_kept_mass.tolist())
    return Draw(draw.tokens, draw.logprobs, truncation)


def sample_next(logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_k_B: torch.Tensor,
                top_p_B: torch.Tensor, min_p_B: torch.Tensor,
                uniform_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample_tokens`` without kept sets: (token ids [B] int64, log-probs [B] float32)."""
    draw = sample_tokens(logits_BV, temperature_B, top_k_B, top_p_B, min_p_B, uniform_B)
    return draw.tokens, draw.logprobs


def draw_uniforms(generators: list[Optional[torch.Generator]], shared: torch.Generator) -> torch.Tensor:
    """One U[0,1) per row: from the row's own generator when seeded, else from ``shared``."""
    num_unseeded = sum(g is None for g in generators)
    shared_draws = iter(torch.rand(num_unseeded, generator=shared, dtype=torch.float64).tolist())
    return torch.tensor(
        [next(shared_draws) if g is None else float(torch.rand(1, generator=g, dtype=torch.float64))
         for g in generators],
        dtype=torch.float64,
    )
