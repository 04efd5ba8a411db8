"""One run per run directory: an exclusive ``flock`` on ``<run_dir>/.lock``, which holds the
holder's pid.

Two runs started on one directory destroyed each other (issue 48): one's start-up deleted the
other's checkpoint in progress, and replaced ``metrics.jsonl`` while the other appended to the
deleted file. The lock is taken at the end of the pre-flight, before anything else is written
into the directory; a second run then stops in one line naming the holder's pid.

``flock`` is released by the kernel when the last descriptor of the holder's open file is
closed, so a holder killed with -9 leaves no stale lock: the next run simply takes it (the file
stays, with the dead pid, until it is overwritten). The descriptor is close-on-exec: a process
the holder execs (torchrun's ranks, an engine) does not keep the lock, a child it forks (torchrun's
agent, which outlives the launcher only while it stops its ranks) does.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from megatron_grpo.config.base import ConfigError

LOCK_FILE = ".lock"
KEY = "trainer.run_dir"


class RunDirLock:
    """A held lock; ``release()`` (idempotent) or use as a context manager."""

    def __init__(self, fd: int, path: Path):
        self.fd: int | None = fd
        self.path = path

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the kernel drops the flock with the descriptor
            self.fd = None

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> str:
    """The pid the holder wrote, or ``unknown`` (it has not written it yet)."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text if text.isdigit() else "unknown"


def lock_run_dir(run_dir: str | Path) -> RunDirLock:
    """Take ``run_dir``'s lock (creating the directory) for this process, or ConfigError naming
    ``trainer.run_dir`` and the pid of the run that holds it. Never waits."""
    path = Path(run_dir) / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # not through a link: the lock file is truncated and written, so a `.lock` planted as a
        # link (a shared run directory) would have this run overwrite the file it names
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise ConfigError(KEY, f"{run_dir}: cannot create {path}: {why}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or a device cannot be truncated and written
        os.close(fd)
        raise ConfigError(KEY, f"{run_dir}: {path} is not a regular file; remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise ConfigError(KEY, f"{run_dir} is in use by another run (pid {holder} holds {path}); stop it or "
                               "choose another trainer.run_dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return RunDirLock(fd, path)
