"""Typed, strict experiment configuration (one YAML file per experiment)."""

from megatron_grpo.config.algorithm import AlgorithmConfig, OffPolicyCorrectionConfig
from megatron_grpo.config.base import ConfigError
from megatron_grpo.config.engine import EmbeddedConfig, EngineConfig, SGLangConfig
from megatron_grpo.config.episodes import EpisodesConfig
from megatron_grpo.config.evaluation import EvalConfig, EvalSetConfig
from megatron_grpo.config.experiment import ExperimentConfig, load_config
from megatron_grpo.config.model import ModelConfig, ParallelConfig
from megatron_grpo.config.rollout import RolloutConfig
from megatron_grpo.config.sections import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    OptimizerConfig,
    RemoteRewardConfig,
    RewardConfig,
    RewardFunctionConfig,
    TrainerConfig,
)
from megatron_grpo.config.sync import SyncConfig

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "EmbeddedConfig",
    "EngineConfig",
    "EpisodesConfig",
    "EvalConfig",
    "EvalSetConfig",
    "ExperimentConfig",
    "LoggingConfig",
    "ModelConfig",
    "OffPolicyCorrectionConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "RemoteRewardConfig",
    "RewardConfig",
    "RewardFunctionConfig",
    "RolloutConfig",
    "SGLangConfig",
    "SyncConfig",
    "TrainerConfig",
    "load_config",
]
