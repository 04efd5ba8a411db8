"""A stop request (SIGTERM, as Slurm sends before preemption, or Ctrl-C's SIGINT) turned
into a clean stop at the next step boundary instead of a traceback mid-step.

A rank records the first such signal and carries on; the trainer asks ``agreed_signal()``
(collective) after each step, so every rank of every node stops after the same step even
when the signal reached them at different moments (or reached only some of them). Repeated
signals are ignored: torchrun forwards the signal the launcher or Slurm already sent, and
a second copy must not turn the clean stop into a kill. A user who wants out at once presses
Ctrl-C twice at the launcher, which then exits, and every rank dies with it
(``process.die_with_parent``).
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_received: int = 0  # the first stop signal's number, 0 while none came


def _record(signum: int, frame) -> None:
    global _received
    if not _received:
        _received = signum


_installed = False


def install() -> None:
    """Record SIGTERM and SIGINT instead of dying of them (main thread only)."""
    global _installed
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)
    _installed = True


def reinstall_if_replaced() -> list[str]:
    """Where ``install`` ran and a plug-in's import has since replaced a stop handler (a reward
    module's ``signal.signal(SIGTERM, SIG_IGN)``: the rank then trained through a stop until
    torchrun killed it, ``checkpoint.stop_timeout_s`` later, nothing saved), put the handlers
    back; the names of the signals that had been taken (main thread only)."""
    taken = [signal_name(s) for s in STOP_SIGNALS if _installed and signal.getsignal(s) is not _record]
    if taken:
        install()
    return taken


def received() -> int:
    """This process's recorded stop signal (0: none)."""
    return _received


def agreed_signal() -> int:
    """Collective over the default group: the stop signal any rank received (0: none), the
    same on every rank. One tiny all-reduce per call."""
    flag = torch.tensor([_received], dtype=torch.int64)
    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15, ..."""
    return signal.Signals(signum).name


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by ``signum``: 143 for SIGTERM, 130 for SIGINT."""
    return 128 + signum


class RunStopped(Exception):
    """The run stopped on request after a finished step; ``str(e)`` is the one line to print."""

    def __init__(self, line: str, signum: int):
        super().__init__(line)
        self.signum = signum


class StepInterrupted(Exception):
    """A stop signal came and the rollout engine failed during the step in progress (under
    Slurm the engine gets the same SIGTERM as the ranks): the step cannot finish without it,
    so the run stops after the previous, finished step instead of restarting the engine."""
