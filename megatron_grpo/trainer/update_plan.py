"""The mini-batch arithmetic of a run, derived once from the config.

A step's rollout batch holds ``rollout.batch_size`` sequences; each of the
``algorithm.num_iterations`` epochs over it is ``num_mini_batches`` optimizer steps of
``parallel.global_batch_size`` sequences, each DP rank holding ``local_size`` of them. Optimizer
steps are numbered across the run (``optimizer_step``), which is what the learning-rate
schedule (``trainer.optim.lr_at``) reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_grpo.config import ExperimentConfig, OptimizerConfig
from megatron_grpo.trainer.optim import lr_at, set_lr


@dataclass(frozen=True)
class UpdatePlan:
    """How one rollout batch becomes optimizer steps (see the module docstring)."""

    batch_size: int
    """Sequences per rollout batch (prompts_per_step x num_generations)."""
    num_mini_batches: int
    """Optimizer steps per rollout batch and iteration (the config checks divisibility)."""
    global_batch_size: int
    """Sequences per optimizer step, over every DP rank."""
    dp: int
    num_iterations: int
    num_steps: int
    """Rollout steps of the run."""
    optimizer_cfg: OptimizerConfig
    """The learning-rate schedule's settings."""

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, dp: int) -> "UpdatePlan":
        return cls(batch_size=cfg.rollout.batch_size, num_mini_batches=cfg.mini_batches_per_step,
                   global_batch_size=cfg.parallel.global_batch_size, dp=dp,
                   num_iterations=cfg.algorithm.num_iterations, num_steps=cfg.trainer.num_steps,
                   optimizer_cfg=cfg.optimizer)

    @property
    def local_size(self) -> int:
        """Sequences of one mini-batch on one DP rank."""
        return self.global_batch_size // self.dp

    @property
    def total_optimizer_steps(self) -> int:
        return self.num_steps * self.num_iterations * self.num_mini_batches

    def optimizer_step(self, step: int, iteration: int, mini_batch: int) -> int:
        """0-based index over the run of the optimizer step (``step``, ``iteration``, ``mini_batch``)."""
        return (step * self.num_iterations + iteration) * self.num_mini_batches + mini_batch

    def global_rows(self, mini_batch: int) -> slice:
        """Rows of mini-batch ``mini_batch`` in the whole (broadcast) rollout batch."""
        return slice(mini_batch * self.global_batch_size, (mini_batch + 1) * self.global_batch_size)

    def local_rows(self, mini_batch: int) -> slice:
        """Rows of mini-batch ``mini_batch`` in this DP rank's shard (``batch.dp_shard``)."""
        return slice(mini_batch * self.local_size, (mini_batch + 1) * self.local_size)

    def set_lr(self, optimizer, step: int, iteration: int, mini_batch: int) -> None:
        """Set the learning rate of that optimizer step, from the run's one schedule."""
        set_lr(optimizer, lr_at(self.optimizer_step(step, iteration, mini_batch), self.optimizer_cfg,
                                self.total_optimizer_steps))
