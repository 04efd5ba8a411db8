"""The CPU demo's experiment config as a dict (``BASE``, yaml_configs/demo_cpu.yaml) and one key
of it changed (``with_change``), for the config tests (tests/test_config.py,
test_router_replay.py)."""

from pathlib import Path

import yaml

from megatron_grpo.config.experiment import apply_overrides

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "yaml_configs" / "demo_cpu.yaml").read_text())


def with_change(dotted, value):
    """``BASE`` with ``dotted`` set to ``value`` (a new dict: ``BASE`` is left as it is)."""
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return apply_overrides(BASE, [f"{dotted}={text}"])
