"""A fully checked experiment config: ``config``'s loader, then the pre-flight's config rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from megatron_grpo.config import experiment
from megatron_grpo.config.base import ConfigError
from megatron_grpo.config.experiment import ExperimentConfig, error_source
from megatron_grpo.preflight.rules import check_experiment


def build_experiment(raw: Any, world_size: Optional[int] = None) -> ExperimentConfig:
    """``config.experiment.build_experiment`` (a parsed YAML mapping), then ``check_experiment``."""
    cfg = experiment.build_experiment(raw, world_size)
    check_experiment(cfg)
    return cfg


def load_experiment(path: str | Path, overrides: list[str] | None = None,
                    world_size: Optional[int] = None, *, announce_deprecated: bool = True) -> ExperimentConfig:
    """Read, override and validate an experiment YAML (``config.load_config``), then check the
    rules that cross sections and packages. Every problem is a one-line ConfigError naming
    ``path`` (or the override that set the bad value) and the dotted key.
    ``announce_deprecated``: print the line of each deprecated key (see ``load_config``)."""
    cfg = experiment.load_config(path, overrides, world_size, announce_deprecated=announce_deprecated)
    try:
        check_experiment(cfg)
    except ConfigError as e:
        raise e.with_source(error_source(e.where, overrides or [], str(path))) from None
    return cfg
