"""The GRPO loop: build the trainer (resuming when a checkpoint exists), then one
``Trainer.step`` per step. What a step does is in ``trainer/trainer.py``'s docstring.

Every rank runs ``train`` (torchrun); rank 0 also owns the engine's generation, the data and
the logging.
"""

from __future__ import annotations

from typing import Optional

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.generation.manager import RolloutServerManager
from megatron_grpo.preflight.errors import PLUGIN_ERRORS
from megatron_grpo.runtime import stop
from megatron_grpo.trainer import checkpoint as ckpt
from megatron_grpo.trainer.trainer import Trainer


def train(cfg: ExperimentConfig, spawned: Optional[RolloutServerManager] = None) -> list[dict]:
    """Run the experiment; returns rank 0's metric records (empty on other ranks). A stop
    signal (``runtime/stop.py``) ends it after the step in progress: ``RunStopped``.
    ``spawned``: rank 0's rollout servers, started at its start-up (``Trainer.build``)."""
    trainer = Trainer.build(cfg, spawned)
    try:
        if trainer.start_step == 0 and cfg.eval.at_start:
            trainer.evaluate_at_start()
        trainer.logger.begin_training()
        stop_before(trainer, trainer.start_step)
        for step in range(trainer.start_step, cfg.trainer.num_steps):
            try:
                trainer.step(step)
            except stop.StepInterrupted:  # the engine died with the stop signal mid-rollout
                stop_before(trainer, step)  # raises RunStopped: the finished steps are saved
                raise
            except PLUGIN_ERRORS as e:  # the one line says which step the plug-in broke in
                raise type(e)(f"step {step + 1}: {e}") from e
            if step + 1 < cfg.trainer.num_steps:  # after the last step the run is done anyway
                stop_before(trainer, step + 1)
        trainer.logger.finish(print_summary=True)
    finally:
        trainer.close()
    return trainer.records


def stop_before(trainer: Trainer, steps_done: int) -> None:
    """Collective: raise ``RunStopped`` when any rank received a stop signal, after saving a
    checkpoint of the ``steps_done`` finished steps (``checkpoint.save_on_stop``) unless this
    step's own checkpoint, or the one resumed from, already holds them."""
    signum = stop.agreed_signal()
    if not signum:
        return
    cfg = trainer.cfg
    name = stop.signal_name(signum)
    if steps_done == trainer.start_step or trainer.checkpoint_due(steps_done):
        saved = f"the newest checkpoint already holds step {steps_done}" if steps_done else "no step had finished"
    elif cfg.checkpoint.save_on_stop:
        trainer.save_checkpoint(steps_done)
        saved = f"saved a checkpoint of step {steps_done}"
    else:
        saved = "saved nothing (checkpoint.save_on_stop is false)"
    resume = ("the same command resumes from the newest one" if ckpt.complete_checkpoints(cfg.trainer.run_dir)
              else "there is none yet: the same command starts over")
    raise stop.RunStopped(
        f"stopped by {name} after step {steps_done} of {cfg.trainer.num_steps}: {saved} in "
        f"{ckpt.checkpoints_dir(cfg.trainer.run_dir)}; {resume}", signum)
