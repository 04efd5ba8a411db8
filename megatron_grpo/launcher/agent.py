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
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import NoReturn

from megatron_grpo.preflight.report import ERROR_FILE_ENV, EXIT_RUN_ABORTED, PEER_SUFFIX, fail
from megatron_grpo.runtime import stop
from megatron_grpo.runtime.process import (become_subreaper, children_of, die_with_parent, end_adopted_children,
                                           reap_exited_children)


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
        # Orphans below this process come here, not to init: a plug-in's daemon (``setsid``, a
        # double fork) outlived its worker, its rank and the run, holding the ranks' stderr.
        # Once torchrun's agent has ended, whatever is left is ended with it (below).
        become_subreaper()
        children_before = frozenset(children_of(os.getpid()))  # a caller's own, never ended here
        reaping = threading.Event()  # set: stop reaping the adopted orphans that exit (zombies)
        try:
            try:
                # torchrun dies with this process (a kill -9 of the launcher alone), and its ranks with it.
                started.append(_Agent(torchrun_args, {**env, ERROR_FILE_ENV: str(error_file)}))
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a held stop is forwarded here
            proc = started[0]
            threading.Thread(target=_reap_adopted, args=(reaping, children_before | {proc.pid}), daemon=True,
                             name="reap-adopted").start()
            tail = forward_stderr(proc, error_file, stopping)
            code = proc.wait()
            end_adopted_children(keep=children_before)  # the agent and its ranks are gone: the rest was left behind
        finally:
            signal.signal(signal.SIGTERM, previous)
            reaping.set()
            become_subreaper(False)
        # A rank's own error is the cause; a rank killed from outside is the cause of the others
        # losing their peer (recorded apart), which is an effect.
        if error_file.exists():
            return _recorded(error_file)
        cause = root_cause(tail) if code != 0 else None
        if cause is not None and cause["exitcode"] < 0 and not stopping:
            name = stop.signal_name(-cause["exitcode"])
            pid = f" (pid {cause['pid']})" if cause["pid"] else ""
            return fail(f"rank {cause['rank']}{pid} was killed by {name} from outside the run; the other ranks "
                        "were stopped; the newest complete checkpoint is kept, and the same command resumes "
                        "from it", EXIT_RUN_ABORTED)
        lost_peer = Path(f"{error_file}{PEER_SUFFIX}")
        if lost_peer.exists():
            return _recorded(lost_peer)
        if stopping:  # the ranks were killed before they could say where they stopped
            name = stop.signal_name(stopping[0])
            return fail(f"stopped by {name} before the ranks finished their step and saved (within "
                         "checkpoint.stop_timeout_s); the newest complete checkpoint is kept, and the same "
                         "command resumes from it", stop.exit_code(stopping[0]))
        reason = launcher_exception(tail) if code != 0 else None
        if reason:
            return fail(f"torchrun stopped (exit code {code}): {reason}", code)
        if cause is not None:  # a rank's own traceback (a bug) was shown above
            return fail(f"rank {cause['rank']} exited with code {cause['exitcode']}; its traceback is above", code)
        return code


def _reap_adopted(stop_event: threading.Event, keep: frozenset[int], every_s: float = 1.0) -> None:
    """Until ``stop_event``: reap the exited orphans this process adopted as the subreaper (an
    SGLang server's scheduler after the server was killed), which init reaped before; never a
    pid in ``keep`` (torchrun's agent, which ``_Agent`` waits for, and the caller's own)."""
    while not stop_event.wait(every_s):
        reap_exited_children(keep)


def _recorded(path: Path) -> int:
    """The one line a rank recorded (``preflight/report.py``), printed; its exit code."""
    recorded_code, line = path.read_text().strip().split(" ", 1)
    return fail(line, int(recorded_code))


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


_TRACEBACK = b"Traceback (most recent call last):"
_CONTINUED = (b" ", b"\t", b"Traceback", b"During handling", b"The above exception")
_CHILD_FAILED = b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
# torchrun's log of its workers' ends ("Sending process N closing signal SIGTERM", "failed
# (exitcode: -9) local_rank: 1"): restated by the launcher's one line
_WORKER_LOG = re.compile(rb"[WEI]\d{4} [^\n]*torch/distributed/elastic/multiprocessing/api\.py:\d+\]")


