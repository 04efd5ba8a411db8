"""One environment instance per worker process: a hung or crashing environment is killed
alone, and the trainer's process never runs the user's environment code.

``EnvProcess(spec, row, timeout_s)`` starts a process (multiprocessing ``forkserver``: forked
from a small server that has imported only this module, never from the trainer's threaded
process), which loads ``spec``, constructs the environment with ``row`` and then answers
``step(response)`` calls; an ``async def step`` runs on the worker's own event loop. Every call
the parent makes waits at most ``timeout_s`` (the worker's start-up has its own allowance):
past it the process is killed (SIGKILL, which even a sync ``while True`` cannot ignore) and
the call raises ``EnvCallError("timeout")``. An exception inside the environment raises
``EnvCallError("error")`` with the file:line where it was raised. A broken contract (no such
file or class, no ``step``, a ``step`` answer of the wrong shape) raises ``EnvContractError``:
a one-line user error that stops the run.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing
import traceback
from typing import Any, Optional

from megatron_grpo.rollout.environments.loading import (check_step_result, class_problem, describe,
                                                        load_environment_class, one_line)

STARTUP_TIMEOUT_S = 60.0
"""Allowance for a worker process to start (not the environment's: it has not run yet)."""


class EnvContractError(ValueError):
    """The environment does not follow the interface; ``str(e)`` is one line naming it."""


class EnvCallError(RuntimeError):
    """An environment call failed: ``kind`` is ``error`` (it raised, or its process died) or
    ``timeout``; ``where`` is ``file:line`` of the raise (or the environment's name)."""

    def __init__(self, kind: str, message: str, where: str):
        self.kind = kind
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}")


def start_method():
    """The multiprocessing context of environment workers (forkserver preloading this module)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _raise_site(e: BaseException, env_file: str) -> str:
    """``file:line`` of the deepest frame in the environment's file, else of the deepest frame."""
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if f.filename == env_file]
    frame = (mine or frames)[-1] if frames else None
    return f"{frame.filename}:{frame.lineno}" if frame else env_file


def _serve(conn, spec: str, row: dict) -> None:
    """The worker process: load, construct, then answer ("step", response) until ("close", _)."""
    conn.send(("ready", None))
    where = describe(spec)
    try:
        cls = load_environment_class(spec)
    except ValueError as e:
        conn.send(("contract", str(e)))
        return
    problem = class_problem(cls, where)
    if problem is not None:
        conn.send(("contract", problem))
        return
    try:
        env_file = inspect.getsourcefile(cls) or where
    except TypeError:
        env_file = where
    try:
        env = cls(row)
    except Exception as e:  # the user's constructor: reported, the episode ends
        conn.send(("error", {"message": f"constructor raised {one_line(e)}", "where": _raise_site(e, env_file)}))
        return
    conn.send(("ok", None))
    loop: Optional[asyncio.AbstractEventLoop] = None
    while True:
        try:
            op, arg = conn.recv()
        except EOFError:
            return
        if op == "close":
            return
        try:
            out = env.step(arg)
            if inspect.isawaitable(out):
                loop = loop or asyncio.new_event_loop()
                out = loop.run_until_complete(out)
        except Exception as e:  # the user's step: reported, the episode ends
            conn.send(("error", {"message": f"step raised {one_line(e)}", "where": _raise_site(e, env_file)}))
            continue
        try:
            conn.send(("ok", check_step_result(out, where)))
        except ValueError as e:
            conn.send(("contract", str(e)))
            return


def _check(conn, spec: str) -> None:
    """Pre-flight worker: load ``spec`` and check its class; sends the problem or None."""
    try:
        cls = load_environment_class(spec)
    except ValueError as e:
        conn.send(str(e))
        return
    conn.send(class_problem(cls, describe(spec)))


def check_environment(spec: str, timeout_s: float) -> None:
    """Pre-flight, in a worker process: ``spec`` loads and names an environment class.
    EnvContractError (one line: file, class, what is wrong) otherwise."""
    ctx = start_method()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_check, args=(child, spec), daemon=True, name="megatron-grpo-env-check")
    proc.start()
    child.close()
    try:
        if not parent.poll(STARTUP_TIMEOUT_S + timeout_s):
            raise EnvContractError(f"rollout.environment {describe(spec)}: loading the file took longer than "
                                   f"{STARTUP_TIMEOUT_S + timeout_s:.0f}s")
        try:
            problem = parent.recv()
        except EOFError:
            raise EnvContractError(f"rollout.environment {describe(spec)}: loading the file killed its process "
                                   f"(exit code {proc.exitcode})") from None
        if problem is not None:
            raise EnvContractError(problem)
    finally:
        _stop(proc)
        parent.close()


def _stop(proc, grace_s: float = 2.0) -> None:
    proc.join(timeout=grace_s)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5.0)


class EnvProcess:
    """One environment instance in its own worker process (see the module docstring).
    Blocking: every call returns within its timeout."""

    def __init__(self, spec: str, row: dict, timeout_s: float):
        self.where = describe(spec)
        self.timeout_s = timeout_s
        ctx = start_method()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, spec, row), daemon=True, name="megatron-grpo-env")
        self._proc.start()
        child.close()
        self._closed = False
        self._await("start-up", STARTUP_TIMEOUT_S)
        self._await("the constructor", timeout_s)

    def step(self, response: str) -> dict:
        """The environment's ``{"observation", "done", "reward"}`` for ``response``."""
        try:
            self._conn.send(("step", response))
        except (BrokenPipeError, OSError):
            self.kill()
            raise EnvCallError("error", f"the worker process is gone (exit code {self._proc.exitcode})",
                               self.where) from None
        return self._await("step", self.timeout_s)

    def _await(self, what: str, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            self.kill()
            raise EnvCallError("timeout", f"{what} took longer than {timeout_s:g}s; its worker process was killed",
                               self.where)
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise EnvCallError("error", f"the worker process died during {what} (exit code {self._proc.exitcode})",
                               self.where) from None
        if kind in ("ok", "ready"):
            return payload
        self.close()
        if kind == "contract":
            raise EnvContractError(payload)
        raise EnvCallError("error", payload["message"], payload["where"])

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid

    def kill(self) -> None:
        """Stop the worker now (SIGKILL)."""
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(timeout=5.0)
        self._closed = True
        self._conn.close()

    def close(self) -> None:
        """Let the worker end (it gets 2 s), then kill it."""
        if self._closed:
            return
        try:
            self._conn.send(("close", None))
        except (BrokenPipeError, OSError):
            pass
        _stop(self._proc)
        self._closed = True
        self._conn.close()
