"""Where each step's rollout batch comes from: ``rollout.mode`` sync or one_step_off_policy.

sync (the default): at the start of step k rank 0 draws prompts and the engine, which serves
the weights trained by steps < k (version k), generates; the batch is broadcast. Policy lag 0.

one_step_off_policy: as soon as batch k is in hand, rank 0 draws the prompts of step k+1 and a
background thread generates and scores them (rank 0 only) while every rank trains on step k.
After the update the trainer waits for it (``collect_next``; the wait is ``time/idle_s``), then
syncs the weights of step k+1. Batch k+1 was sampled by version k: policy lag 1 from the second
step on (the first step, and the first after a resume, have lag 0). ``rollout/policy_lag`` is
``step - weight_version``, the version the engine reports (steps 0-based here).

Departures and choices (docs/off_policy.md#one-step-off-policy-rollouts-rolloutmode):

* pi_old in the loss is the trainer's recomputed log-probs of the weights it holds (decoupled
  PPO's proximal policy); the engine's log-probs are the behaviour policy mu, and the staleness
  shows in rho = pi_old / mu, which ``algorithm.off_policy_correction`` weights or masks.
* The engine is never written to while it generates: the sync waits for the in-flight batch.
  Evaluation runs after the sync, when nothing is in flight.
* A failed background generation is recovered as in sync mode (``EngineSupervisor.rollout``:
  restart, sync the current weights, same prompts and seed); that batch then has lag 0.
* A checkpoint written while a batch is prefetched stores the data position from before that
  batch's draw: a resumed run draws the same prompts again, in order (fresher responses).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Optional, Protocol

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.rollout.async_source import AsyncRolloutSchedule
from megatron_grpo.rollout.generate import GenerationContext, RolloutResult, generate_and_score
from megatron_grpo.rollout.supervisor import EngineSupervisor


class RolloutSource(Protocol):
    """Where the trainer's batches come from (``rollout.mode``): what ``Trainer.step`` calls.

    ``batch_for`` and ``collect_next`` are collective; ``state`` and ``close`` are rank 0's
    (the other ranks hold no data position). A source resumes from ``state()``'s value, given
    to its constructor (``build_rollout_source``)."""

    def batch_for(self, step: int) -> tuple[RolloutResult, bool]:
        """Step ``step``'s batch on every rank, and whether it was generated now, in order."""

    def collect_next(self, step: int) -> None:
        """After step ``step``'s update, before its weight sync: whatever must be in hand then."""

    def state(self) -> dict:
        """Rank 0: what a checkpoint keeps (``sampler``: the data position; ``rollouts``: more)."""

    def close(self) -> None:
        """No thread or request of the source outlives the run."""


def build_rollout_source(cfg: ExperimentConfig, engine: EngineSupervisor, ctx: Optional[GenerationContext],
                         sampler, start_step: int, resume: Optional[dict] = None) -> RolloutSource:
    """The source of ``rollout.mode``. ctx, sampler: rank 0's (None elsewhere); resume: the
    checkpoint's ``state()`` (None: a fresh run)."""
    if cfg.rollout.mode == "async":
        return AsyncRolloutSchedule(cfg, engine, ctx, sampler, start_step, (resume or {}).get("rollouts"))
    return RolloutSchedule(cfg.rollout.mode == "one_step_off_policy", engine, ctx, sampler, cfg.trainer.num_steps)


class RolloutSchedule:
    """The sync and one-step-off-policy ``RolloutSource``: ``batch_for(step)`` at the start of a
    step, ``collect_next(step)`` after its update.

    engine: every rank's EngineSupervisor; ctx and sampler: rank 0's GenerationContext and
    PromptSampler (None elsewhere); num_steps: the run's last step (exclusive).
    """

    def __init__(self, overlap: bool, engine: EngineSupervisor, ctx: Optional[GenerationContext], sampler,
                 num_steps: int):
        self.overlap = overlap  # rollout.mode == one_step_off_policy
        self.engine = engine
        self.ctx = ctx
        self.sampler = sampler
        self.num_steps = num_steps
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") if self.overlap else None
        self._in_flight: Optional[tuple[int, list, Future]] = None  # rank 0: (step, prompts, generation)
        self._ready: Optional[tuple[int, RolloutResult]] = None  # every rank: the collected next batch
        self._state_before_draw: Optional[dict] = None  # rank 0: data position before the prefetched draw

    def batch_for(self, step: int) -> tuple[RolloutResult, bool]:
        """Collective: step ``step``'s batch on every rank, with ``rollout/policy_lag``, and
        whether it was generated now, in order (False: collected from the background). In
        off-policy mode this also starts generating step+1's batch in the background."""
        in_order = self._ready is None
        if not in_order:
            ready_step, result = self._ready
            assert ready_step == step, (ready_step, step)
            self._ready, self._state_before_draw = None, None
            self.engine.ensure_alive(step)  # the engine is idle: restart it here if it died
        else:
            self.engine.ensure_alive(step)
            prompts = self.sampler.next_batch() if self.sampler is not None else None
            result = self.engine.rollout(step, partial(generate_and_score, self.ctx, step, prompts))
        if self.overlap and step + 1 < self.num_steps:
            self._start(step + 1)
        version = result.stats.get("rollout/weight_version")
        result.stats["rollout/policy_lag"] = None if version is None else step - version
        return result, in_order

    def _start(self, step: int) -> None:
        if self.sampler is None:
            return
        self._state_before_draw = self.sampler.state_dict()
        prompts = self.sampler.next_batch()
        self._in_flight = (step, prompts, self._pool.submit(generate_and_score, self.ctx, step, prompts))

    def collect_next(self, step: int) -> None:
        """Collective, after step ``step``'s update and before its weight sync: wait for the
        batch of step+1 generated in the background (a no-op in sync mode and at the last
        step). A failed generation is recovered from and redone in order (see the docstring)."""
        if not self.overlap or step + 1 >= self.num_steps:
            return
        first = retry = None
        if self._in_flight is not None:
            next_step, prompts, future = self._in_flight
            assert next_step == step + 1, (next_step, step)
            first, retry = future.result, partial(generate_and_score, self.ctx, step + 1, prompts)
        self._in_flight = None
        self._ready = (step + 1, self.engine.rollout(step + 1, retry, first=first))

    def state(self) -> dict:
        """Rank 0: the data position to checkpoint: before the draw of a prefetched batch, so
        that a resumed run draws those prompts again (nothing else: ``rollouts`` is None)."""
        position = self._state_before_draw if self._state_before_draw is not None else self.sampler.state_dict()
        return {"sampler": position, "rollouts": None}

    def close(self) -> None:
        """No thread outlives the run: wait for an in-flight generation (bounded by the client's
        timeouts) and drop its result."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._in_flight = None
