"""How a reward function is called: the one place that reads a function's signature.

A reward function declares what it takes by its parameter names:

* ``samples`` (a list of ``RewardSample``): a **batch** function, called once per scored
  batch; it returns a sequence of numbers, one per sample, in order;
* ``sample``: the whole ``RewardSample`` of one response;
* ``prompt``, ``response``, ``answer``, ``response_ids``, ``prompt_ids``, ``finish_reason``,
  ``row``: that field of the sample (``sample.py``);
* a function that names none of these keeps the original contract: its first two positional
  parameters receive ``(response, answer)``, whatever they are called;
* every other parameter comes from ``reward.functions[i].kwargs``; a required one that is
  neither a sample field nor in the kwargs is a config error at load time.

``async def`` functions (and callables whose ``__call__`` is one) are awaited. All calls of a
batch run as tasks of one event loop, at most ``reward.functions[i].max_concurrency`` at a
time, so the per-sample calls of an async function (an HTTP verifier, a sandbox) overlap;
a plain function simply runs one sample after the other.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from megatron_grpo.config.base import ConfigError
from megatron_grpo.rewards.sample import SAMPLE_FIELDS, RewardSample

BATCH_PARAM = "samples"
SAMPLE_PARAM = "sample"
LEGACY_FIELDS = ("response", "answer")


@dataclass(frozen=True)
class RewardCall:
    """A reward function with the way to call it, decided once from its signature."""

    fn: Callable[..., Any]
    kwargs: dict[str, Any]
    batch: bool
    """Called once with ``samples=[...]`` instead of once per sample."""
    positional: tuple[str, ...]
    """Sample fields passed positionally (the legacy ``(response, answer)``)."""
    by_name: tuple[str, ...]
    """Parameters filled from the sample by name (``sample`` or field names)."""

    def one_arguments(self, sample: RewardSample) -> tuple[tuple, dict[str, Any]]:
        """(args, kwargs) of ``fn``'s call for one sample."""
        args = tuple(getattr(sample, f) for f in self.positional)
        named = {n: sample if n == SAMPLE_PARAM else getattr(sample, n) for n in self.by_name}
        return args, {**named, **self.kwargs}

    def batch_arguments(self, samples: list[RewardSample]) -> dict[str, Any]:
        """The kwargs of ``fn``'s call for a batch."""
        return {BATCH_PARAM: list(samples), **self.kwargs}

    def call_one(self, sample: RewardSample) -> Any:
        """``fn``'s result (a number, or an awaitable of one) for one sample."""
        args, kwargs = self.one_arguments(sample)
        return self.fn(*args, **kwargs)

    def call_batch(self, samples: list[RewardSample]) -> Any:
        """``fn``'s result (a sequence of numbers, or an awaitable of one) for a batch."""
        return self.fn(**self.batch_arguments(samples))


async def resolve(value: Any) -> Any:
    """``value``, awaited if it is awaitable (an async function's coroutine)."""
    return await value if inspect.isawaitable(value) else value


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin/C function without a signature: legacy positional call


def plan_call(fn: Callable[..., Any], kwargs: dict[str, Any], key: str) -> RewardCall:
    """Decide how to call ``fn`` with config ``kwargs``; ConfigError naming ``key`` (the
    function's ``reward.functions[i]``) when the kwargs and the signature do not fit."""
    sig = _signature(fn)
    if sig is None:
        return RewardCall(fn, dict(kwargs), False, LEGACY_FIELDS, ())
    params = sig.parameters
    named = [p for p in params if p in (*SAMPLE_FIELDS, SAMPLE_PARAM, BATCH_PARAM)]
    clash = [p for p in named if p in kwargs]
    if clash:
        raise ConfigError(f"{key}.kwargs", f"'{clash[0]}' is a sample field the trainer passes; "
                                           "rename the function's parameter")
    batch = BATCH_PARAM in named
    if batch and len(named) > 1:
        raise ConfigError(f"{key}.name", f"a batch function (with a '{BATCH_PARAM}' parameter) takes the "
                                         f"samples only, not also {', '.join(repr(n) for n in named if n != BATCH_PARAM)}")
    if named:
        call = RewardCall(fn, dict(kwargs), batch, (), () if batch else tuple(named))
        dummy_args: tuple = ()
        dummy_named = {n: None for n in named}
    else:
        call = RewardCall(fn, dict(kwargs), False, LEGACY_FIELDS, ())
        dummy_args, dummy_named = ("", ""), {}
    try:
        sig.bind(*dummy_args, **dummy_named, **kwargs)
    except TypeError as e:
        name = getattr(fn, "__name__", type(fn).__name__)
        hint = "" if named else f" (it names no sample field, so it is called as fn(response, answer, **kwargs))"
        raise ConfigError(f"{key}.kwargs", f"do not fit {name}{sig}: {e}{hint}") from None
    return call


async def bounded_gather(thunks: list[Callable[[], Any]], limit: int) -> list:
    """Run ``thunks`` (each returns a value or an awaitable) as tasks of the running loop, at
    most ``limit`` at once; their results in order. The first exception cancels the rest and
    propagates. A thunk is only called when its turn comes, so no coroutine is left unawaited."""
    semaphore = asyncio.Semaphore(limit)

    async def run(thunk):
        async with semaphore:
            return await resolve(thunk())

    tasks = [asyncio.ensure_future(run(t)) for t in thunks]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # let the cancelled ones finish
