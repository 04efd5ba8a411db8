"""A function run in a worker process under a deadline: how a built-in reward bounds
third-party grading code that can hang, from any thread.

    worker = IsolatedFunction("megatron_grpo.rewards.math_verify_reward:verify_in_worker", "math_verify")
    value = worker(response, answer, timeout_s=5.0)   # CallTimeout past the deadline
    worker.close()

Why a process: sympy (under math-verify and several reasoning-gym graders) evaluates what it
parses, and ``\\boxed{9^{9^{9^{9}}}}`` or ``9**9**9**9`` runs for ever inside one C call. A SIGALRM
timeout (math-verify's own) works only in the main thread, and neither an alarm nor a thread can
interrupt a C call; killing a process always can.

* The worker starts on the first call (not when the reward loads), is kept for the calls that
  follow, killed on a timeout and started again on the next call. Its start-up and an optional
  ``setup`` function (once per worker) are outside the deadline, which counts from the request.
* Calls from several threads take turns (one worker, one lock).
* Messages are length-prefixed pickles over its stdin/stdout; its fds 1 and 0 then point at
  stderr and /dev/null, so graded code cannot corrupt the stream. It ignores SIGINT, leads its
  own session and process group (killed whole when stopped), and kills that group when its stdin
  closes, so nothing the graded code started outlives the trainer.
* A worker that dies during a call (a crash in C code) or cannot start is a ``WorkerError``,
  one line: a reward that failed that way is not a wrong answer.

More: docs/rewards.md#the-worker-process.
"""

from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from megatron_grpo.runtime.errors import one_line

HEADER = struct.Struct("<Q")
"""A message's length, before its pickle."""

START_TIMEOUT_S = 300.0
"""Longest wait for a worker to import its module (reasoning-gym takes ~2 s on an idle core;
much longer on a machine busy with the trainer's ranks)."""

PACKAGE_PARENT = Path(__file__).resolve().parents[2]
"""The directory holding this ``megatron_grpo``: first on the worker's path, so it imports the
same copy of the package as the trainer."""

WORKER_CODE = "import sys; from megatron_grpo.rewards.isolated import serve; serve(*sys.argv[1:])"


class CallTimeout(Exception):
    """The call did not answer within its deadline; the worker was killed."""


class WorkerError(RuntimeError):
    """The worker could not start, died during a call, or the function raised; ``str(e)`` is
    one line naming the function."""


