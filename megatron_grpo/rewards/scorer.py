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
import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from megatron_grpo.rewards.calling import RewardCall, bounded_gather, resolve
from megatron_grpo.rewards.local import (DEFAULT_TIMEOUT_S, PluginRaised, PluginStopped, WorkerCall, as_scalar,
                                         is_async)
from megatron_grpo.rewards.registry import is_user_function, resolve_reward
from megatron_grpo.rewards.sample import RewardSample
from megatron_grpo.runtime.errors import one_line


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
    call: RewardCall | WorkerCall
    weight: float
    max_concurrency: int
    timeout_s: float | None = None
    """Deadline of an in-process call (a user's async function: cancelled past it)."""


def _failure_line(e: BaseException) -> str:
    if isinstance(e, PluginRaised):  # already the worker's one line of the function's exception
        return str(e)
    return one_line(e, 200)


def _exit_stopped(code: Any) -> PluginStopped:
    return PluginStopped(f"called sys.exit({code!r})", "; a reward function returns a number, it does not end "
                         "the run")


class _Exited(Exception):
    """SystemExit inside a task, carried as an Exception: asyncio would let a SystemExit end the
    loop (and the rank, with exit code 0)."""

    def __init__(self, code: Any):
        self.code = code


async def _guarded(value: Any) -> Any:
    try:
        return await resolve(value)
    except SystemExit as e:
        raise _Exited(e.code) from None


async def _call(f: _Function, value: Any) -> Any:
    """``value`` (a call's result, or its awaitable) awaited under ``f``'s deadline; past it, or
    on a ``sys.exit``, a ``PluginStopped`` (the function's own TimeoutError stays its own)."""
    try:
        if f.timeout_s is None or not inspect.isawaitable(value):
            return await _guarded(value)
        task = asyncio.ensure_future(_guarded(value))
        try:
            done, _ = await asyncio.wait({task}, timeout=f.timeout_s)
        finally:
            if not task.done():  # past the deadline, or this call was cancelled (another one failed)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)  # its finally blocks run now, in this loop
        if not done:
            raise PluginStopped(f"took longer than {f.timeout_s:g}s", f" ({f.where.split()[0]}.timeout_s); the "
                                "call was cancelled")
        return task.result()
    except _Exited as e:
        raise _exit_stopped(e.code) from None


def _started(f: _Function, start) -> Any:
    """``start()`` (the call), a plain function's ``sys.exit`` caught as ``_call`` does."""
    try:
        return start()
    except SystemExit as e:
        raise _exit_stopped(e.code) from None


def _shown(value: Any) -> str:
    """The value in a one-line error; never raises (a user's ``__str__`` may)."""
    try:
        return repr(str(value)[:60])
    except ValueError:  # an int past Python's digit limit cannot even be printed
        return f"an integer of {value.bit_length()} bits" if isinstance(value, int) else "a value"
    except Exception:  # noqa: BLE001 - the user's object
        return "a value that cannot be printed"


def _check_value(value: Any, where: str, j: int) -> float:
    value = as_scalar(value)
    try:  # float(10**400) overflows: not a finite number either (nor is a Real whose float() raises)
        finite = isinstance(value, numbers.Real) and math.isfinite(float(value))
    except Exception:  # noqa: BLE001 - the user's object
        finite = False
    if not finite:
        raise RewardError(f"{where} returned {_shown(value)} ({type(value).__name__}) for sample {j}; "
                          "a reward must be a finite number")
    return float(value)


def _values_of_batch(result: Any, where: str, count: int) -> list:
    """A batch function's result as a list; RewardError when it is not a sequence (a single number
    was reported as the function raising ``TypeError: 'float' object is not iterable``)."""
    result = as_scalar(result)
    if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__iter__"):
        raise RewardError(f"{where} returned {_shown(result)} ({type(result).__name__}) for a batch of {count}; "
                          "a batch function returns one number per sample")
    return list(result)


class RewardScorer:
    """``RewardScorer(config.reward)``; ``score_samples(samples)`` (or ``score(responses,
    answers)``) -> ScoredBatch; ``close()`` when done."""

    def __init__(self, reward_cfg):
        self.functions: list[_Function] = []
        for i, (f, label) in enumerate(zip(reward_cfg.functions, reward_cfg.labels)):
            call, timeout_s = resolve_reward(f, i), None
            if is_user_function(f.name):  # the user's code: a deadline (rewards/local.py)
                timeout_s = f.timeout_s or DEFAULT_TIMEOUT_S
                if not is_async(call.fn):
                    call, timeout_s = WorkerCall(call, f.name, f"reward.functions[{i}]", timeout_s), None
            self.functions.append(_Function(label, f"reward.functions[{i}] ({f.name})", call, float(f.weight),
                                            f.max_concurrency, timeout_s))
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
                result = await _call(f, _started(f, lambda: f.call.call_batch(samples)))
            except PluginStopped as e:
                raise RewardError(f"{f.where} {e.what} on a batch of {len(samples)}{e.why}") from None
            except Exception as e:
                raise RewardError(f"{f.where} raised on a batch of {len(samples)}: {_failure_line(e)}") from e
            values = _values_of_batch(result, f.where, len(samples))
            if len(values) != len(samples):
                raise RewardError(f"{f.where} returned {len(values)} values for {len(samples)} samples; "
                                  "a batch function returns one number per sample")
            return [_check_value(v, f.where, j) for j, v in enumerate(values)]

        async def one(j: int) -> float:
            try:
                value = await _call(f, _started(f, lambda: f.call.call_one(samples[j])))
            except PluginStopped as e:
                raise RewardError(f"{f.where} {e.what} on sample {j}{e.why}") from None
            except Exception as e:
                raise RewardError(f"{f.where} raised on sample {j}: {_failure_line(e)}") from e
            return _check_value(value, f.where, j)

        if not is_async(f.call.fn):
            # a plain call blocks the loop, so as tasks every sample's call ran before the first
            # failure could cancel the rest: a hung function was given its deadline once per sample
            # (16 samples at timeout_s 10: 175 s, issue 64). One after the other, the first
            # failure ends the batch, at the first deadline.
            return [await one(j) for j in range(len(samples))]
        return await bounded_gather([lambda j=j: one(j) for j in range(len(samples))], f.max_concurrency)

    def close(self) -> None:
        """Close what the functions hold open (a remote reward's connections) and the loop."""
        if self._loop.is_closed():
            return
        for f in self.functions:
            aclose = getattr(f.call.fn, "aclose", None)
            if aclose is not None:
                self._loop.run_until_complete(aclose())
            if isinstance(f.call, WorkerCall):
                f.call.close()
        self._loop.close()
