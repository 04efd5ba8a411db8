"""Read a prompt file (JSONL or Parquet) into raw records, each tagged with where it came from.

This is the only place that touches the dataset file. Every problem is a ``DataError`` whose
one-line message starts with the location, compiler-style, so a user can jump to it:

* JSONL: ``data/train.jsonl:17: invalid JSON: Expecting ',' delimiter (column 12)`` (lines are
  1-based, as in any editor; blank lines are skipped);
* Parquet: ``data/train.parquet: row 17: 'answer' is null`` (rows are 0-based, as in pandas
  and pyarrow slicing).

The prompt and answer fields are validated; the row's other fields are kept as they are
(``RawRecord.fields``) and handed to reward functions that ask for them (``row``), so a GSM8K
or MATH dump with extra columns loads as is and a reward can use, say, its test cases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A problem with the prompt dataset; ``str(e)`` is one line naming the file and line/key."""


@dataclass(frozen=True)
class RawRecord:
    """One dataset row before validation: its location and the two fields (or absent)."""

    where: str
    """``path:line`` (JSONL) or ``path: row N`` (Parquet), the prefix of every error."""

    prompt: Any
    answer: Any
    has_prompt: bool
    has_answer: bool
    fields: dict = field(default_factory=dict, compare=False)
    """The row's other fields (neither the prompt nor the answer), unvalidated."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    """``object_pairs_hook``: the json module keeps the last of two equal keys silently."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _refuse_constant(name: str):
    """``parse_constant``: NaN and Infinity are not JSON, though Python's parser accepts them."""
    raise ValueError(f"{name} is not valid JSON (use null or a string)")


def parse_json_line(line: str, where: str) -> Any:
    """One JSONL line -> its value; every way it can fail is a DataError starting with ``where``:
    bad syntax, duplicate keys, NaN/Infinity, integers past Python's 4300-digit limit, nesting
    past the recursion limit, and lone UTF-16 surrogates (``"\\ud800"``), which parse but are
    not text a tokenizer can encode."""
    try:
        obj = json.loads(line, object_pairs_hook=_refuse_duplicates, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: invalid JSON: nested too deeply") from None
    except ValueError as e:  # our hooks, and int() past sys.get_int_max_str_digits()
        reason = "an integer has more than 4300 digits" if "integer string conversion" in str(e) else _one_line(e)
        raise DataError(f"{where}: invalid JSON: {reason}") from None
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: holds a lone UTF-16 surrogate ({e.object[e.start:e.end]!a}), not valid text") from None
    except RecursionError:
        raise DataError(f"{where}: invalid JSON: nested too deeply") from None
    return obj


def read_jsonl(path: Path, prompt_key: str, answer_key: str) -> list[RawRecord]:
    """Parse ``path`` line by line; raises DataError naming the first bad line."""
    records = []
    with open(path, "rb") as f:  # bytes: a bad UTF-8 sequence is reported with its line
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not valid UTF-8 ({_one_line(e.reason)} at byte {e.start})") from None
            if not line.strip():
                continue
            obj = parse_json_line(line, where)
            if not isinstance(obj, dict):
                raise DataError(
                    f"{where}: expected a JSON object with '{prompt_key}' and '{answer_key}', "
                    f"got {type(obj).__name__}"
                )
            others = {k: v for k, v in obj.items() if k not in (prompt_key, answer_key)}
            records.append(
                RawRecord(where, obj.get(prompt_key), obj.get(answer_key), prompt_key in obj, answer_key in obj,
                          others)
            )
    return records


def read_parquet(path: Path, prompt_key: str, answer_key: str) -> list[RawRecord]:
    """Read the two columns of a Parquet file; a missing column names the file and the columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file: {_one_line(e)}") from None
    for key, cfg_key in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if key not in schema.names:
            raise DataError(
                f"{path}: no column '{key}' ({cfg_key}); columns: {', '.join(schema.names) or '(none)'}"
            )
    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read: {_one_line(e)}") from None
    return [RawRecord(f"{path}: row {i}", r[prompt_key], r[answer_key], True, True,
                      {k: v for k, v in r.items() if k not in (prompt_key, answer_key)})
            for i, r in enumerate(rows)]


READERS = {".jsonl": read_jsonl, ".parquet": read_parquet}
"""File suffix -> reader; the single dispatch point for dataset formats."""


def read_records(path: str | Path, prompt_key: str, answer_key: str, key: str = "data.train_file") -> list[RawRecord]:
    """All records of a .jsonl/.parquet prompt file; DataError if missing, unreadable or empty.
    ``key`` is the config key that names the file (``eval.sets[0].path``, ...), for the errors."""
    path = Path(path)
    reader = READERS.get(path.suffix)
    if reader is None:
        raise DataError(f"{path}: unsupported dataset format ({key} must end in {' or '.join(READERS)})")
    if not path.exists():
        raise DataError(f"{path}: file not found ({key})")
    if not path.is_file():
        raise DataError(f"{path}: not a regular file ({key})")
    try:
        records = reader(path, prompt_key, answer_key)
    except OSError as e:
        raise DataError(f"{path}: cannot read: {_one_line(e.strerror or e)}") from None
    if not records:
        raise DataError(f"{path}: the dataset is empty (no records)")
    return records
