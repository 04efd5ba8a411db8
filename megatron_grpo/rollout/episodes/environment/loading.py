"""``episodes.kind: environment`` -> an environment class, and the contract of its ``step``.

Runs inside an environment worker process (``worker.py``): loading executes the user's file.
A file ``path/to/env.py:ClassName`` is loaded by path, with no ``PYTHONPATH`` change, once per
process under a name derived from its absolute path (as reward files, ``rewards/registry.py``).
A connector's spec ``<prefix>:<target>`` (``config/connectors.py``) is handed to its adapter
module, imported here on first use (the libraries stay out of every process that does not
run such an environment); the adapter returns a class that follows the same contract.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from pathlib import Path
from typing import Any

from megatron_grpo.config.connectors import connectors_of, split_connector_spec
from megatron_grpo.config.episodes import ENVIRONMENT_FILE_RE
from megatron_grpo.rollout.episodes.environment.builtin import BUILTINS
from megatron_grpo.runtime.errors import one_line

MAX_COUNTS = 16
"""Most names in one step's ``counts`` (bounded work and metrics per step)."""
COUNT_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


class ContractViolation(ValueError):
    """Raised inside a worker by an environment adapter when the environment cannot run under
    this loop's contract (a connector's library asks for something the loop cannot do): the
    worker reports it as ``EnvContractError``, one line that stops the run, not a counted
    failure of one episode."""


def describe(spec: str) -> str:
    """``<absolute file>:<Class>`` (or the built-in's name, or ``<prefix>:<target>`` with the
    target's file made absolute) for error messages."""
    connector = split_connector_spec(spec)
    if connector is not None:
        return f"{connector[0]}:{describe(connector[1])}"
    m = ENVIRONMENT_FILE_RE.match(spec)
    return spec if m is None else f"{Path(m['path']).expanduser().resolve()}:{m['attr']}"


def connector_module(spec: str):
    """``(adapter module, target)`` of a connector's spec, or None for any other spec. The module
    is imported here, in the process that runs the environment; ValueError (one line) for an
    unknown prefix or a library that does not import."""
    connector = split_connector_spec(spec)
    if connector is None:
        return None
    prefix, target = connector
    environments = connectors_of("environment")
    if prefix not in environments:
        raise ValueError(f"episodes.environment {spec!r}: unknown environment connector {prefix!r} "
                         f"(known: {', '.join(environments)})")
    return importlib.import_module(environments[prefix].module), target


def prepare_environment(spec: str, workdir: str) -> None:
    """Start what ``spec``'s episodes share (an OpenEnv server), or preload its library, in the
    calling process: the fork server, so that every worker forked after it inherits both
    (``workdir``: a folder of the fork server's, removed with it). A connector without shared
    state, a built-in or a file: nothing. Never raises: a failure is kept by the adapter module
    and reported, in one line, by the workers that load the spec."""
    try:
        found = connector_module(spec)
    except Exception:  # noqa: BLE001 (reported by the worker that loads the spec, in one line)
        return
    if found is not None and hasattr(found[0], "prepare"):
        found[0].prepare(found[1], workdir)


def load_environment_class(spec: str) -> type:
    """The class ``spec`` names; ValueError (one line: file, class, what is wrong) otherwise."""
    if spec in BUILTINS:
        return BUILTINS[spec]
    found = connector_module(spec)
    if found is not None:
        module, target = found
        return module.environment_class(target)
    return load_file_attribute(spec, "episodes.environment")


