"""The generated reference and the schema must not drift apart; every field has a doc."""

import dataclasses
from pathlib import Path

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.config.base import field_types, field_docs
from megatron_grpo.config.reference import render

ROOT = Path(__file__).resolve().parent.parent


def test_reference_file_matches_schema():
    committed = (ROOT / "yaml_configs" / "REFERENCE.md").read_text()
    assert committed == render(), (
        "yaml_configs/REFERENCE.md is stale: run "
        "`megatron-grpo config-reference --write yaml_configs/REFERENCE.md`"
    )


def _walk(cls):
    yield cls
    for f in dataclasses.fields(cls):
        tp = field_types(cls)[f.name]
        args = getattr(tp, "__args__", ()) or ()
        for t in (tp, *args):
            if dataclasses.is_dataclass(t):
                yield from _walk(t)


def test_every_field_is_documented():
    missing = [
        f"{cls.__name__}.{f.name}"
        for cls in _walk(ExperimentConfig)
        for f in dataclasses.fields(cls)
        if not field_docs(cls).get(f.name)
    ]
    assert not missing, f"fields without a docstring: {missing}"
