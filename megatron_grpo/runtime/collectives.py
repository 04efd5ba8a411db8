"""The run's object collectives over the default group, and the run-level error they agree on.

Rank 0 owns the engine, the data and the logging; the other ranks learn what it decided
through ``broadcast``; ``agree`` gathers each rank's error line so that all raise together. When
the ranks agree that the run cannot go on (an engine that stays
down, non-finite losses, a lost peer), every rank raises a ``RunAborted`` with the same line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist


class RunAborted(RuntimeError):
    """The run cannot continue; ``str(e)`` is one line saying why (exit code 1)."""


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a pickled object; collective over the default group, a
    no-op without one)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass(frozen=True)
class FirstFailure:
    """What ``agree`` found: the lowest failed rank's line, how many other ranks failed, and the
    world size (a one-rank run names no rank)."""

    rank: int
    line: str
    others: int
    world: int

    def __str__(self) -> str:
        more = f" (and {self.others} more ranks)" if self.others else ""
        return f"rank {self.rank}{more}: {self.line}"


def agree(error: Optional[str]) -> Optional[FirstFailure]:
    """Collective over the default group (a no-op without one): every rank's ``error`` (one line;
    None when its part went well) gathered, so every rank returns the same answer and raises, or
    goes on, together: None when no rank failed, else the lowest failed rank's ``FirstFailure``."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(rank, line) for rank, line in enumerate(errors) if line]
    if not failed:
        return None
    rank, line = failed[0]
    return FirstFailure(rank, line, len(failed) - 1, len(errors))