class TorchrunReportFilter:
    """Holds back torchrun's own output about its end: its failure report (``ChildFailedError``
    and the summary after it), its own failures (a rendezvous that timed out) and its log of
    its workers' ends, which the launcher replaces with one line (``launch_ranks``). Everything
    else passes at once, partial lines included (a progress bar), except a partial line that
    may begin one of those; a traceback is held from its first line to its exception line, then
    passed whole when it is a rank's."""

    def __init__(self):
        self.partial = b""  # an incomplete last line that may begin something held back
        self.held: bytes | None = None  # a traceback being read, from its first line
        self.report = False  # torchrun's failure report has begun: nothing more passes

    def feed(self, chunk: bytes) -> bytes:
        """The part of ``chunk`` to show now."""
        data, self.partial = self.partial + chunk, b""
        lines = data.split(b"\n")
        last = lines.pop()  # b"" when ``data`` ends a line
        out = b"".join(self._line(line + b"\n") for line in lines)
        if last and (self.held is not None or self.report or _may_begin_held(last)):
            self.partial = last
        else:
            out += last
        return b"" if self.report and not out else out

    def _line(self, line: bytes) -> bytes:
        if self.report:
            return b""
        body = line.rstrip(b"\r\n")
        if self.held is None:
            if body == _TRACEBACK:
                self.held = line
                return b""
            return b"" if _WORKER_LOG.match(line) else line
        self.held += line
        if not body or body.startswith(_CONTINUED):
            return b""
        block, self.held = self.held, None  # ``body`` is the exception line: the traceback ends
        if body.startswith(_CHILD_FAILED):
            self.report = True  # its summary follows: held with it
            return b""
        if body.startswith(b"torch.distributed.") and b"torch/distributed/run.py" in block:
            return b""  # torchrun's own failure: launch_ranks prints its last line
        return block  # a rank's traceback

    def finish(self) -> bytes:
        """What is still held and must be shown (a traceback cut short; never torchrun's report)."""
        held = (self.held or b"") + self.partial
        self.held, self.partial = None, b""
        return b"" if self.report else held


def _may_begin_held(partial: bytes) -> bool:
    """Whether an incomplete line may be the start of a traceback or of torchrun's log."""
    return _TRACEBACK.startswith(partial) or partial.startswith(_TRACEBACK) or \
        re.match(rb"[WEI]\d{0,4}(?: |$)", partial) is not None


_FAILURE = re.compile(r"^\s*rank\s*:\s*(\d+).*?^\s*exitcode\s*:\s*(-?\d+)(?:\s*\(pid: (\d+)\))?", re.M | re.S)


def _failures(section: str) -> list[dict]:
    """Every ``rank`` / ``exitcode`` block of a part of torchrun's report, in order."""
    return [{"rank": int(m[1]), "exitcode": int(m[2]), "pid": int(m[3]) if m[3] else None}
            for m in _FAILURE.finditer(section)]


def root_cause(stderr_tail: bytes) -> dict | None:
    """The failure torchrun's report says caused the others (``rank``, ``pid``, ``exitcode``; a
    negative exit code is the signal that killed it), None without a report. A rank killed by a
    signal from outside is the cause wherever the report lists it: torchrun names the first
    failure it *observed* as the root cause, and on a loaded machine that can be the rank that
    lost its peer (exit code 1) rather than the peer that was killed. Its own SIGTERMs to the
    surviving ranks (exit code -15) are effects, never the cause."""
    text = stderr_tail.decode(errors="replace")
    at = text.rfind("Root Cause (first observed failure):")
    if at < 0:
        return None
    first = _failures(text[at:])[:1]
    if not first:
        return None
    start = text.rfind("Failures:", 0, at)
    others = _failures(text[start:at]) if start >= 0 else []
    killed = [f for f in first + others if f["exitcode"] < 0 and f["exitcode"] != -signal.SIGTERM]
    return killed[0] if killed else first[0]


def forward_stderr(proc: _Agent, error_file: Path, stopping: list[int], keep_bytes: int = 4096) -> bytes:
    """Copy ``proc``'s stderr to ours until it closes, or ``proc`` has exited (``_read_stderr``),
    except after a rank recorded its error in ``error_file`` or a stop signal came
    (``stopping``: torchrun's shutdown report follows, and the ranks record where they
    stopped), and except torchrun's own tracebacks (``TorchrunReportFilter``); returns the last
    ``keep_bytes`` of it, unfiltered. A second Ctrl-C leaves at once: this process exits and
    every rank dies with it."""
    out = getattr(sys.stderr, "buffer", None)
    shown = TorchrunReportFilter()
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
            _write(out, shown.finish() if not error_file.exists() and not stopping else b"")
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
            _write(out, shown.feed(chunk))


def _write(out, data: bytes) -> None:
    if not data:
        return
    if out is not None:
        out.write(data)
        out.flush()
    else:
        sys.stderr.write(data.decode(errors="replace"))


def launcher_exception(stderr_tail: bytes) -> str | None:
    """``torch.distributed.X: message`` when that ends torchrun's output: its own failure
    (rendezvous, store), not a rank's. A rank's failure ends with torchrun's ChildFailedError
    report, whose rank tracebacks were shown above it."""
    lines = [line.strip() for line in stderr_tail.decode(errors="replace").splitlines() if line.strip()]
    if lines and lines[-1].startswith("torch.distributed.") and "ChildFailedError" not in lines[-1]:
        return lines[-1].removeprefix("torch.distributed.")
    return None
