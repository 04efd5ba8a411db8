"""Every thread's Python stack on demand, for a run that hangs: ``kill -USR1 PID`` of a rank
appends its stacks to ``RUN_DIR/debug/stacks_rank<R>.txt`` (the standard library's
``faulthandler``, so it works while the main thread is stuck in C code: a collective, a socket
read, a lock). A file rather than stderr: after a stop signal the launcher no longer copies the
ranks' stderr, and a slow stop is when the stacks are wanted (py-spy is the same view from
outside, where it is installed).
"""

from __future__ import annotations

import faulthandler
import signal
from pathlib import Path
from typing import IO, Optional

DUMP_SIGNAL = signal.SIGUSR1
_file: Optional[IO[str]] = None  # kept open: faulthandler writes to its file descriptor


def stacks_file(run_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` of the run in ``run_dir`` writes its stacks."""
    return Path(run_dir) / "debug" / f"stacks_rank{rank}.txt"


def dump_stacks_on_signal(run_dir: str | Path, rank: int) -> Path:
    """From now on ``DUMP_SIGNAL`` appends this process's stacks (all threads) to
    ``stacks_file(run_dir, rank)``; returns that path. Main thread, once per process."""
    global _file
    path = stacks_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    _file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - must outlive this call
    faulthandler.register(DUMP_SIGNAL, file=_file, all_threads=True, chain=False)
    return path
