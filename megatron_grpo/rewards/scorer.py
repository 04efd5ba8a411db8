"""Score a batch of responses: the weighted sum of the configured reward functions.

A reward function that raises, or returns anything but a finite real number, stops the run
with a one-line ``RewardError`` naming the function and the sample: training on a silently
defaulted reward would hide a broken grader behind a plausible-looking curve.

The calls of a batch run on the scorer's own event loop (``rewards/calling.py`` says how
each function is called): async functions overlap, at most ``max_concurrency`` calls of one
function at a time; the functions themselves are scored one after the other.
"""

from __future__ import annotations

import asyncio
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from megatron_grpo.rewards.calling import RewardCall, bounded_gather, resolve
from megatron_grpo.rewards.registry import resolve_reward
from megatron_grpo.rewards.sample import RewardSample


class RewardError(ValueError):
    """A reward function failed on a sample; ``str(e)`` is one line naming it and the sample."""


@dataclass
class ScoredBatch:
    """Rewards of one batch of responses."""

    rewards: list[float]
    """Weighted sum per response, shape [batch]."""

    per_function: dict[str, list[float]]
    """Unweighted value of each function per response (label -> [batch]), for logging."""

    stats: dict[str, float] = field(default_factory=dict)
    """Counters of the functions that keep some (``<label>/retries`` of a remote reward,
    ``<label>/timeouts`` of ``math_verify`` and ``reasoning_gym``)."""


@dataclass(frozen=True)
class _Function:
    label: str
    where: str
    call: RewardCall
    weight: float
    max_concurrency: int


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"


def _check_value(value: Any, where: str, j: int) -> float:
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise RewardError(f"{where} returned {str(value)[:60]!r} ({type(value).__name__}) for sample {j}; "
                          "a reward must be a finite number")
    return float(value)


class RewardScorer:
    """``RewardScorer(config.reward)``; ``score_samples(samples)`` (or ``score(responses,
    answers)``) -> ScoredBatch; ``close()`` when done."""

    def __init__(self, reward_cfg):
        self.functions: list[_Function] = []
        for i, (f, label) in enumerate(zip(reward_cfg.functions, reward_cfg.labels)):
            call = resolve_reward(f, i)
            self.functions.append(_Function(label, f"reward.functions[{i}] ({f.name})", call, float(f.weight),
                                            f.max_concurrency))
        self._loop = asyncio.new_event_loop()

    @property
    def labels(self) -> list[str]:
        """Metric label of each function (``RewardConfig.labels``: ``reward/<label>`` in metrics)."""
        return [f.label for f in self.functions]

    def score(self, responses: list[str], answers: list[str]) -> ScoredBatch:
        """Rewards of ``responses[j]`` against ``answers[j]`` (samples with only those two fields)."""
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")  # caller bug
        return self.score_samples([RewardSample(prompt="", response=r, answer=a) for r, a in zip(responses, answers)])

    def score_samples(self, samples: list[RewardSample]) -> ScoredBatch:
        """Rewards of ``samples``; RewardError on a bad function result."""
        per_function: dict[str, list[float]] = {}
        stats: dict[str, float] = {}
        totals = [0.0] * len(samples)
        for f in self.functions:
            values = self._loop.run_until_complete(self._values(f, samples))
            for j, v in enumerate(values):
                totals[j] += f.weight * v
            per_function[f.label] = values
            pop_stats = getattr(f.call.fn, "pop_stats", None)
            if pop_stats is not None:
                stats.update({f"{f.label}/{k}": v for k, v in pop_stats().items()})
        return ScoredBatch(rewards=totals, per_function=per_function, stats=stats)

    async def _values(self, f: _Function, samples: list[RewardSample]) -> list[float]:
        if f.call.batch:
            try:
                values = list(await resolve(f.call.call_batch(samples)))
            except Exception as e:
                raise RewardError(f"{f.where} raised on a batch of {len(samples)}: {_one_line(e)}") from e
            if len(values) != len(samples):
                raise RewardError(f"{f.where} returned {len(values)} values for {len(samples)} samples; "
                                  "a batch function returns one number per sample")
            return [_check_value(v, f.where, j) for j, v in enumerate(values)]

        async def one(j: int) -> float:
            try:
                value = await resolve(f.call.call_one(samples[j]))
            except Exception as e:
                raise RewardError(f"{f.where} raised on sample {j}: {_one_line(e)}") from e
            return _check_value(value, f.where, j)

        return await bounded_gather([lambda j=j: one(j) for j in range(len(samples))], f.max_concurrency)

    def close(self) -> None:
        """Close what the functions hold open (a remote reward's connections) and the loop."""
        if self._loop.is_closed():
            return
        for f in self.functions:
            aclose = getattr(f.call.fn, "aclose", None)
            if aclose is not None:
                self._loop.run_until_complete(aclose())
        self._loop.close()
