"""The user's plain reward functions (a dotted or file path) run in a worker process, under a
deadline: ``reward.functions[i].timeout_s`` (default ``DEFAULT_TIMEOUT_S``) per call.

Why a process: a reward function that hangs (a loop, a big-integer power in sympy, a lock)
hung the whole run until it was stopped by hand, and neither a thread nor an alarm can stop a
call stuck in C code; killing a process always can (``rewards/isolated.py``, the pattern the
built-in graders use). Why not in-process ``sys.exit``: a function that called it ended the
rank with exit code 0, and the run reported success having trained nothing.

The trainer's process still imports the function (the pre-flight checks its signature; how it
is called is decided there, ``rewards/calling.py``) and sends each call's arguments to the
worker, which imports the same function (the trainer's ``sys.path`` first) and calls it. What
can go wrong there is a ``PluginStopped`` (the deadline passed, ``sys.exit``, the worker died)
or a ``PluginRaised`` (the function raised: its one line), each turned into the scorer's one
line naming the function and the sample. ``async`` functions stay in the trainer's event loop
(their calls overlap) and are cancelled at the deadline instead (``scorer.py``).
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
import sys
from typing import Any

from megatron_grpo.rewards.calling import RewardCall
from megatron_grpo.rewards.isolated import CallTimeout, IsolatedFunction, WorkerError
from megatron_grpo.rewards.registry import FILE_PATH_RE, import_dotted, load_file
from megatron_grpo.runtime.errors import one_line

DEFAULT_TIMEOUT_S = 60.0
"""``reward.functions[i].timeout_s`` when null: generous for a grader (milliseconds), short
enough that a hung one is noticed in a minute, not at the end of the job's wall time."""


class PluginStopped(Exception):
    """A call that did not return: ``what`` it did (``took longer than 5s``) and ``why`` that
    stops the run; the scorer adds the function and the sample between them."""

    def __init__(self, what: str, why: str = ""):
        self.what, self.why = what, why
        super().__init__(f"{what}{why}")


class PluginRaised(Exception):
    """The function raised in its worker; ``str(e)`` is that exception's one line (``KeyError: 'x'``)."""


def as_scalar(value: Any) -> Any:
    """A numpy scalar, or a 0-d array or tensor, as the Python number it holds; anything else as
    it is. ``(pred == gold).float().mean()`` is a 0-d tensor and ``np.mean(x) > 0.5`` a
    ``numpy.bool_`` (not a ``numbers.Real``): both were refused, a 0-d one as if the function had
    raised ``TypeError: iteration over a 0-d tensor``."""
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        try:
            return value.item()
        except Exception:  # noqa: BLE001 - not a number after all: the caller refuses it as it is
            return value
    return value


def is_async(fn: Any) -> bool:
    """Whether ``fn`` (a function or a callable object) is called with ``await``."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class WorkerCall:
    """``RewardCall``'s interface (``fn``, ``batch``, ``call_one``, ``call_batch``) for the plain
    function ``spec`` of ``reward.functions[i]`` (``key``), run in a worker under ``timeout_s``."""

    def __init__(self, call: RewardCall, spec: str, key: str, timeout_s: float):
        self.plan, self.fn, self.batch = call, call.fn, call.batch
        self.key, self.timeout_s = key, timeout_s
        self._worker = IsolatedFunction(f"{__name__}:call_in_worker", spec, setup=f"{__name__}:load_in_worker")
        # the trainer's path first: a module it imported from a directory only it has on its path
        self._setup = (spec, f"{key}.name", tuple(p for p in sys.path if p))

    def call_one(self, sample) -> Any:
        args, kwargs = self.plan.one_arguments(sample)
        return self._run(args, kwargs)

    def call_batch(self, samples) -> Any:
        return self._run((), self.plan.batch_arguments(samples))

    def _run(self, args: tuple, kwargs: dict) -> Any:
        try:
            status, value = self._worker(args, kwargs, timeout_s=self.timeout_s, setup_args=self._setup)
        except CallTimeout:
            raise PluginStopped(f"took longer than {self.timeout_s:g}s", f" ({self.key}.timeout_s); its worker "
                                "process was killed") from None
        except WorkerError as e:  # could not start or load, or died (os._exit, a crash in C code)
            raise PluginStopped("failed", f": {e}") from None
        if status == "exit":
            raise PluginStopped(f"called sys.exit({value})", "; a reward function returns a number, it does not "
                                "end the run")
        if status == "raised":
            raise PluginRaised(value)
        return value

    def close(self) -> None:
        self._worker.close()


# ---- in the worker process --------------------------------------------------------------------

_loaded: dict[str, Any] = {}


def load_in_worker(spec: str, key: str, path: tuple[str, ...]) -> None:
    """The worker's setup: import ``spec`` as the trainer did."""
    sys.path[:0] = [p for p in path if p not in sys.path]
    _loaded["fn"] = load_file(spec, key) if FILE_PATH_RE.match(spec) else import_dotted(spec, key)


def call_in_worker(args: tuple, kwargs: dict) -> tuple[str, Any]:
    """``("ok", value)``, ``("raised", one line)`` or ``("exit", code)``: never raises, so
    ``SystemExit`` (a ``BaseException``) cannot end the worker's loop as a clean answer."""
    try:
        value = _loaded["fn"](*args, **kwargs)
        if inspect.isawaitable(value):  # a plain function that returned a coroutine
            value = asyncio.run(_awaited(value))
        value = as_scalar(value)
        if not isinstance(value, (numbers.Number, str, bytes, dict, type(None))) and hasattr(value, "__iter__"):
            value = list(value)  # a batch function's values (a generator, an array) cross as a list
        return "ok", value
    except SystemExit as e:
        return "exit", repr(e.code)
    except Exception as e:  # noqa: BLE001 - the user's function: its one line goes back
        return "raised", one_line(e, 200)


async def _awaited(value):
    return await value
