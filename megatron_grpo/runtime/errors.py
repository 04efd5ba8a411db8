"""An exception as one line: how every layer reports a failure it caught (an engine's answer,
a weight sync's agreement, a reward worker, an environment's loader, the agent front's 500).

Imports nothing heavy: reward and environment workers, which never load torch, use it too.
"""

from __future__ import annotations

from typing import Optional


LIMIT = 300
"""Characters of the message kept by default: a line a terminal shows whole, not a tensor's repr."""


def one_line(e: BaseException, limit: Optional[int] = LIMIT) -> str:
    """``Type: message`` on one line (its whitespace runs, newlines included, become one space),
    the message cut at ``limit`` characters (None: whole); ``Type`` alone for an empty message."""
    text = " ".join(str(e).split())
    if limit is not None:
        text = text[:limit]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
