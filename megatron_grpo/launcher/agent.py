"""torchrun's agent, forked from the launcher, and its stderr: forwarded live, cut after a
rank recorded its one-line error (``preflight/report.py``), a stop signal forwarded to it.
"""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import NoReturn

from megatron_grpo.preflight.report import ERROR_FILE_ENV, PEER_SUFFIX, fail
from megatron_grpo.runtime import stop
from megatron_grpo.runtime.process import die_with_parent


class _Agent:
    """torchrun's elastic agent in a child forked from the launcher: ``Popen``'s interface as
    ``launch_ranks`` uses it (``pid``, ``stderr``, ``poll``, ``wait``, ``send_signal``).

    Forked, not exec'd (``python -m torch.distributed.run``): the launcher has imported torch
    for its pre-flight, and a fresh interpreter spends ~1.9 CPU s importing it again before it
    starts a rank (2 cores, measured), on every launch and in series with everything after.
    The agent computes nothing, so no thread pool of torch's is needed in the fork. It keeps the
    launcher's command line; ``ps -o comm`` shows ``pt_elastic``, the name torch gives it."""

    def __init__(self, torchrun_args: list[str], env: dict[str, str]):
        read_fd, write_fd = os.pipe()
        parent = os.getpid()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here may be written twice
            stream.flush()
        with warnings.catch_warnings():  # Python >= 3.12 warns of any thread (a tokenizer's pool)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _run_agent(torchrun_args, env, parent, write_fd)  # never returns
        os.close(write_fd)
        self.pid = pid
        self.stderr = os.fdopen(read_fd, "rb", buffering=0)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def send_signal(self, signum: int) -> None:
        # Not reaped by this call (``forward_stop`` runs it while ``wait`` may be in waitpid);
        # until this process reaps the child its pid is its own, exited or not.
        if self.returncode is None:
            os.kill(self.pid, signum)


def _run_agent(torchrun_args: list[str], env: dict[str, str], parent_pid: int, stderr_fd: int) -> NoReturn:
    """The forked child: torchrun's ``main(torchrun_args)`` under ``env``, its stderr (and its
    ranks') on ``stderr_fd``; exits with torchrun's exit code and never returns to the launcher."""
    code = 1
    try:
        os.dup2(stderr_fd, 2)  # inheritable: the ranks write here too
        os.close(stderr_fd)
        # the launcher's SIGTERM handler forwards to its agent: not this process's; then take
        # SIGTERM again (the launcher held it while forking) and die with the launcher
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        die_with_parent(parent_pid)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["torchrun", *torchrun_args]
        from torch.distributed.run import main as torchrun

        torchrun(torchrun_args)
        code = 0
    except SystemExit as e:  # as the interpreter ends on one
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught one
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: the launcher is gone
                pass
        os._exit(code)


def launch_ranks(torchrun_args: list[str], env: dict[str, str]) -> int:
    """Run torchrun, forwarding its stderr live, and turn a user error raised in a rank during
    training (a reward function that raises, ...) into ONE line and exit code 2.

    The rank records the error line in a temp file (outside the run directory) instead of
    printing it. Everything torchrun and the other ranks print after that (its failure report,
    tracebacks of collectives broken by the failed rank) is a consequence, so it is dropped.
    When torchrun itself fails (no rank recorded anything: a rendezvous that timed out waiting
    for the other nodes, say), its exception is repeated as the last line."""
    with tempfile.TemporaryDirectory(prefix="megatron-grpo-") as tmp:
        error_file = Path(tmp) / "user_error"
        # A SIGTERM for this process goes on to torchrun, which stops its ranks cleanly; the
        # ranks' stderr is this pipe, so dying here would otherwise kill them at their next write.
        stopping: list[int] = []  # the stop signal received, once one was
        started: list[_Agent] = []

        def forward_stop(signum, frame):
            stopping.append(signum)
            if started:
                started[0].send_signal(signal.SIGTERM)

        # SIGTERM is held from before torchrun starts until the handler can reach it: a stop that
        # arrives while it starts (Slurm's preemption during start-up) is forwarded, not fatal
        # to this process alone. The child unblocks it (it inherits the mask, not a pending signal).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        previous = signal.signal(signal.SIGTERM, forward_stop)
        try:
            try:
                # torchrun dies with this process (a kill -9 of the launcher alone), and its ranks with it.
                started.append(_Agent(torchrun_args, {**env, ERROR_FILE_ENV: str(error_file)}))
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a held stop is forwarded here
            proc = started[0]
            tail = forward_stderr(proc, error_file, stopping)
            code = proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
        # A rank's own error is the cause; a lost peer (recorded apart) is usually its effect.
        for recorded in (error_file, Path(f"{error_file}{PEER_SUFFIX}")):
            if recorded.exists():
                recorded_code, line = recorded.read_text().strip().split(" ", 1)
                return fail(line, int(recorded_code))
        if stopping:  # the ranks were killed before they could say where they stopped
            name = stop.signal_name(stopping[0])
            return fail(f"stopped by {name} before the ranks finished their step and saved (within "
                         "checkpoint.stop_timeout_s); the newest complete checkpoint is kept, and the same "
                         "command resumes from it", stop.exit_code(stopping[0]))
        reason = launcher_exception(tail) if code != 0 else None
        return fail(f"torchrun stopped (exit code {code}): {reason}", code) if reason else code


