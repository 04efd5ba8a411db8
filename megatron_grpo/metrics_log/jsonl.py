"""``metrics.jsonl``: one JSON object per step, durable and consistent across resumes.

Each step's line is appended, flushed and fsync'd, so a ``kill -9`` loses at most the line
being written. On start the file is cut back to the steps the run resumes from (the
checkpoint's step; 0 for a fresh start): later entries, and a partial last line, belong to
work that is about to be redone. The cut is written to a temp file and renamed over the old
one, so the file is never half-rewritten.

Values are plain JSON: tensors and numpy scalars become numbers; NaN and infinities become
``null`` (strict JSON has no NaN, and ``jq`` or a browser would reject the file).
"""

from __future__ import annotations

import json
import math
import numbers
import os
from pathlib import Path
from typing import Any


def json_value(key: str, value: Any) -> Any:
    """A metric value as a JSON scalar: bool/int/str kept, reals -> float (non-finite -> None)."""
    if hasattr(value, "item") and callable(value.item):  # torch / numpy scalar
        value = value.item()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    raise TypeError(f"metric {key!r} has unsupported type {type(value).__name__}; log scalars only")


def read_metrics(path: str | Path) -> list[dict]:
    """Entries of a metrics file in order; stops at the first unparsable (partial) line."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    with open(path, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                break  # a line cut by a crash; nothing after it can be trusted
            if not isinstance(obj, dict) or not isinstance(obj.get("step"), int):
                break
            records.append(obj)
    return records


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def truncate_metrics(path: str | Path, resumed_step: int) -> list[dict]:
    """Keep only the entries with ``step <= resumed_step`` (atomic rewrite); returns them."""
    path = Path(path)
    if not path.exists():
        return []
    kept = [r for r in read_metrics(path) if r["step"] <= resumed_step]
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        for r in kept:
            f.write(json.dumps(r, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return kept


class MetricsFile:
    """Appends one fsync'd JSON line per step to ``path``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = open(self.path, "a")

    def append(self, record: dict) -> None:
        self._f.write(json.dumps(record, allow_nan=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