def _write(fd: int, obj: Any) -> None:
    _send(fd, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _send(fd: int, data: bytes) -> None:
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _reply_bytes(reply: tuple) -> bytes:
    """``reply`` pickled; a result that cannot be (a lock, a lambda: anything pickle refuses)
    becomes a ``raised`` reply saying so. Pickling fails before anything is written, so the
    stream stays whole; the worker used to die of it with a traceback on the run's stderr."""
    try:
        return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - whatever the object's __reduce__ raises
        return pickle.dumps(("raised", f"its result cannot be sent back to the trainer's process ({one_line(e)})"),
                            protocol=pickle.HIGHEST_PROTOCOL)


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes | None:
    """``size`` bytes from ``fd``; None at end of file; CallTimeout past ``deadline``
    (``time.monotonic()``; None waits for ever)."""
    chunks, left = [], size
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise CallTimeout()
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read(fd: int, deadline: float | None) -> Any:
    """One message from ``fd``; EOFError when the other side closed it."""
    header = _read_exact(fd, HEADER.size, deadline)
    body = None if header is None else _read_exact(fd, HEADER.unpack(header)[0], deadline)
    if body is None:
        raise EOFError
    return pickle.loads(body)


def _stop(proc: subprocess.Popen) -> None:
    """Kill ``proc`` with its process group (what the graded code started) and reap it (a
    finalizer: it must not raise)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # it leads its own group (start_new_session), until reaped
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


class IsolatedFunction:
    """``target`` (``"pkg.module:function"``, importable, picklable arguments and result) run in a
    worker process; ``name`` names it in errors. ``setup`` (optional, another target) is run
    before a call under ``START_TIMEOUT_S`` rather than the call's deadline, once per worker
    process and distinct ``setup_args`` (hashable): what calls need once (imports, a parser's
    tables, a task's data files). See the module docstring."""

    def __init__(self, target: str, name: str, setup: str | None = None):
        self.target = target
        self.setup = setup
        self.name = name
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()
        self._set_up: set[tuple] = set()
        """The ``setup_args`` the running worker has been set up with."""

    def __call__(self, *args: Any, timeout_s: float, setup_args: tuple = ()) -> Any:
        """``setup(*setup_args)`` then ``function(*args)`` in the worker; CallTimeout when the call
        takes over ``timeout_s`` seconds (the worker is then killed), WorkerError if either raised,
        the setup took over ``START_TIMEOUT_S`` or the worker died."""
        with self._lock:
            proc = self._worker()
            if self.setup is not None and setup_args not in self._set_up:  # one round trip less per call
                try:
                    self._request(proc, "setup", setup_args, START_TIMEOUT_S)
                except CallTimeout:
                    raise WorkerError(f"{self.name}: its worker's setup took over {START_TIMEOUT_S:g} s") from None
                self._set_up.add(setup_args)
            return self._request(proc, "call", args, timeout_s)

    def _request(self, proc: subprocess.Popen, kind: str, args: tuple, timeout_s: float) -> Any:
        """One request's answer; the worker is killed on a timeout or when it died."""
        try:
            _write(proc.stdin.fileno(), (kind, args))
            status, value = _read(proc.stdout.fileno(), time.monotonic() + timeout_s)
        except CallTimeout:
            self._kill()
            raise
        except (EOFError, BrokenPipeError):
            code = self._kill()
            raise WorkerError(f"{self.name}: its worker process died during a call (exit code {code})") from None
        if status == "raised":
            raise WorkerError(f"{self.name}: {value}")
        return value

    def _worker(self) -> subprocess.Popen:
        """The running worker, started (and waited for) if there is none or it has exited."""
        if self._proc is not None and self._proc.poll() is not None:
            self._kill()  # stopped between calls (a signal to the process group): start a new one
        if self._proc is None:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(PACKAGE_PARENT),
                                                                          os.environ.get("PYTHONPATH")) if p)}
            # a session of its own: a process the graded code starts is killed with it (_stop)
            proc = subprocess.Popen([sys.executable, "-c", WORKER_CODE, self.target, self.setup or ""],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
            self._proc = proc
            self._finalizer = weakref.finalize(self, _stop, proc)
            try:
                status, value = _read(proc.stdout.fileno(), time.monotonic() + START_TIMEOUT_S)
            except (CallTimeout, EOFError):
                code = self._kill()
                raise WorkerError(f"{self.name}: its worker process did not start within {START_TIMEOUT_S:g} s "
                                  f"(exit code {code})") from None
            if status != "ready":
                self._kill()
                raise WorkerError(f"{self.name}: its worker process could not load {self.target}: {value}")
        return self._proc

    def _kill(self) -> int | None:
        """Stop the worker; its exit code (negative: the signal that ended it)."""
        proc, self._proc = self._proc, None
        self._set_up.clear()
        if proc is None:
            return None
        self._finalizer.detach()
        _stop(proc)
        return proc.returncode

    def close(self) -> None:
        """Stop the worker (a later call starts a new one)."""
        with self._lock:
            self._kill()


def _load(target: str) -> Callable[..., Any]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def serve(target: str, setup: str = "") -> None:
    """The worker's loop: answer ``("ok", result)`` or ``("raised", one line)`` to each request
    ``(kind, args)`` on stdin (kind ``call``: ``target``, ``setup``: ``setup``), until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer, which finishes its step
    requests, answers = os.dup(0), os.dup(1)
    os.dup2(2, 1)  # the graded code's prints go to stderr, not into the answers
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # and it cannot read the requests
    try:
        functions = {"call": _load(target), "setup": _load(setup) if setup else None}
    except Exception as e:
        _write(answers, ("raised", one_line(e)))
        return
    _write(answers, ("ready", None))
    while True:
        try:
            kind, args = _read(requests, None)
        except EOFError:  # the trainer's process ended: end what the graded code started too
            if os.getpgrp() == os.getpid():  # its own group (start_new_session), never the trainer's
                os.killpg(os.getpgrp(), signal.SIGKILL)
            return
        try:
            reply = ("ok", functions[kind](*args))
        except Exception as e:
            reply = ("raised", one_line(e))
        _send(answers, _reply_bytes(reply))
