"""The trainer's own policy (``trainer.components.build_policy``: megatron-core model chunks
and optimizer) for tests that drive one step by hand, from a model and an optimizer section
alone; run inside an initialized rank (``tests.support.distributed.run_distributed``)."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_grpo.config.model import ParallelConfig
from megatron_grpo.trainer.components import build_policy


def build_test_policy(model, optimizer):
    """``build_policy`` for a ``ModelConfig`` and an ``OptimizerConfig``, with the default
    ``parallel`` section (the plain megatron optimizer, no sequence parallelism: the CPU path);
    ``build_policy`` reads only these three sections of an ExperimentConfig."""
    return build_policy(SimpleNamespace(model=model, optimizer=optimizer, parallel=ParallelConfig()))