# torchrun's first line when a stop signal reaches it (its elastic agent, logged as a warning).
_TORCHRUN_SIGNALLED = re.compile(rb"[^\n]*Received (\d+) death signal, shutting down workers")


def _read_stderr(proc: _Agent, exited_at: list[float]) -> bytes:
    """The next chunk of ``proc``'s stderr; b"" at its end, or ``DRAIN_S`` after ``proc`` exited
    (``exited_at``: when that was first seen), whatever still holds the pipe open."""
    fd = proc.stderr.fileno()
    while True:
        if not exited_at and proc.poll() is not None:
            exited_at.append(time.monotonic())
        if exited_at and time.monotonic() - exited_at[0] >= DRAIN_S:
            return b""
        if select.select([fd], [], [], POLL_S)[0]:
            return os.read(fd, 65536)


POLL_S = 0.5
"""How often the launcher looks whether torchrun's agent has exited while its stderr is quiet."""
DRAIN_S = 1.0
"""After the agent exited, how long its stderr may stay quiet before the launcher stops reading:
a process a rank left behind (a user's subprocess) may hold the pipe open for ever."""


def forward_stderr(proc: _Agent, error_file: Path, stopping: list[int], keep_bytes: int = 4096) -> bytes:
    """Copy ``proc``'s stderr to ours until it closes, or ``proc`` has exited (``_read_stderr``),
    except after a rank recorded its error in ``error_file`` or a stop signal came
    (``stopping``: torchrun's shutdown report follows, and the ranks record where they
    stopped); returns the last ``keep_bytes`` of it. A second Ctrl-C leaves at once: this
    process exits and every rank dies with it."""
    out = getattr(sys.stderr, "buffer", None)
    tail = b""
    interrupts = 0  # Ctrl-Cs this process received
    exited_at: list[float] = []
    while True:
        try:
            chunk = _read_stderr(proc, exited_at)
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts > 1:
                raise
            if signal.SIGINT not in stopping:
                stopping.append(signal.SIGINT)  # torchrun got it too and passes it to its ranks
            continue
        if not chunk:
            return tail
        tail = (tail + chunk)[-keep_bytes:]
        signalled = None if stopping else _TORCHRUN_SIGNALLED.search(chunk)
        if signalled and int(signalled.group(1)) in signal.valid_signals():
            # A Ctrl-C reaches torchrun and this process together; torchrun's report of it can
            # be read before this process's KeyboardInterrupt is raised: it is the stop too.
            chunk = chunk[:signalled.start()]
            stopping.append(signal.Signals(int(signalled.group(1))))
        else:
            signalled = None
        if chunk and not error_file.exists() and (signalled or not stopping):
            if out is not None:
                out.write(chunk)
                out.flush()
            else:
                sys.stderr.write(chunk.decode(errors="replace"))


def launcher_exception(stderr_tail: bytes) -> str | None:
    """``torch.distributed.X: message`` when that ends torchrun's output: its own failure
    (rendezvous, store), not a rank's. A rank's failure ends with torchrun's ChildFailedError
    report, whose rank tracebacks were shown above it."""
    lines = [line.strip() for line in stderr_tail.decode(errors="replace").splitlines() if line.strip()]
    if lines and lines[-1].startswith("torch.distributed.") and "ChildFailedError" not in lines[-1]:
        return lines[-1].removeprefix("torch.distributed.")
    return None
