"""One environment instance per worker process: a hung or crashing environment is killed
alone, and the trainer's process never runs the user's environment code.

Workers are forked by a small fork server: a plain ``python`` subprocess that imports only
this module (not the trainer's main module, torch or megatron) and forks one worker per
environment on request, over an authenticated Unix socket (``multiprocessing.connection``).
Forking there is safe (the server is single-purpose) and fast (no interpreter start per
episode); the server exits when the trainer's process does (its stdin closes), and a worker
exits when its connection closes or its fork server exits (a hung one too: Linux's parent-death
signal). Each worker leads a process group of its own, killed whole (``kill_worker``, and by the
fork server as it exits), so no process the user's code started outlives its worker. The fork
server reads each request before it forks: for a connector's spec (``skyrl_gym:``, ``openenv:``)
it first prepares what that spec's episodes share (``loading.prepare_environment``: a library
preloaded, an OpenEnv server started as a child of its own), which every worker forked after
it inherits and which ends with the fork server like its workers. The same server forks the
worker of a custom rollout function (``run`` requests: ``rollout/episodes/function/worker.py``).

``EnvProcess(spec, row, timeout_s)`` gets a worker, which loads ``spec``, constructs the
environment with ``row`` and then answers ``step(response)`` calls; an ``async def step`` runs
on the worker's own event loop. Every call waits at most ``timeout_s`` (the worker's start-up
has its own allowance): past it the worker is killed (SIGKILL, which even a sync
``while True`` cannot ignore) and the call raises ``EnvCallError("timeout")``. An exception
inside the environment raises ``EnvCallError("error")`` with the file:line where it was
raised. A broken contract (no such file or class, no ``step``, a ``step`` answer of the
wrong shape, a connector's ``ContractViolation``) raises ``EnvContractError``: a one-line user
error that stops the run.
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import importlib
import inspect
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_grpo.runtime.process import children_of
from megatron_grpo.rollout.episodes.environment.loading import (ContractViolation, check_step_result, class_problem,
                                                        describe, load_environment_class, prepare_environment)
from megatron_grpo.runtime.errors import one_line

STARTUP_TIMEOUT_S = 60.0
"""Allowance for the fork server and a worker to start (not the environment's: it has not run yet)."""

PREPARE_TIMEOUT_S = 180.0
"""Allowance for the fork server to prepare what a connector's episodes share before it forks
their worker (``loading.prepare_environment``: an OpenEnv server's start, which imports its
app, within the connector's own deadline; a library preloaded): once per run, or after that
server died."""

REQUEST_READ_S = 10.0
"""How long the fork server waits for a connected client's request (sent right after connecting)."""


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


class _ForkServer:
    """The fork server process and its socket (see the module docstring)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="megatron-grpo-env-")
        self.address = os.path.join(self.dir, "fork.sock")
        self.authkey = os.urandom(16)
        self.workers: list[int] = []  # the pids of the workers this process asked for
        package_root = str(Path(__file__).resolve().parents[3])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from megatron_grpo.rollout.episodes.environment.worker import _server_main; _server_main()",
             self.address], stdin=subprocess.PIPE, env=env)
        self.proc.stdin.write(self.authkey.hex().encode() + b"\n")
        self.proc.stdin.flush()  # stdin stays open: the server exits when it closes (this process ended)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not os.path.exists(self.address):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the environment fork server did not start (exit code {self.proc.returncode})")
            time.sleep(0.02)

    def connect(self, request: tuple) -> tuple[Connection, int]:
        """A new worker serving ``request``: (its connection, its pid)."""
        conn = Client(self.address, family="AF_UNIX", authkey=self.authkey)
        conn.send(request)
        if not conn.poll(STARTUP_TIMEOUT_S + PREPARE_TIMEOUT_S):
            conn.close()
            raise EnvCallError("error", "a worker process did not start", str(request[1]))
        pid = conn.recv()
        _remember(self.workers, pid)
        return conn, pid

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the server kills its workers' process groups and exits
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        # Again from this side: a server killed above (too slow to exit on a loaded machine)
        # or by someone else killed nothing, and its workers' parent-death signal kills them
        # but not what they started (a sleep left once in CI, after a 59-minute loaded suite).
        _kill_worker_groups(self.workers)
        shutil.rmtree(self.dir, ignore_errors=True)


_server: Optional[_ForkServer] = None
_server_lock = threading.Lock()


def fork_server() -> _ForkServer:
    global _server
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _ForkServer()
            atexit.register(_server.close)
        return _server


def shutdown_fork_server() -> None:
    """Stop this process's fork server and its workers, if it has one (a pre-flight's check
    started it in a process that trains nothing: the launcher)."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None


