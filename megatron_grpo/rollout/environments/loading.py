"""``episodes.environment`` -> an environment class, and the contract of its ``step``.

Runs inside an environment worker process (``worker.py``): loading executes the user's file.
A file ``path/to/env.py:ClassName`` is loaded by path, with no ``PYTHONPATH`` change, once per
process under a name derived from its absolute path (as reward files, ``rewards/registry.py``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import numbers
import sys
from pathlib import Path
from typing import Any

from megatron_grpo.config.episodes import ENVIRONMENT_FILE_RE
from megatron_grpo.rollout.environments.builtin import BUILTINS


def describe(spec: str) -> str:
    """``<absolute file>:<Class>`` (or the built-in's name) for error messages."""
    m = ENVIRONMENT_FILE_RE.match(spec)
    return spec if m is None else f"{Path(m['path']).expanduser().resolve()}:{m['attr']}"


def load_environment_class(spec: str) -> type:
    """The class ``spec`` names; ValueError (one line: file, class, what is wrong) otherwise."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    m = ENVIRONMENT_FILE_RE.match(spec)
    if m is None:
        raise ValueError(f"episodes.environment {spec!r} is not path/to/env.py:ClassName")
    path = Path(m["path"]).expanduser().resolve()
    where = f"{path}:{m['attr']}"
    if not path.is_file():
        raise ValueError(f"episodes.environment {where}: file not found")
    module_name = f"megatron_grpo_env_file_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    module = sys.modules.get(module_name)
    if module is None:
        file_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[module_name] = module
        try:
            file_spec.loader.exec_module(module)
        except Exception as e:  # any failure inside the user's file is reported the same way
            del sys.modules[module_name]
            raise ValueError(f"episodes.environment {where}: loading the file failed: {one_line(e)}") from None
    cls = getattr(module, m["attr"], None)
    if cls is None:
        raise ValueError(f"episodes.environment {where}: the file has no attribute {m['attr']!r}")
    return cls


def class_problem(cls: Any, where: str) -> str | None:
    """Why ``cls`` is not an environment class (None if it is): a class constructed with one
    argument (the row) with a callable ``step(response)``."""
    if not inspect.isclass(cls):
        return f"episodes.environment {where}: is a {type(cls).__name__}, not a class"
    if not callable(getattr(cls, "step", None)):
        return f"episodes.environment {where}: the class has no method step(self, response)"
    try:
        inspect.signature(cls).bind({})
    except TypeError as e:
        return f"episodes.environment {where}: the constructor must take the dataset row (__init__(self, row)): {e}"
    except ValueError:
        pass  # no signature available (a C type): checked at the first episode
    try:
        inspect.signature(cls.step).bind(None, "")
    except TypeError as e:
        return f"episodes.environment {where}: step must take the response (step(self, response)): {e}"
    except ValueError:
        pass
    return None


def check_step_result(out: Any, where: str) -> dict:
    """``step``'s answer as ``{"observation": str | None, "done": bool, "reward": float}``;
    ValueError (one line naming ``where``) when it has another shape."""
    head = f"episodes.environment {where}: step returned"
    if not isinstance(out, dict):
        raise ValueError(f"{head} a {type(out).__name__}; expected a dict "
                         '{"observation": str | None, "done": bool, "reward": float (optional)}')
    unknown = sorted(set(out) - {"observation", "done", "reward"})
    if unknown:
        raise ValueError(f"{head} unknown keys {unknown}; expected observation, done, reward")
    obs, done, reward = out.get("observation"), out.get("done"), out.get("reward", 0.0)
    if obs is not None and not isinstance(obs, str):
        raise ValueError(f"{head} observation of type {type(obs).__name__}; expected str or None")
    if not isinstance(done, bool):
        raise ValueError(f"{head} done={done!r}; expected True or False")
    if reward is None:
        reward = 0.0
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise ValueError(f"{head} reward={str(reward)[:40]!r}; expected a finite number")
    return {"observation": obs, "done": done, "reward": float(reward)}


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
