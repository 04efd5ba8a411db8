"""Process helpers shared by the trainer ranks, the rollout server launcher and the tests:
lifetime (die with the parent) and a free port to listen on."""

from __future__ import annotations

import signal
import socket


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (PR_SET_PDEATHSIG).

    Used (a) by a trainer rank, whose parent is torchrun's agent: torchrun starts workers in
    their own sessions, so a killed launcher would otherwise leave ranks running that keep
    training and writing checkpoints beside the resumed run; (b) in a launched rollout server
    before exec, so a trainer killed with -9 leaves no engine holding its port and memory.
    A no-op where prctl is unavailable.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