def _server_main() -> None:
    """The fork server: accept a connection, fork a worker for it, repeat (until stdin closes)."""
    address = sys.argv[1]
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    # bound under another name and renamed once listening: the trainer waits for ``address``
    # to exist, and a socket file that exists before listen() refuses connections
    listener = Listener(address + ".binding", family="AF_UNIX", authkey=authkey)
    os.rename(address + ".binding", address)
    workers: list[int] = []  # every worker forked: its pid is its process group's id (os.setsid)
    # on exit: its workers and every child it still has (an OpenEnv server, a session of its own too)
    threading.Thread(target=lambda: (sys.stdin.read(), _kill_worker_groups([*workers, *children_of(os.getpid())]),
                                     os._exit(0)), daemon=True).start()
    while True:
        try:
            conn = listener.accept()
        except Exception:  # a client that failed the handshake
            continue
        # the request is read here, before the fork: a connector's shared state (an OpenEnv
        # server, a preloaded library) is prepared in this process, so every worker forked
        # after it inherits it, and the server it started dies with this process
        try:
            request = conn.recv() if conn.poll(REQUEST_READ_S) else None
        except (EOFError, OSError):
            request = None
        if request is None:
            conn.close()
            continue
        if request[0] == "serve" or (request[0] == "check" and request[2]):
            prepare_environment(request[1], os.path.dirname(address))
        server_pid = os.getpid()
        if (worker_pid := os.fork()) == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(listener._listener._socket.fileno())  # not listener.close(): that unlinks the socket
            # A session (and process group) of its own: whatever the user's code starts (a
            # ``sleep 600`` subprocess) is in it, and ``kill_worker`` kills the whole group. A
            # child left behind kept the ranks' stderr open and ``megatron-grpo train`` waiting.
            os.setsid()
            _die_with_parent(server_pid)
            try:
                conn.send(os.getpid())
                if request[0] == "serve":
                    _serve(conn, request[1], request[2], request[3] if len(request) > 3 else None)
                elif request[0] == "check":
                    _check(conn, request[1])
                else:  # ("run", target, args): RUN_TARGETS[target](conn, *args)
                    module, _, name = RUN_TARGETS[request[1]].partition(":")
                    getattr(importlib.import_module(module), name)(conn, *request[2])
            except (EOFError, OSError):
                pass
            finally:
                os._exit(0)
        _remember(workers, worker_pid)
        conn.close()


RUN_TARGETS = {"rollout_function": "megatron_grpo.rollout.episodes.function.worker:serve",
               "agent": "megatron_grpo.rollout.episodes.agent.worker:serve"}
"""What a ("run", target, args) request may start in a forked worker: a fixed list, so the
socket (authenticated, the trainer's only) cannot name arbitrary code. Imported when run,
because function_worker imports this module."""


def _kill_worker_groups(pids: list[int]) -> None:
    """SIGKILL the process group each of ``pids`` leads: the workers a fork server forked (and
    its other children) when it exits, because the trainer's process ended, or the workers the
    trainer asked for once their server is gone. The workers would die anyway (parent-death
    signal), but not what they started. The pids are a record kept by each side (and a scan of
    ``/proc/*/stat`` for the server's children), not ``/proc/self/task/*/children`` (a kernel
    option, and documented as reliable only for stopped children; a sleep was once left in CI).
    A group outlives its leader while a member lives, and its id is not reused meanwhile, so a
    worker that already died still has its children killed."""
    for pid in set(pids):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _remember(workers: list[int], pid: int) -> None:
    """Add worker ``pid`` to ``workers``; past 256 (a long run forks a worker per episode), forget
    the ones whose process group is gone."""
    workers.append(pid)
    if len(workers) > 256:
        workers[:] = [p for p in workers if _group_alive(p)]


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a member (signal 0 sends nothing)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent(server_pid: int) -> None:
    """SIGKILL this worker when the fork server exits (which it does when the trainer's process
    ends), even if the user's code hangs and never reads its connection again. Linux only."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: a worker still exits when its connection closes
    if os.getppid() != server_pid:  # the server exited before the signal was armed
        os._exit(0)


def raise_site(e: BaseException, env_file: str) -> str:
    """``file:line`` of the deepest frame in the environment's file, else of the deepest frame."""
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if f.filename == env_file]
    frame = (mine or frames)[-1] if frames else None
    return f"{frame.filename}:{frame.lineno}" if frame else env_file


