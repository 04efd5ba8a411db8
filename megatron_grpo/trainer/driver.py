"""The GRPO loop: build the trainer (resuming when a checkpoint exists), then one
``Trainer.step`` per step. What a step does is in ``trainer/trainer.py``'s docstring.

Every rank runs ``train`` (torchrun); rank 0 also owns the engine's generation, the data and
the logging.
"""

from __future__ import annotations

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.trainer.trainer import Trainer


def train(cfg: ExperimentConfig) -> list[dict]:
    """Run the experiment; returns rank 0's metric records (empty on other ranks)."""
    trainer = Trainer.build(cfg)
    try:
        trainer.logger.begin_training()
        for step in range(trainer.start_step, cfg.trainer.num_steps):
            trainer.step(step)
        trainer.logger.finish(print_summary=True)
    finally:
        trainer.close()
    return trainer.records
