"""Score a batch of responses: the weighted sum of the configured reward functions.

A reward function that raises, or returns anything but a finite real number, stops the run
with a one-line ``RewardError`` naming the function and the sample: training on a silently
defaulted reward would hide a broken grader behind a plausible-looking curve.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from megatron_grpo.rewards.registry import RewardFn, resolve_reward


class RewardError(ValueError):
    """A reward function failed on a sample; ``str(e)`` is one line naming it and the sample."""


@dataclass
class ScoredBatch:
    """Rewards of one batch of responses."""

    rewards: list[float]
    """Weighted sum per response, shape [batch]."""

    per_function: dict[str, list[float]]
    """Unweighted value of each function per response (label -> [batch]), for logging."""


class RewardScorer:
    """``RewardScorer(config.reward)``; ``score(responses, answers)`` -> ScoredBatch."""

    def __init__(self, reward_cfg):
        self.functions: list[tuple[str, RewardFn, float, dict]] = []
        names = [f.name for f in reward_cfg.functions]
        for i, f in enumerate(reward_cfg.functions):
            fn = resolve_reward(f.name, f.kwargs, i)
            label = f.name if names.count(f.name) == 1 else f"{f.name}[{i}]"
            self.functions.append((label, fn, float(f.weight), dict(f.kwargs)))

    @property
    def labels(self) -> list[str]:
        """Metric label of each function (its name, or ``name[i]`` when a name repeats)."""
        return [label for label, *_ in self.functions]

    def score(self, responses: list[str], answers: list[str]) -> ScoredBatch:
        """Rewards of ``responses[j]`` against ``answers[j]``; RewardError on a bad function result."""
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses but {len(answers)} answers")  # caller bug
        per_function: dict[str, list[float]] = {}
        totals = [0.0] * len(responses)
        for i, (label, fn, weight, kwargs) in enumerate(self.functions):
            values = []
            for j, (response, answer) in enumerate(zip(responses, answers)):
                where = f"reward.functions[{i}] ({label})"
                try:
                    value = fn(response, answer, **kwargs)
                except Exception as e:
                    msg = " ".join(str(e).split())[:200]
                    raise RewardError(f"{where} raised on sample {j}: {type(e).__name__}: {msg}") from e
                if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                    raise RewardError(
                        f"{where} returned {str(value)[:60]!r} ({type(value).__name__}) for sample {j}; "
                        "a reward must be a finite number"
                    )
                values.append(float(value))
                totals[j] += weight * float(value)
            per_function[label] = values
        return ScoredBatch(rewards=totals, per_function=per_function)