def _serve(conn, spec: str, row: dict, options: Optional[dict] = None) -> None:
    """A worker: load, construct (``cls(row, **options)``: a connector's run settings, e.g. the
    tools connector's tool-call format), then answer ("step", response, max_observation_chars)
    until ("close", ...)."""
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
        env = cls(row, **(options or {}))
    except ContractViolation as e:  # a connector's environment asks for what the loop cannot do
        conn.send(("contract", f"episodes.environment {where}: {e}"))
        return
    except Exception as e:  # the user's constructor: reported, the episode ends
        conn.send(("error", {"message": f"constructor raised {one_line(e)}", "where": raise_site(e, env_file)}))
        return
    conn.send(("ok", None))
    loop: Optional[asyncio.AbstractEventLoop] = None
    while True:
        try:
            op, arg, max_chars = conn.recv()
        except EOFError:
            return
        if op == "close":
            return
        try:
            out = env.step(arg)
            if inspect.isawaitable(out):
                loop = loop or asyncio.new_event_loop()
                out = loop.run_until_complete(out)
        except ContractViolation as e:
            conn.send(("contract", f"episodes.environment {where}: {e}"))
            return
        except Exception as e:  # the user's step: reported, the episode ends
            conn.send(("error", {"message": f"step raised {one_line(e)}", "where": raise_site(e, env_file)}))
            continue
        try:
            answer = check_step_result(out, where)
        except ValueError as e:
            conn.send(("contract", str(e)))
            return
        if answer["observation"] is not None and max_chars is not None:
            # one character past the limit: the trainer sees the cut (and counts it) without
            # a huge observation ever crossing the pipe or being copied into its process
            answer["observation"] = answer["observation"][:max_chars + 1]
        conn.send(("ok", answer))


def _check(conn, spec: str) -> None:
    """Pre-flight worker: load ``spec`` and check its class; sends the problem or None."""
    try:
        cls = load_environment_class(spec)
    except ValueError as e:
        conn.send(str(e))
        return
    conn.send(class_problem(cls, describe(spec)))


def check_environment(spec: str, timeout_s: float, prepare: bool = False) -> None:
    """Pre-flight, in a worker process: ``spec`` loads and names an environment class.
    EnvContractError (one line: file, class, what is wrong) otherwise. ``prepare``: first start
    what the spec's episodes share (an OpenEnv server): the run's own pre-flight, whose episodes
    follow, and the launcher's, so a server that cannot start is refused before anything is written."""
    conn, pid = fork_server().connect(("check", spec, prepare))
    try:
        if not conn.poll(timeout_s):
            raise EnvContractError(f"episodes.environment {describe(spec)}: loading the file took longer than "
                                   f"{timeout_s:g}s (episodes.timeout_s)")
        try:
            problem = conn.recv()
        except (EOFError, OSError):
            raise EnvContractError(f"episodes.environment {describe(spec)}: loading the file killed its "
                                   "process") from None
        if problem is not None:
            raise EnvContractError(problem)
    finally:
        kill_worker(pid)
        conn.close()


def kill_worker(pid: int, wait_s: float = 2.0) -> None:
    """SIGKILL worker ``pid`` with its whole process group (what the user's code started), and
    wait (bounded) until the fork server's kernel reaping has removed it. A group outlives its
    leader while a member lives, and its id is not reused meanwhile, so a worker that already
    died still has its children killed here."""
    deadline = time.monotonic() + wait_s
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, signal.SIGKILL)
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.01)
    except ProcessLookupError:
        pass


class EnvProcess:
    """One environment instance in its own worker process (see the module docstring).
    Blocking: every call returns within its timeout."""

    def __init__(self, spec: str, row: dict, timeout_s: float, options: Optional[dict] = None,
                 on_start: Optional[Callable[[int], None]] = None):
        """``on_start(pid)``: called once the worker exists, before its start-up is awaited (a
        step's ``HangGuard`` watches it, and may kill it)."""
        self.where = describe(spec)
        self.timeout_s = timeout_s
        self._conn, self.pid = fork_server().connect(("serve", spec, row, options))
        self._closed = False
        if on_start is not None:
            on_start(self.pid)
        self._await("start-up", STARTUP_TIMEOUT_S)
        self._await("the constructor", timeout_s)

    def step(self, response: str, max_observation_chars: Optional[int] = None) -> dict:
        """The environment's ``{"observation", "done", "reward"}`` for ``response``; an
        observation longer than ``max_observation_chars`` is cut to that length plus one in the
        worker (the caller sees that it was longer, and nothing larger is sent)."""
        try:
            self._conn.send(("step", response, max_observation_chars))
        except (BrokenPipeError, OSError):
            self.kill()
            raise EnvCallError("error", "the worker process is gone", self.where) from None
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
            raise EnvCallError("error", f"the worker process died during {what}", self.where) from None
        if kind in ("ok", "ready"):
            return payload
        self.close()
        if kind == "contract":
            raise EnvContractError(payload)
        raise EnvCallError("error", payload["message"], payload["where"])

    def kill(self) -> None:
        """Stop the worker now (SIGKILL)."""
        kill_worker(self.pid)
        self._closed = True
        self._conn.close()

    def close(self) -> None:
        """Ask the worker to end, then make sure it has (SIGKILL)."""
        if self._closed:
            return
        try:
            self._conn.send(("close", None, None))
        except (BrokenPipeError, OSError):
            pass
        self.kill()
