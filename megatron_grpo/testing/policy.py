"""The trainer's own policy (``trainer.components.build_policy``: megatron-core model chunks
and optimizer) for tests that drive one step by hand, from a model and an optimizer section
alone; run inside an initialized rank (``testing.distributed.run_distributed``)."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_grpo.trainer.components import build_policy


def build_test_policy(model, optimizer):
    """``build_policy`` for a ``ModelConfig`` and an ``OptimizerConfig``, with the plain
    megatron optimizer and no sequence parallelism (the CPU path)."""
    parallel = SimpleNamespace(use_distributed_optimizer=False, sequence_parallel=False, pack_sequences=False)
    return build_policy(SimpleNamespace(model=model, optimizer=optimizer, parallel=parallel))
