"""Process helpers shared by the trainer ranks, the rollout server launcher and the tests:
lifetime (die with the parent, also for forked children; exit without the interpreter's
teardown), whether a process still runs, and a free port to listen on."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from typing import NoReturn


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG).

    Used (a) by a trainer rank, whose parent is torchrun's agent: torchrun starts workers in
    their own sessions, so a killed launcher would otherwise leave ranks running that keep
    training and writing checkpoints beside the resumed run; (b) in a launched rollout server
    before exec, so a trainer killed with -9 leaves no engine holding its port and memory;
    (c) in children forked during a checkpoint save (``forks_die_with_this_process``).
    ``parent_pid``: the parent this process was started by; if it is already gone (it died
    before the request was made, which the request cannot catch), die now. Without it, a
    parent of pid 1 means the same (an orphan is re-parented to init, or to a container's
    pid 1); a process whose parent is legitimately init never calls this.
    A no-op where prctl is unavailable.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent_pid if parent_pid is not None else os.getppid() == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def children_of(parent: int, state: str | None = None) -> list[int]:
    """The pids whose parent is ``parent`` (in ``state``, e.g. ``"Z"`` for the exited ones not yet
    reaped, when given), from ``/proc/<pid>/stat`` (Linux; [] elsewhere). Not
    ``/proc/<pid>/task/*/children``: a kernel option, documented as reliable only for stopped
    children."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if fields[1] == str(parent) and (state is None or fields[0] == state):
            found.append(int(name))
    return found


def reap_exited_children(keep: frozenset[int]) -> list[int]:
    """``waitpid`` every exited child of this process but those in ``keep`` (children someone
    else waits for): an adopted orphan (``become_subreaper``) that exits stays a zombie until
    its new parent reaps it. Returns the pids reaped."""
    reaped = []
    for pid in children_of(os.getpid(), state="Z"):
        if pid in keep:
            continue
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                reaped.append(pid)
        except ChildProcessError:
            pass
    return reaped


def become_subreaper(on: bool = True) -> bool:
    """Make this process the child subreaper of its descendants (PR_SET_CHILD_SUBREAPER): one
    orphaned below it (a plug-in's daemon, started with ``setsid`` or a double fork, whose
    parent then died) is re-parented here instead of to init, so ``end_adopted_children`` can
    end it. ``on=False`` stops it. Not inherited by forked children. False where prctl is unavailable."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, int(on), 0, 0, 0) == 0  # 36 = PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def end_adopted_children(keep: frozenset[int] = frozenset(), wait_s: float = 5.0) -> list[int]:
    """SIGKILL every child this process still has but those in ``keep`` (its children from
    before the work whose leftovers these are), with the process group each one leads, and reap
    them (bounded by ``wait_s``). Called by the launcher once its ranks have ended: what is left
    then is what a plug-in left behind (adopted through ``become_subreaper``). Returns the pids
    ended."""
    pids = [pid for pid in children_of(os.getpid()) if pid not in keep]
    for pid in pids:
        for kill in (os.killpg, os.kill):  # killpg: the group it leads (a setsid daemon's), if any
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + wait_s
    waiting = set(pids)
    while waiting and time.monotonic() < deadline:
        for pid in list(waiting):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    waiting.discard(pid)
            except ChildProcessError:  # reaped elsewhere, or not ours after all
                waiting.discard(pid)
        if waiting:
            time.sleep(0.02)
    return pids


_forks_die = 0  # > 0 while ``forks_die_with_this_process`` is active
_hook_registered = False
_forking_pid = 0  # the pid of the process that forks: a child's parent


def _before_fork() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _after_fork_in_child() -> None:
    if _forks_die:
        die_with_parent(_forking_pid)


@contextlib.contextmanager
def forks_die_with_this_process():
    """Within this block, every child this process forks (``os.fork``, multiprocessing's fork
    context) dies when this process dies.

    megatron-core's checkpoint writer forks worker processes from the rank. A rank killed with
    -9 in the middle of a save would otherwise leave them running, blocked writing results to
    a queue nobody reads, holding copies of the rank's sockets (gloo peers, the engine): the
    other ranks would not see the rank go, and the process outlives the run. Scoped to a
    block, not the whole process, because Linux ties the death signal to the forking *thread*:
    a child forked by a short-lived thread would die with that thread."""
    global _forks_die, _hook_registered
    if not _hook_registered:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _hook_registered = True
    _forks_die += 1
    try:
        yield
    finally:
        _forks_die -= 1


class ForkDied(RuntimeError):
    """A child forked inside ``fail_when_a_fork_dies`` died without finishing its work."""


class DeadlinePassed(RuntimeError):
    """A ``fail_when_a_fork_dies`` block ran past its deadline (its children were killed)."""


FORK_WATCH_S = 0.2
"""How often ``fail_when_a_fork_dies`` looks at the children started in its block."""
FORK_DIED_SIGNAL = signal.SIGUSR2
"""The signal that wakes the main thread where it waits (``SIGUSR1`` dumps the stacks)."""


def _death_of(pid: int) -> str | None:
    """How child ``pid`` ended, when it has ended with a signal or a non-zero status ("killed
    by SIGKILL", "exited with status 3"); None while it runs or when it exited 0. Looks without
    reaping (``WNOWAIT``): whoever started it still gets its status."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already: its owner saw its status
        return None
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return None if info.si_status == 0 else f"exited with status {info.si_status}"
    return f"killed by {signal.Signals(info.si_status).name}"


@contextlib.contextmanager
def fail_when_a_fork_dies(what: str, deadline_s: float | None = None, deadline_name: str = ""):
    """Within this block, a ``multiprocessing`` child started in it that dies with a signal or
    a non-zero status raises ``ForkDied`` in the main thread, wherever that thread waits; with
    ``deadline_s``, a block still running after that many seconds kills the children started
    in it and raises ``DeadlinePassed`` (naming ``deadline_name``, the setting).

    megatron-core's checkpoint save forks shard writers from the rank and waits for them in
    ``JoinableQueue.join()`` with no deadline: a writer killed with -9 (the OOM killer, a
    user) never marks its task done, and the rank would wait for ever, its peers until the
    group's timeout (issue 48); a writer that hangs (a stalled filesystem, a lock) holds it
    the same way without dying. A thread watches the children multiprocessing started since
    the block began (not the rank's other processes) and, when one has died or the deadline
    has passed, signals the main thread (``FORK_DIED_SIGNAL``), whose handler raises; a
    blocked queue or lock wait, a sleep or an interruptible system call is interrupted by
    it (a call stuck in C code that does not return to Python is not: a write in the
    kernel's uninterruptible sleep, a collective). Off the main thread, where no handler can
    be installed, the block watches nothing. ``what`` names the children in the message
    ("a checkpoint writer")."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import multiprocessing.process as mp_process

    before = set(mp_process.active_children())  # the objects, held: an id could be reused
    failed: list[Exception] = []
    stop = threading.Event()
    ends = None if deadline_s is None else time.monotonic() + deadline_s

    def handler(signum, frame):
        if failed:
            raise failed[0]

    def started_here() -> list:
        return [c for c in list(mp_process._children) if c not in before]  # noqa: SLF001 - the live set, unreaped

    def watch() -> None:
        while not stop.wait(FORK_WATCH_S):
            for child in started_here():
                how = _death_of(child.pid)
                if how is not None:
                    failed.append(ForkDied(f"{what} process (pid {child.pid}) {how} before it finished"))
                    signal.pthread_kill(threading.main_thread().ident, FORK_DIED_SIGNAL)
                    return
            if ends is not None and time.monotonic() >= ends:
                children = started_here()
                for child in children:  # a hung writer must not write on after the save gave up
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.pid, signal.SIGKILL)
                n, noun = len(children), what.removeprefix("a ").removeprefix("an ")
                killed = f"; {n} {noun} process{'' if n == 1 else 'es'} still running killed" if n else ""
                failed.append(DeadlinePassed(f"not finished within {deadline_name or 'its deadline'} "
                                             f"({deadline_s:g} s){killed}"))
                signal.pthread_kill(threading.main_thread().ident, FORK_DIED_SIGNAL)
                return

    previous = signal.signal(FORK_DIED_SIGNAL, handler)
    watcher = threading.Thread(target=watch, daemon=True, name="fork-watch")
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()  # before the handler goes: no signal arrives after it
        signal.signal(FORK_DIED_SIGNAL, previous)


def alive(process) -> bool:
    """``process`` (a ``psutil.Process``) still runs: not gone, not another process on its
    reused pid, and not a zombie (exited, its parent not having reaped it yet)."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


EXIT_HOOKS_TIMEOUT_S = 30.0
"""Longest wait for the ``atexit`` hooks in ``exit_now``. The run's own hooks close what is left
(a fork server: at most 15 s); a plug-in imported into the process may register one that never
returns (``atexit.register(thread.join)`` of a thread that runs for ever), which kept
``megatron-grpo train`` and its ranks alive for good (issue 48)."""


def _exit_when_late(code: int, timeout_s: float) -> None:
    """A watchdog thread's body: ``os._exit(code)`` once the hooks ran ``timeout_s`` seconds."""
    time.sleep(timeout_s)
    with contextlib.suppress(OSError, ValueError):
        print(f"[megatron-grpo] the exit hooks (atexit) still run after {timeout_s:g}s: exiting without them "
              "(a plug-in's atexit hook that does not return?)", file=sys.stderr, flush=True)
    os._exit(code)


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` once its work is done, skipping the interpreter's teardown.

    A process that imported torch and megatron-core spends 1.3-1.7 s (2-core machine, measured)
    after its last line deleting modules one by one; every run pays that in each rank, in
    series with torchrun noticing the exit. The ``atexit`` hooks still run (logging's flush,
    libraries' own shutdown hooks), within ``EXIT_HOOKS_TIMEOUT_S``, and stdio is flushed; what
    is skipped is module teardown and the join of non-daemon threads, so call this only after
    the run closed what it started (the trainer's ``close``: engines, writers, worker pools)."""
    threading.Thread(target=_exit_when_late, args=(code, EXIT_HOOKS_TIMEOUT_S), daemon=True,
                     name="exit-hooks-deadline").start()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)
