"""Generate the config reference (every key, its type, default and doc) from the dataclasses.

`yaml_configs/REFERENCE.md` is this module's output; `tests/test_config_reference.py`
fails when the two drift apart. Regenerate with
`megatron-grpo config-reference --write yaml_configs/REFERENCE.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from megatron_grpo.config.aliases import DEPRECATED_KEYS, replacement
from megatron_grpo.config.base import field_types, field_docs, type_name
from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.runtime.files import write_text_atomic

_REQUIRED = "(required)"


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return _REQUIRED
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return "[" + ", ".join(str(dataclasses.asdict(v)) for v in value) + "]"
    return repr(value) if isinstance(value, str) else str(value)


def _section_rows(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
    rows = []
    docs = field_docs(cls)
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        rows.append((key, type_name(tp), _default(f), docs.get(f.name, "")))
        origin_args = typing.get_args(tp)
        optional = [a for a in origin_args if a is not type(None)] if type(None) in origin_args else []
        if dataclasses.is_dataclass(tp):
            rows += _section_rows(tp, f"{key}.")
        elif len(optional) == 1 and dataclasses.is_dataclass(optional[0]):  # a section that may be null
            rows += _section_rows(optional[0], f"{key}.")
        if typing.get_origin(tp) is list and origin_args and dataclasses.is_dataclass(origin_args[0]):
            rows += _section_rows(origin_args[0], f"{key}[].")
    return rows


def render() -> str:
    """The whole reference as Markdown."""
    out = [
        "# Experiment config reference",
        "",
        "Generated from the config dataclasses by `megatron-grpo config-reference`; do not edit",
        "by hand (a test compares this file with the code). Unknown keys, wrong types and invalid",
        "values are errors at load time. Any key can be overridden on the command line as",
        "`section.key=value`.",
        "",
    ]
    top_docs = field_docs(ExperimentConfig)
    for f in dataclasses.fields(ExperimentConfig):
        cls = field_types(ExperimentConfig)[f.name]
        out += [f"## `{f.name}`", "", top_docs.get(f.name, ""), ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for key, tp, default, doc in _section_rows(cls, f"{f.name}."):
            cell = lambda s: s.replace("|", "\\|")  # noqa: E731
            out.append(f"| `{key}` | {cell(tp)} | `{cell(default)}` | {cell(doc)} |")
        out.append("")
    out += [
        "## Deprecated keys",
        "",
        "Still accepted for one release, in the file and on the command line: each loads as its",
        "current key and prints one line naming it. Giving both names of a key in one place is an",
        "error. A key naming a section moves with the keys under it.",
        "",
        "| deprecated key | current key |",
        "|---|---|",
        *(f"| `{old}` | `{replacement(old, new)}` |" for old, new in DEPRECATED_KEYS.items()),
        "",
    ]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-grpo config-reference")
    parser.add_argument("--write", metavar="PATH", help="write the reference to PATH instead of stdout")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        write_text_atomic(args.write, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
