"""The `eval` section: held-out sets scored during training and by `megatron-grpo eval`."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Optional

from megatron_grpo.config.base import check

SET_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(kw_only=True)
class EvalSetConfig:
    name: str
    """Name of the set in the metric keys (`eval/<name>/pass@1`): letters, digits, `_ . -`."""

    path: str
    """Held-out prompts (.jsonl or .parquet) with the same prompt/answer keys and chat template
    as `data` (relative to the current directory)."""

    n: int = 1
    """Responses per prompt (pass@k needs n >= k)."""

    temperature: float = 0.0
    """Sampling temperature; 0 = greedy (then n must be 1)."""

    max_new_tokens: Optional[int] = None
    """Tokens generated per response (default: rollout.max_new_tokens)."""

    max_samples: Optional[int] = None
    """Evaluate only the first N prompts of the file (null = all)."""

    single_turn: bool = False
    """Generate each response with one engine call even when the run has episodes.kind
    (an environment, an agent or a rollout function). false: the set's responses are episodes generated as the
    training rollouts are, so pass@k measures tool use (docs/multi_turn.md)."""

    def __post_init__(self):
        check(bool(SET_NAME_RE.match(self.name)), "name",
              f"must be letters, digits, '_', '.' or '-' (it is part of metric keys), got {self.name!r}")
        check(self.path.endswith((".jsonl", ".parquet")), "path", f"must end in .jsonl or .parquet, got {self.path!r}")
        check(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
              f"must be >= 0 (0 = greedy), got {self.temperature}")
        check(self.temperature > 0 or self.n == 1, "n",
              f"is {self.n} with greedy decoding (temperature 0), which repeats one response; use n: 1 or a temperature > 0")
        check(self.max_new_tokens is None or self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1 or null")
        check(self.max_samples is None or self.max_samples >= 1, "max_samples", "must be >= 1 or null")


@dataclass(kw_only=True)
class EvalConfig:
    sets: list[EvalSetConfig] = field(default_factory=list)
    """Held-out sets; empty = no evaluation."""

    every_n_steps: int = 0
    """Evaluate after every N-th step (0 = only at the end, see `at_end`)."""

    at_end: bool = True
    """Evaluate after the last step."""

    at_start: bool = False
    """Evaluate the starting weights before step 1 (logged as step 0; not on a resumed run,
    whose metrics.jsonl already holds it): the baseline a learning curve is read against."""

    pass_k: list[int] = field(default_factory=lambda: [1])
    """k values of pass@k (unbiased estimator); a set reports those with k <= its n, and each k
    must be reported by one set at least (k <= the largest n)."""

    correct_function: Optional[str] = None
    """Label of the reward function that decides whether a response is correct (its value >=
    `correct_threshold`); null = the first of reward.functions. With episodes.kind environment or
    agent it may be `environment`: an evaluation episode's reward from the environment."""

    correct_threshold: float = 1.0
    """A response is correct when the deciding function's value is at least this."""

    prompts_per_round: int = 64
    """Prompts generated per round; the other ranks wait for one round at a time (each round
    must fit in parallel.distributed_timeout_s, like a rollout)."""

    def __post_init__(self):
        names = [s.name for s in self.sets]
        dup = next((n for n in names if names.count(n) > 1), None)
        check(dup is None, "sets", f"set name {dup!r} appears twice")
        check(self.every_n_steps >= 0, "every_n_steps", f"must be >= 0, got {self.every_n_steps}")
        check(bool(self.pass_k) and all(k >= 1 for k in self.pass_k), "pass_k", f"must be k values >= 1, got {self.pass_k}")
        check(len(set(self.pass_k)) == len(self.pass_k), "pass_k", f"has a repeated k: {self.pass_k}")
        # a k above every set's n was left out of the metrics without a word (issue 64)
        unreported = [k for k in self.pass_k if self.sets and k > max(s.n for s in self.sets)]
        check(not unreported, "pass_k",
              f"{unreported[0] if unreported else ''} is more than the responses per prompt of every set "
              f"({', '.join(f'{s.name}: n {s.n}' for s in self.sets)}): pass@k needs n >= k; raise a set's n or "
              "drop that k")
        check(math.isfinite(self.correct_threshold), "correct_threshold", "must be a finite number")
        check(self.prompts_per_round >= 1, "prompts_per_round", f"must be >= 1, got {self.prompts_per_round}")

    def due(self, step: int, num_steps: int) -> bool:
        """Whether to evaluate after ``step`` (1-based) of a ``num_steps`` run."""
        if not self.sets:
            return False
        return bool((self.every_n_steps and step % self.every_n_steps == 0) or (self.at_end and step == num_steps))
