"""The one registry of reward functions: how ``reward.functions[i].name`` becomes a callable.

``name`` is one of

* a built-in (``BUILTIN_REWARDS``: ``math_exact_match``, ``format``, ``reasoning_gym``,
  ``math_verify``);
* ``remote``: an HTTP reward server, configured by the function's ``remote:`` section
  (``rewards/remote.py``);
* a dotted path ``pkg.module.fn``, imported (the module must be importable);
* a file path ``path/to/rewards.py:fn``, loaded from the file by every process that scores,
  with no ``PYTHONPATH`` change; a relative path is resolved against the current directory,
  like ``data.train_file`` and every other path of the config.

Only paths written in the config are ever imported (no entry points, no scanning). How the
callable is then called (its parameters) is decided in ``rewards/calling.py``. Failures are
``ConfigError``s naming ``reward.functions[i].name`` / ``.kwargs``.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
import typing
from pathlib import Path
from typing import Any, Callable

from megatron_grpo.config.base import ConfigError, check_value
from megatron_grpo.config.sections import REMOTE
from megatron_grpo.rewards.builtin import format_reward, math_exact_match
from megatron_grpo.rewards.calling import RewardCall, plan_call
from megatron_grpo.rewards.math_verify_reward import MathVerifyReward
from megatron_grpo.rewards.reasoning_gym_reward import ReasoningGymReward
from megatron_grpo.rewards.remote import RemoteReward

RewardFn = Callable[..., Any]

BUILTIN_REWARDS: dict[str, RewardFn | type] = {
    "math_exact_match": math_exact_match,
    "format": format_reward,
    "reasoning_gym": ReasoningGymReward,
    "math_verify": MathVerifyReward,
}
"""Built-in reward name -> function, or class. A class is made once per configured function
with its ``kwargs`` (it keeps a worker process and counters of its own) and the instance is
the reward; its ``requires`` (import name -> package) must be installed."""

EXTRA_HINT = "pip install 'megatron-grpo[reasoning]'"
"""How to install the optional packages of the built-ins that need some."""

DOTTED_PATH_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
FILE_PATH_RE = re.compile(r"^(?P<path>.+\.py):(?P<attr>[A-Za-z_]\w*)$")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a reward function (None if it can); no import happens here."""
    if name in BUILTIN_REWARDS or name == REMOTE or DOTTED_PATH_RE.match(name) or FILE_PATH_RE.match(name):
        return None
    close = difflib.get_close_matches(name, [*BUILTIN_REWARDS, REMOTE], n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return (f"unknown reward function {name!r}; {hint}built-ins: {', '.join(BUILTIN_REWARDS)}, {REMOTE} "
            f"(an HTTP server), a dotted path pkg.module.fn or a file path path/to/file.py:fn")


def exit_at_import(e: SystemExit, owner: str) -> str:
    """The problem of a module that ended its importer: a script's top-level ``sys.exit(main())``
    (no ``if __name__ == "__main__":`` guard) ended ``megatron-grpo train`` itself, with exit code
    0 and nothing trained (issue 48)."""
    return (f"{owner} called sys.exit({e.code!r}) while being imported; a plug-in's top-level code must not end "
            "the process (guard a script's main() with if __name__ == '__main__':)")


def _attribute(module, attr: str, owner: str, spec: str, key: str) -> RewardFn:
    """``module.attr``, which must be callable; ``owner``/``spec`` name it in errors."""
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(key, f"{owner} has no attribute '{attr}'")
    if not callable(fn):
        raise ConfigError(key, f"{spec!r} is a {type(fn).__name__}, not a function")
    return fn


def import_dotted(path: str, key: str) -> RewardFn:
    """Import ``pkg.module.fn``; ConfigError naming ``key`` if the module or attribute is missing."""
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except SystemExit as e:
        raise ConfigError(key, exit_at_import(e, f"module '{module_name}'")) from None
    except Exception as e:  # any failure inside the user's module is reported the same way
        msg = " ".join(str(e).split())
        raise ConfigError(key, f"cannot import module '{module_name}' for reward {path!r}: {type(e).__name__}: {msg}") from None
    return _attribute(module, attr, f"module '{module_name}'", path, key)


def load_file(spec: str, key: str) -> RewardFn:
    """Load ``fn`` from ``path/to/file.py:fn`` (relative to the current directory); the module
    is loaded once per process under a name derived from its absolute path."""
    m = FILE_PATH_RE.match(spec)
    assert m, spec  # checked by name_problem at config load
    path = Path(m["path"]).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(key, f"reward file {path} not found (a relative path is resolved against the current "
                               f"directory {Path.cwd()})")
    module_name = f"megatron_grpo_reward_file_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    module = sys.modules.get(module_name)
    if module is None:
        file_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[module_name] = module  # dataclasses / pickling in the file look themselves up here
        try:
            file_spec.loader.exec_module(module)
        except SystemExit as e:
            del sys.modules[module_name]
            raise ConfigError(key, exit_at_import(e, f"reward file {path}")) from None
        except Exception as e:  # any failure inside the user's file is reported the same way
            del sys.modules[module_name]
            msg = " ".join(str(e).split())
            raise ConfigError(key, f"cannot load reward file {path}: {type(e).__name__}: {msg}") from None
    return _attribute(module, m["attr"], f"reward file {path}", spec, key)


def check_kwarg_types(fn: RewardFn, kwargs: dict[str, Any], key: str) -> None:
    """Config kwargs whose parameter is annotated must have that type."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        return  # unresolvable annotations in user code are not our concern
    for name, value in kwargs.items():
        if name in hints:
            try:
                check_value(value, hints[name], f"{key}.{name}")
            except TypeError:
                pass  # a type the config checker does not know (ndarray, ...): not checked


def is_user_function(name: str) -> bool:
    """Whether ``reward.functions[i].name`` is the user's code (a dotted or file path)."""
    return name not in BUILTIN_REWARDS and name != REMOTE and name_problem(name) is None


def resolve_reward(fcfg, index: int) -> RewardCall:
    """How to call ``reward.functions[index]`` (a ``RewardFunctionConfig``), kwargs checked."""
    key = f"reward.functions[{index}]"
    problem = name_problem(fcfg.name)
    if problem:
        raise ConfigError(f"{key}.name", problem)
    if fcfg.timeout_s is not None and not is_user_function(fcfg.name):
        where = "remote.timeout_s" if fcfg.name == REMOTE else "kwargs.timeout_s, where it takes one"
        raise ConfigError(f"{key}.timeout_s", f"is for dotted and file-path functions; {fcfg.name} has its own "
                                              f"deadline ({where})")
    kwargs = fcfg.kwargs
    if fcfg.name == REMOTE:
        fn: RewardFn = RemoteReward(fcfg.remote, key)
    elif isinstance(BUILTIN_REWARDS.get(fcfg.name), type):
        fn, kwargs = make_builtin(fcfg.name, fcfg.kwargs, key), {}
    elif fcfg.name in BUILTIN_REWARDS:
        fn = BUILTIN_REWARDS[fcfg.name]
    elif FILE_PATH_RE.match(fcfg.name):
        fn = load_file(fcfg.name, f"{key}.name")
    else:
        fn = import_dotted(fcfg.name, f"{key}.name")
    call = plan_call(fn, kwargs, key)
    check_kwarg_types(fn, kwargs, f"{key}.kwargs")
    return call


def make_builtin(name: str, kwargs: dict[str, Any], key: str) -> RewardFn:
    """The instance of built-in class ``BUILTIN_REWARDS[name]`` made with ``kwargs``; ConfigError
    naming ``key.name`` when a package it needs is missing, ``key.kwargs`` when the kwargs do not fit."""
    cls = BUILTIN_REWARDS[name]
    missing = [package for module, package in cls.requires.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"{key}.name", f"{name} needs the optional package {', '.join(missing)}: {EXTRA_HINT}")
    sig = inspect.signature(cls)
    sig = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()])  # as written in YAML
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{key}.kwargs", f"do not fit {name}{sig}: {e}") from None
    check_kwarg_types(cls.__init__, kwargs, f"{key}.kwargs")
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(f"{key}.kwargs", str(e)) from None
