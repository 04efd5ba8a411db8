"""The step-time breakdown: consecutive laps of one clock, so the phases sum to the step.

Logged as ``time/<phase>_s`` with ``time/step_s`` their sum (the step's wall time from its
start to its metrics entry; the checkpoint written after the entry is not in it):

* ``generate``: waiting for the engine to sample in order (sync mode; the first step and
  retries in off-policy mode), plus drawing prompts and the broadcast of the batch;
* ``reward``: scoring those responses (rank 0; the other ranks wait in the broadcast);
* ``logprob``: old-policy and reference log-probs; ``teacher``: the distillation teacher's
  log-probs and its check (0 without ``distillation.teacher``); ``train``: the optimizer steps;
* ``idle``: waiting for the batch generated in the background (off-policy mode; 0 in sync);
* ``sync``: the weight sync; ``eval``: held-out evaluation; ``other``: the rest (gathering
  metrics). The background generation's own times are ``rollout/generate_s`` and
  ``rollout/reward_s`` (not part of the sum: they overlap the phases above).
"""

from __future__ import annotations

import time

PHASES = ("generate", "reward", "logprob", "teacher", "train", "idle", "sync", "eval", "other")


class StepTimer:
    """``lap(phase)`` adds the time since the previous lap to ``phase``."""

    def __init__(self):
        self.start = self.mark = time.monotonic()
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def lap(self, phase: str) -> float:
        now = time.monotonic()
        elapsed, self.mark = now - self.mark, now
        self.seconds[phase] += elapsed
        return elapsed

    def move(self, seconds: float, src: str, dst: str) -> None:
        """Re-attribute ``seconds`` (at most what ``src`` holds) of ``src`` to ``dst``."""
        seconds = min(max(seconds, 0.0), self.seconds[src])
        self.seconds[src] -= seconds
        self.seconds[dst] += seconds

    def finish(self) -> dict[str, float]:
        """The ``time/*_s`` metrics of the step (laps the remainder as ``other``)."""
        self.lap("other")
        out = {f"time/{phase}_s": s for phase, s in self.seconds.items()}
        out["time/step_s"] = sum(self.seconds.values())
        return out
