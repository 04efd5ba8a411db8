"""The run's object collectives over the default group, and the run-level error they agree on.

Rank 0 owns the engine, the data and the logging; the other ranks learn what it decided
through ``broadcast``. When the ranks agree that the run cannot go on (an engine that stays
down, non-finite losses, a lost peer), every rank raises a ``RunAborted`` with the same line.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class RunAborted(RuntimeError):
    """The run cannot continue; ``str(e)`` is one line saying why (exit code 1)."""


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a pickled object; collective over the default group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