def load_file_attribute(spec: str, key: str, prefix: str = "") -> Any:
    """The attribute ``path/to/file.py:name`` names (the file loaded by path, once per process);
    ValueError (one line: ``key``, ``prefix`` + the file and the name, what is wrong) otherwise."""
    m = ENVIRONMENT_FILE_RE.match(spec)
    if m is None:
        raise ValueError(f"{key} {prefix}{spec!r} is not path/to/env.py:ClassName")
    path = Path(m["path"]).expanduser().resolve()
    where = f"{prefix}{path}:{m['attr']}"
    if not path.is_file():
        raise ValueError(f"{key} {where}: file not found")
    module_name = f"megatron_grpo_env_file_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    module = sys.modules.get(module_name)
    if module is None:
        file_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[module_name] = module
        try:
            file_spec.loader.exec_module(module)
        except SystemExit as e:  # a script's unguarded sys.exit(main()): its worker ended without a word
            del sys.modules[module_name]
            raise ValueError(f"{key} {where}: loading the file called sys.exit({e.code!r}); a plug-in's top-level "
                             "code must not end the process (guard a script's main() with "
                             "if __name__ == '__main__':)") from None
        except Exception as e:  # any failure inside the user's file is reported the same way
            del sys.modules[module_name]
            raise ValueError(f"{key} {where}: loading the file failed: {one_line(e)}") from None
    cls = getattr(module, m["attr"], None)
    if cls is None:
        raise ValueError(f"{key} {where}: the file has no attribute {m['attr']!r}")
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
    """``step``'s answer as ``{"observation": str | None, "done": bool, "reward": float}`` plus
    ``"counts": dict[str, int]`` when the step sent a non-empty one (named event counts of the
    step, e.g. the tools connector's failed tool calls, summed into the step's metrics:
    ``multi_turn/env/<name>``, and ``tool_call_errors``, malformed calls, as
    ``multi_turn/tool_call_errors`` like an agent episode's);
    ValueError (one line naming ``where``) when it has another shape."""
    head = f"episodes.environment {where}: step returned"
    if not isinstance(out, dict):
        raise ValueError(f"{head} a {type(out).__name__}; expected a dict "
                         '{"observation": str | None, "done": bool, "reward": float (optional)}')
    unknown = sorted(set(out) - {"observation", "done", "reward", "counts"})
    if unknown:
        raise ValueError(f"{head} unknown keys {unknown}; expected observation, done, reward (and counts)")
    counts = out.get("counts") or {}
    if not isinstance(counts, dict) or len(counts) > MAX_COUNTS or not all(
            isinstance(k, str) and COUNT_NAME_RE.match(k) and isinstance(v, int) and not isinstance(v, bool)
            and v >= 0 for k, v in counts.items()):
        raise ValueError(f"{head} counts={str(counts)[:80]!r}; expected at most {MAX_COUNTS} names "
                         "(lower_snake_case) -> integers >= 0")
    obs, done, reward = out.get("observation"), out.get("done"), out.get("reward", 0.0)
    if obs is not None and not isinstance(obs, str):
        raise ValueError(f"{head} observation of type {type(obs).__name__}; expected str or None")
    if not isinstance(done, bool):
        raise ValueError(f"{head} done={done!r}; expected True or False")
    if reward is None:
        reward = 0.0
    if isinstance(reward, bool) or not finite_real(reward):
        raise ValueError(f"{head} reward={shown(reward, 40)}; expected a finite number")
    answer = {"observation": obs, "done": done, "reward": float(reward)}
    if counts:
        answer["counts"] = dict(counts)
    return answer


def shown(x: Any, limit: int) -> str:
    """``repr`` of ``str(x)`` cut to ``limit`` characters, for a user's value in a one-line error;
    never raises (an int past Python's 4300-digit limit cannot be printed, a ``__str__`` may raise)."""
    try:
        return repr(str(x)[:limit])
    except Exception:  # noqa: BLE001 - whatever the user's object does
        return f"<unprintable {type(x).__name__}>"


def finite_real(x: Any) -> bool:
    """``x`` is a real number a float can hold: ``float(10**400)`` raises OverflowError, which in
    a worker ended it as a crash (an episode error) instead of this contract's one line."""
    try:
        return isinstance(x, numbers.Real) and math.isfinite(float(x))
    except (OverflowError, ValueError, TypeError):
        return False

