"""The CPU demo's experiment config as a dict (``BASE``, yaml_configs/demo_cpu.yaml) and one key
of it changed (``with_change``), for the config tests (tests/test_config.py,
test_router_replay.py); ``experiment``, a config of a few given sections for the tests of code
that reads several."""

from pathlib import Path

import yaml

from megatron_grpo.config import DataConfig, ExperimentConfig, ModelConfig, ParallelConfig, TrainerConfig
from megatron_grpo.config.experiment import apply_overrides

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "yaml_configs" / "demo_cpu.yaml").read_text())


def with_change(dotted, value):
    """``BASE`` with ``dotted`` set to ``value`` (a new dict: ``BASE`` is left as it is)."""
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return apply_overrides(BASE, [f"{dotted}={text}"])


def experiment(**sections) -> ExperimentConfig:
    """An ExperimentConfig of the given sections (``engine=EngineConfig(...)``,
    ``sync=SyncConfig(...)``, ``rollout=...``, ``episodes=...``) with placeholders for the
    required ones and a global batch of 1 (it divides any rollout batch): what the code that
    reads several sections (the server manager, the weight sync, the pre-flight rules,
    generate_and_score) is given in the tests that build no run."""
    placeholders = dict(model=ModelConfig(hf_dir="unused"), data=DataConfig(train_file="unused.jsonl"),
                        trainer=TrainerConfig(run_dir="unused"), parallel=ParallelConfig(global_batch_size=1))
    return ExperimentConfig(**{**placeholders, **sections})
