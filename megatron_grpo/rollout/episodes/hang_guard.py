"""One step's deadline expiries of environments and agents, and when they stop the run.

An environment call or an agent episode past its deadline ends its episode as a ``timeout``,
and the run goes on: one hang in a flaky sandbox should not end a long run. But when the
source itself hangs, every episode waits out its own deadline in turn: a 256-sample step at
64 episodes at a time would take four deadlines before anything is said, and the issue that
asked for this (64) found the same pattern costing a reward function hours. So a step counts
its started episodes and their expiries; when the expiries reach ``max_fraction`` of the
started episodes (and at least two), the source is taken as hung: every worker still running
is killed at once, no further episode starts, and the step raises ``EpisodesHung``, one line.
A source that hangs on every call thus ends the run after one wave of deadlines (two when one
episode runs at a time); ``max_fraction`` null keeps the per-episode recovery alone.
"""

from __future__ import annotations

import threading
from typing import Optional

from megatron_grpo.rollout.episodes.environment.worker import kill_worker


class EpisodesHung(RuntimeError):
    """The step's episodes passed their deadline too often: one line naming the key, the
    deadline and the counts; the run stops."""


class HangGuard:
    """The counts of one step (thread-safe: episodes run on a thread pool).

    ``begin()`` before an episode starts (raises once the guard has tripped); ``watch(pid)`` /
    ``forget(pid)`` around a worker process's life; ``failed(kind)`` when an episode's worker
    failed; ``check()`` before each blocking call, and once every episode has ended."""

    def __init__(self, what: str, deadline_s: float, max_fraction: Optional[float]):
        """``what``: the source, as the line names it (``episodes.environment env.py:Env``);
        ``deadline_s``: ``episodes.timeout_s`` as resolved for its kind."""
        self.what, self.deadline_s = what, deadline_s
        self.max_fraction = max_fraction
        self._lock = threading.Lock()
        self.started = self.timeouts = 0
        self._pids: set[int] = set()
        self.hung: Optional[EpisodesHung] = None

    def begin(self) -> None:
        with self._lock:
            self.check()
            self.started += 1

    def check(self) -> None:
        if self.hung is not None:
            raise self.hung

    def watch(self, pid: int) -> None:
        """A worker now runs for this step; killed at once if the guard has tripped."""
        with self._lock:
            self._pids.add(pid)
            tripped = self.hung is not None
        if tripped:
            kill_worker(pid)

    def forget(self, pid: int) -> None:
        with self._lock:
            self._pids.discard(pid)

    def failed(self, kind: str) -> None:
        """An episode's worker failed (``kind``: ``timeout`` or ``error``): a timeout is counted
        and may trip the guard; once tripped this raises, because a worker the guard killed is
        not its episode's error."""
        if kind == "timeout":
            self._timed_out()
        self.check()

    def _timed_out(self) -> None:
        """A deadline expired (its worker is already killed); trips the guard past the fraction."""
        with self._lock:
            self.timeouts += 1
            if (self.hung is not None or self.max_fraction is None or self.timeouts < 2
                    or self.timeouts < self.max_fraction * self.started):
                return
            self.hung = EpisodesHung(
                f"{self.what}: {self.timeouts} of the {self.started} episodes started this step passed "
                f"episodes.timeout_s={self.deadline_s:g}s, episodes.max_timeout_fraction={self.max_fraction:g} of "
                "them: it hangs; every worker was killed and the run stops (a rare hang is recovered: raise "
                "the fraction, or null, to recover more)")
            pids, self._pids = list(self._pids), set()
        for pid in pids:
            kill_worker(pid)
