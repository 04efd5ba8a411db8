"""The one registry of reward functions: built-ins by name, user functions by dotted path.

A reward function is ``fn(response: str, answer: str, **kwargs) -> float``. The config names
it in ``reward.functions[i].name``: a key of ``BUILTIN_REWARDS`` or a dotted path
``pkg.module.fn`` that is imported when the trainer starts. Only paths written in the
config are ever imported (no entry points, no scanning). Failures are ``ConfigError``s
naming ``reward.functions[i].name`` / ``.kwargs``.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
import typing
from typing import Any, Callable

from megatron_grpo.config.base import ConfigError, _check_value
from megatron_grpo.rewards.builtin import format_reward, math_exact_match

RewardFn = Callable[..., float]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "math_exact_match": math_exact_match,
    "format": format_reward,
}
"""Built-in reward name -> function."""

DOTTED_PATH_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a reward function (None if it can); no import happens here."""
    if name in BUILTIN_REWARDS or DOTTED_PATH_RE.match(name):
        return None
    close = difflib.get_close_matches(name, BUILTIN_REWARDS, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return (f"unknown reward function {name!r}; {hint}built-ins: {', '.join(BUILTIN_REWARDS)}, "
            f"or a dotted path pkg.module.fn")


def import_dotted(path: str, key: str) -> RewardFn:
    """Import ``pkg.module.fn``; ConfigError naming ``key`` if the module or attribute is missing."""
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any failure inside the user's module is reported the same way
        msg = " ".join(str(e).split())
        raise ConfigError(key, f"cannot import module '{module_name}' for reward {path!r}: {type(e).__name__}: {msg}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(key, f"module '{module_name}' has no attribute '{attr}'")
    if not callable(fn):
        raise ConfigError(key, f"{path!r} is a {type(fn).__name__}, not a function")
    return fn


def check_kwargs(fn: RewardFn, kwargs: dict[str, Any], key: str) -> None:
    """The config kwargs must bind to ``fn(response, answer, **kwargs)``; annotated ones must type-check."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin/C function without a signature: nothing to check
    try:
        sig.bind("", "", **kwargs)
    except TypeError as e:
        raise ConfigError(key, f"do not fit {getattr(fn, '__name__', fn)}{sig}: {e}") from None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        return  # unresolvable annotations in user code are not our concern
    for name, value in kwargs.items():
        if name in hints:
            try:
                _check_value(value, hints[name], f"{key}.{name}")
            except TypeError:
                pass  # a type the config checker does not know (ndarray, ...): not checked


def resolve_reward(name: str, kwargs: dict[str, Any], index: int) -> RewardFn:
    """The function for ``reward.functions[index]``, with its kwargs checked."""
    key = f"reward.functions[{index}]"
    problem = name_problem(name)
    if problem:
        raise ConfigError(f"{key}.name", problem)
    fn = BUILTIN_REWARDS[name] if name in BUILTIN_REWARDS else import_dotted(name, f"{key}.name")
    check_kwargs(fn, kwargs, f"{key}.kwargs")
    return fn
