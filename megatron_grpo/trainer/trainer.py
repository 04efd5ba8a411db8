"""The GRPO trainer: its components, built once, and one step as a handful of verbs.

    trainer = Trainer.build(cfg)          # policy, reference, engine, data, logger; resume
    for step in range(trainer.start_step, cfg.trainer.num_steps):
        trainer.step(step)                # rollout -> shard -> score -> update -> sync
                                          #   -> evaluate -> log -> checkpoint

One step, read top to bottom (``Trainer.step``):

1. **rollout**: the run's ``RolloutSource`` (``rollout/sources.py``, ``rollout/async_source.py``)
   gives the TrainBatch (responses, engine log-probs, advantages), broadcast to every rank;
2. **shard**: the batch is (optionally) shuffled across mini-batches; each DP rank takes its rows;
3. **score**: old-policy (and reference, and with ``distillation.teacher`` the teacher's)
   log-probs, recomputed in forward-only mode with the vocab-parallel op;
4. **update**: for ``num_iterations`` epochs, every mini-batch is one optimizer step
   (``megatron_step.train_mini_batch``), its learning rate from ``update_plan.UpdatePlan``;
5. **sync**: the new weights are resharded into the rollout engine;
6. **evaluate** (when due): rank 0 evaluates the held-out sets on the engine, now serving these
   weights, in rounds the other ranks wait for; 7. **log**; **checkpoint** when due. An
   evaluation belongs to its step's metrics entry and precedes that step's checkpoint, so a
   resumed run neither repeats nor skips one.

Every rank runs the trainer (torchrun); rank 0 also owns the engine's generation, the data and
the logging. Every engine call goes through ``EngineSupervisor`` (recovery from a failed engine),
whatever the engine (``generation.protocol.RolloutEngine``). More: docs/design.md#what-one-step-does.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch.distributed as dist
import yaml
from megatron.core import parallel_state as ps

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.config.algorithm import AlgorithmConfig, entropy_coef_at
from megatron_grpo.data import PromptSampler, load_prompt_dataset
from megatron_grpo.evaluation import Evaluator
from megatron_grpo.generation.manager import RolloutServerManager
from megatron_grpo.losses import reduce_metrics
from megatron_grpo.metrics_log import MetricsLogger
from megatron_grpo.models.tokenizer import load_tokenizer
from megatron_grpo.ops.quantize import scheme_of
from megatron_grpo.rollout.async_source import resume_note
from megatron_grpo.rollout.batch import TrainBatch, dp_shard, mini_batch_order
from megatron_grpo.rollout.generate import GenerationContext
from megatron_grpo.rollout.sources import RolloutSource, build_rollout_source
from megatron_grpo.rollout.supervisor import EngineSupervisor
from megatron_grpo.runtime import stop
from megatron_grpo.runtime.collectives import RunAborted, broadcast
from megatron_grpo.runtime.files import write_text_atomic
from megatron_grpo.sync.driver import SyncStats
from megatron_grpo.sync.factory import build_engine
from megatron_grpo.trainer import checkpoint as ckpt
from megatron_grpo.trainer.components import Policy, RolloutSide, build_policy, build_reference, build_rollout_side
from megatron_grpo.trainer.megatron_step import (ScoringSpec, compute_log_probs, old_log_probs_needed,
                                                 probe_log_probs, train_mini_batch)
from megatron_grpo.trainer.microbatch import MicroBatching
from megatron_grpo.trainer.moe_metrics import RouterLoad
from megatron_grpo.trainer.router_replay import RoutingReplay
from megatron_grpo.trainer.step_timer import StepTimer
from megatron_grpo.trainer.teacher import Teacher, build_teacher
from megatron_grpo.trainer.update_plan import UpdatePlan


class NonFiniteError(RunAborted):
    """Too many consecutive steps had a non-finite loss or gradient."""


@dataclass
class Updates:
    """What the update phase of one step did on this rank."""

    metrics: list[dict] = field(default_factory=list)
    """One entry per optimizer step this rank reports (the last pipeline stage's)."""
    skipped: int = 0
    """Optimizer steps skipped for a non-finite loss or gradient."""
    skipped_zero_advantage: bool = False
    """The whole update was skipped: nothing in the batch gives a gradient (``has_gradient``)."""


@dataclass
class Trainer:
    """A run's components (built once by ``build``) and its step (see the module docstring)."""

    cfg: ExperimentConfig
    rank: int
    plan: UpdatePlan
    spec: ScoringSpec
    batching: MicroBatching
    policy: Policy
    reference: Optional[list]
    """Frozen reference chunks, with a KL loss only."""
    teacher: Optional[Teacher]
    """The frozen distillation teacher (distillation.teacher) only."""
    routing: Optional[RoutingReplay]
    """MoE router replay (algorithm.router_replay) only."""
    engine: EngineSupervisor
    rollouts: RolloutSource
    side: Optional[RolloutSide]
    """Rank 0's sampling parameters, tokenizer, data and rewards."""
    evaluator: Optional[Evaluator]
    """Rank 0's, when eval.sets is set."""
    logger: MetricsLogger
    start_step: int = 0
    nonfinite_streak: int = 0
    records: list[dict] = field(default_factory=list)
    """Rank 0's metric records, one per step."""

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def build(cls, cfg: ExperimentConfig, spawned: Optional[RolloutServerManager] = None) -> "Trainer":
        """Build every component (collective), resume from the last checkpoint when there is
        one, and sync the engine to the policy's weights. ``spawned``: rank 0's rollout
        servers, already booting (``generation.handles.spawn_engine``)."""
        rank, run_dir = dist.get_rank(), cfg.trainer.run_dir
        tokenizer = load_tokenizer(cfg.model.hf_dir)
        sampler = PromptSampler(load_prompt_dataset(cfg.data, tokenizer), cfg.rollout.prompts_per_step,
                                cfg.trainer.seed, cfg.data.shuffle)
        policy = build_policy(cfg)
        routing = RoutingReplay(policy.modules, replay=True) if cfg.algorithm.router_replay else None
        reference = build_reference(cfg, policy.hf_config)
        spec = ScoringSpec(cfg.rollout.temperature, policy.hf_config.vocab_size, cfg.model.logprob_chunk_size,
                           cfg.model.logprob_kernel)
        teacher = build_teacher(cfg, spec)
        quantization = scheme_of(cfg.engine.quantization, cfg.engine.fp8_format)  # the probe's, as the engine's
        start_step, trainer_state = _resume(cfg, policy, sampler, rank)
        logger = MetricsLogger(run_dir, cfg.logging, cfg.trainer.num_steps, rank,
                               resumed_step=start_step, config_dict=cfg.to_dict())
        if rank == 0:
            write_text_atomic(Path(run_dir) / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        side = (build_rollout_side(cfg, tokenizer, sampler, vocab_size=policy.hf_config.vocab_size)
                if rank == 0 else None)
        taken = stop.reinstall_if_replaced()  # the reward modules were imported here, top-level code and all
        if taken:
            print(f"[megatron-grpo] a plug-in imported by rank {rank} replaced its {' and '.join(taken)} handler; "
                  "put back, so that a stop still ends the run after its step", file=sys.stderr, flush=True)
        rollout_engine = build_engine(cfg, policy.hf_config, owner=rank == 0,
                                      probe=lambda tokens: probe_log_probs(policy.chunks, tokens, spec, quantization),
                                      spawned=spawned)
        engine = EngineSupervisor(rollout_engine, policy.modules, max_attempts=cfg.engine.max_restarts + 1,
                                  colocate=cfg.engine.colocate, owner=rank == 0)
        try:
            evaluator = (Evaluator(cfg, tokenizer, rollout_engine, side.scorer, side.sampling, side.episode_source)
                         if side is not None and cfg.eval.sets else None)
            engine.sync(start_step)  # the engine starts from the HF weights
        except BaseException:  # nothing this run started outlives a failed start
            rollout_engine.close()
            if side is not None:
                side.close()
            raise
        ctx = (GenerationContext(rollout_engine, side.sampling, side.scorer, side.tokenizer, cfg, side.episode_source,
                                 more_prompts=side.sampler.next_batch) if side is not None else None)
        rollouts = build_rollout_source(cfg, engine, ctx, sampler if side is not None else None, start_step,
                                        trainer_state)
        if rank == 0 and start_step > 0 and cfg.rollout.mode == "async":  # what the checkpoint cannot give back
            note = resume_note(trainer_state.get("rollouts"), start_step, cfg.rollout.prompts_per_step)
            print(f"[megatron-grpo] {note}", flush=True)
        plan = UpdatePlan.from_config(cfg, ps.get_data_parallel_world_size())
        return cls(cfg=cfg, rank=rank, plan=plan, spec=spec, batching=MicroBatching.of(cfg.parallel), policy=policy,
                   reference=reference, teacher=teacher, routing=routing,
                   engine=engine, rollouts=rollouts, side=side, evaluator=evaluator, logger=logger,
                   start_step=start_step, nonfinite_streak=trainer_state.get("nonfinite_streak", 0))

    # ---- the step ----------------------------------------------------------------------

    def step(self, step: int) -> None:
        """One GRPO step (collective; ``step`` is 0-based, its weights become version step+1)."""
        timer = StepTimer()
        result, in_order = self.rollouts.batch_for(step)
        self.engine.release_memory()  # colocated: the GPU is the trainer's until the sync
        timer.lap("generate")
        if in_order:  # the scoring was part of that wait (rank 0's; the others wait in the broadcast)
            timer.move(result.stats["rollout/reward_s"], "generate", "reward")
        batch, local = self.shard(result.batch, step)
        algorithm = self.step_algorithm(step)
        skip = (self.cfg.algorithm.skip_zero_advantage_steps and self.teacher is None
                and not has_gradient(batch, algorithm))  # the teacher's term gives a gradient
        score_metrics = {} if skip else self.score(local)
        timer.lap("logprob")
        if self.teacher is not None:  # its log-probs of the batch, checked when due
            score_metrics.update(self.teacher.score(step, local, self.batching))
            timer.lap("teacher")
        updates = Updates(skipped_zero_advantage=True) if skip else self.update(step, batch, local, algorithm)
        timer.lap("train")
        if self.routing is not None:  # without an old-log-prob pass: the (single) update's forward
            for key, value in self.routing.take_metrics().items():  # collective; restarts the count
                score_metrics.setdefault(key, value)
        self.rollouts.collect_next(step)  # off-policy: step+1's batch; the engine must be idle to sync
        timer.lap("idle")
        synced = self.engine.sync(step + 1)
        timer.lap("sync")
        eval_metrics = self.evaluate(step + 1)
        eval_s = timer.lap("eval")
        self.nonfinite_streak = self.nonfinite_streak + 1 if updates.skipped else 0
        record = {**self.record(result.stats, updates, synced), **score_metrics, **eval_metrics, **timer.finish()}
        # training throughput: evaluation time is not the step's work
        record["tokens_per_s"] = float(batch.loss_mask.sum()) / max(record["time/step_s"] - eval_s, 1e-9)
        record["entropy_coef"] = algorithm.entropy_coef
        if self.rank == 0:
            self.records.append(self.logger.log(step + 1, record, excluded_s=eval_s))
        self.check_finite(step + 1)
        self.checkpoint_if_due(step + 1)

    def shard(self, batch: TrainBatch, step: int) -> tuple[TrainBatch, TrainBatch]:
        """(the rollout batch in mini-batch order [N rows], this DP rank's rows of it
        [N / dp rows]); the order is shuffled across mini-batches when configured."""
        assert batch.num_sequences == self.plan.batch_size, (batch.num_sequences, self.plan.batch_size)
        if self.cfg.algorithm.shuffle_mini_batches:
            order = mini_batch_order(batch.num_sequences, self.plan.global_batch_size, self.cfg.trainer.seed, step)
            batch = batch if order is None else batch.select(order)
        local = dp_shard(batch, ps.get_data_parallel_rank(), self.plan.dp, self.plan.global_batch_size)
        return batch, local

    def score(self, local: TrainBatch) -> dict:
        """Fill ``local.old_log_probs`` (when the update needs pi_old: several optimizer steps
        per batch) and ``local.ref_log_probs`` (KL loss); returns the MoE routing metrics of
        that pass ({} for dense models)."""
        moe_metrics = {}
        if old_log_probs_needed(self.plan.num_iterations, self.plan.num_mini_batches):
            router_load = RouterLoad(self.policy.modules)  # counted where the pass runs: pi_old's routing
            local.old_log_probs = compute_log_probs(
                self.policy.chunks, local, self.batching, self.spec,
                router_load=router_load if router_load.active else None, routing=self.routing)
            moe_metrics = router_load.metrics(self.cfg.parallel.sequence_parallel)  # collective; {} if dense
            if self.routing is not None:  # the policy that generated: engine vs trainer routing
                moe_metrics.update(self.routing.take_metrics())
        if self.reference is not None:
            local.ref_log_probs = compute_log_probs(self.reference, local, self.batching, self.spec)
        return moe_metrics

    def update(self, step: int, batch: TrainBatch, local: TrainBatch, algorithm: AlgorithmConfig) -> Updates:
        """``num_iterations`` epochs over the mini-batches, one optimizer step each. ``batch``:
        the whole rollout batch (a mini-batch's global token and sequence counts normalise the
        loss); ``local``: this DP rank's rows, scored; ``algorithm``: the step's
        (``step_algorithm``)."""
        updates, plan = Updates(), self.plan
        for it in range(plan.num_iterations):
            for m in range(plan.num_mini_batches):
                plan.set_lr(self.policy.optimizer, step, it, m)
                whole = batch.select(plan.global_rows(m))
                metrics, applied, grad_norm = train_mini_batch(
                    self.policy.chunks, self.policy.optimizer, local.select(plan.local_rows(m)), algorithm,
                    self.spec, self.batching, int(whole.loss_mask.sum()), whole.num_sequences,
                    plan.dp, ps.get_data_parallel_group(), routing=self.routing,
                    distillation=self.cfg.distillation if self.teacher is not None else None)
                updates.skipped += not applied
                if metrics is not None:
                    updates.metrics.append({**metrics, "grad_norm": grad_norm, "iteration": it})
        return updates

    def step_algorithm(self, step: int) -> AlgorithmConfig:
        """The algorithm section as step ``step`` (0-based) applies it: the entropy bonus's
        weight of that step (``algorithm.entropy_coef_end``), everything else as configured."""
        cfg = self.cfg.algorithm
        if cfg.entropy_coef_end is None:
            return cfg
        return dataclasses.replace(cfg, entropy_coef=entropy_coef_at(cfg, step, self.cfg.trainer.num_steps),
                                   entropy_coef_end=None)

    def evaluate(self, step: int, due: bool = False) -> dict:
        """Collective, when due (``due``: the run's start, whatever the schedule): rank 0
        evaluates every held-out set on the engine's current weights (those of ``step``), one
        round at a time; every rank waits only for one round in a broadcast (``engine.rollout``, which also recovers a failed engine). Returns the
        ``eval/...`` metrics on rank 0 (empty elsewhere) and writes the scored responses."""
        if not self.cfg.eval.sets or not (due or self.cfg.eval.due(step, self.cfg.trainer.num_steps)):
            return {}
        evaluator = self.evaluator
        rounds = broadcast(evaluator.rounds() if evaluator is not None else None)
        try:
            results = [self.engine.rollout(step, lambda r=r: evaluator.run_round(step, r)) for r in rounds]
        except stop.StepInterrupted:  # the engine is gone and the run stops: the step's training stands
            return {}
        if evaluator is None:
            return {}
        evaluator.write_samples(Path(self.cfg.trainer.run_dir) / "eval", step, results)
        return evaluator.summarize(results)

    def evaluate_at_start(self) -> None:
        """Collective: evaluate the starting weights (the engine serves them after
        ``build``'s sync) and log them as step 0, before training time starts counting."""
        start = time.perf_counter()
        metrics = self.evaluate(0, due=True)
        if self.rank == 0 and metrics:
            self.records.append(self.logger.log(0, {**metrics, "time/eval_s": time.perf_counter() - start}))

    def record(self, rollout_stats: dict, updates: Updates, synced: SyncStats) -> dict:
        """The step's metrics (collective): rollout stats, the training metrics pooled over
        its optimizer steps (sent from the reporting last-stage rank), lr, skipped updates,
        engine restarts and the sync's verification."""
        reporter = (ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
                    and ps.get_data_parallel_rank(with_context_parallel=True) == 0)
        box = [None] * dist.get_world_size()
        mine = pool_optimizer_steps(updates.metrics) if reporter and updates.metrics else None
        dist.all_gather_object(box, (mine, synced.num_bytes))
        record = {**rollout_stats, **next((m for m, _ in box if m is not None), {})}  # {}: the update was skipped
        record["lr"] = float(self.policy.optimizer.param_groups[0]["lr"])
        record["skipped_updates"] = updates.skipped
        record["skipped_zero_advantage"] = int(updates.skipped_zero_advantage)
        record["engine_restarts"] = self.engine.restarts
        record["weight_sync_verified"] = int(synced.verified)
        # each sender counts what it sent (a LoRA policy's in-process sync: the adapters alone)
        record["weight_sync_bytes"] = sum(sent for _, sent in box)
        if synced.probe_logprob_abs_diff is not None:
            record["weight_sync_probe_logprob_abs_diff"] = synced.probe_logprob_abs_diff
        return record

    def check_finite(self, step: int) -> None:
        """Abort after ``trainer.max_consecutive_nonfinite`` steps in a row skipped an update."""
        limit = self.cfg.trainer.max_consecutive_nonfinite
        if self.nonfinite_streak >= limit:
            raise NonFiniteError(
                f"step {step}: non-finite loss or gradient in {self.nonfinite_streak} consecutive steps "
                f"(trainer.max_consecutive_nonfinite={limit}); lower optimizer.lr or check the data and rewards")

    def checkpoint_due(self, step: int) -> bool:
        """Whether ``checkpoint_if_due(step)`` saves: the last step and every checkpoint.save_every."""
        every = self.cfg.checkpoint.save_every
        return step == self.cfg.trainer.num_steps or bool(every and step % every == 0)

    def checkpoint_if_due(self, step: int) -> None:
        """Collective: a training checkpoint at the last step and every checkpoint.save_every."""
        if self.checkpoint_due(step):
            self.save_checkpoint(step)

    def save_checkpoint(self, step: int) -> None:
        """Collective: a training checkpoint of the state after ``step`` steps."""
        # rank 0's sampler is the one that advanced: every rank saves its state
        source = self.rollouts.state() if self.rank == 0 else {"sampler": None, "rollouts": None}
        state = broadcast({"step": step, **source, "nonfinite_streak": self.nonfinite_streak})
        ckpt.save_training_checkpoint(self.cfg.trainer.run_dir, step, self.policy.modules, self.policy.optimizer,
                                      state, self.cfg.checkpoint.keep_last, timeout_s=self.cfg.save_timeout_s)

    def close(self) -> None:
        """Stop everything the run started (the background rollout before the engine)."""
        self.rollouts.close()
        self.logger.close()
        self.engine.close()
        if self.side is not None:
            self.side.close()


def _resume(cfg: ExperimentConfig, policy: Policy, sampler: PromptSampler, rank: int) -> tuple[int, dict]:
    """(first step, trainer state) after loading the last complete checkpoint into the policy
    and the sampler when ``checkpoint.resume`` finds one; (0, {}) otherwise."""
    choice = ckpt.agreed_resume(cfg.trainer.run_dir, cfg.checkpoint.resume)  # verified; rank 0 chose
    resume_dir = choice.path
    if resume_dir is None:
        return 0, {}
    if rank == 0 and choice.note:
        print(f"[megatron-grpo] warning: {choice.note}", file=sys.stderr, flush=True)
    state = ckpt.load_training_checkpoint(resume_dir, policy.modules, policy.optimizer)
    sampler.load_state_dict(state["sampler"])
    if rank == 0:
        print(f"[megatron-grpo] {resume_dir}: resumed from checkpoint step {state['step']}", flush=True)
    return state["step"], state


ZERO_ADVANTAGE = 1e-6
"""|advantage| at or below which a sequence gives no policy gradient (equal rewards normalise
to exactly 0 for 0/1 rewards; other values leave rounding noise of ~1e-16 / std_eps)."""


def has_gradient(batch: TrainBatch, algorithm: AlgorithmConfig) -> bool:
    """Whether updating on ``batch`` (the whole rollout batch, every rank the same) gives a
    gradient: some advantage is non-zero, or a term that does not scale with the advantage
    is on (the entropy bonus, the KL loss) or router replay is (its metrics come from the
    update's forward). Every policy loss (PPO, GSPO, CISPO, SAPO) is the advantage times a
    function of the ratio, so with every |A| <= ZERO_ADVANTAGE its gradient is zero."""
    if algorithm.entropy_coef > 0 or algorithm.kl_loss_coef > 0 or algorithm.router_replay:
        return True
    return bool(batch.advantages.abs().max() > ZERO_ADVANTAGE)


def pool_optimizer_steps(parts: list[dict]) -> dict:
    """Pool the optimizer-step metrics of one step (mini-batches x iterations) with the loss
    package's rules (token-weighted, max of *_max, ...); loss and grad_norm are means over
    optimizer steps. With num_iterations > 1 the last iteration's clip/KL are also reported
    (``key/last_iter``): that is where clipping acts."""

    def pool(rows: list[dict]) -> dict:
        per_step = ("loss", "grad_norm", "iteration")
        out = reduce_metrics([{k: v for k, v in r.items() if k not in per_step} for r in rows])
        out["loss"] = sum(r["loss"] for r in rows) / len(rows)
        out["grad_norm"] = sum(r["grad_norm"] for r in rows) / len(rows)
        # packed rows have no padding; a shared prefix runs fewer token slots than the rows hold
        out["padding_fraction"] = max(0.0, 1.0 - out["num_sequence_tokens"] / max(out["num_padded_tokens"], 1.0))
        out["prefix_shared_fraction"] = max(0.0, 1.0 - out["num_padded_tokens"] / max(out["num_sequence_tokens"], 1.0))
        return out

    out = pool(parts)
    last_it = max(p["iteration"] for p in parts)
    if last_it > 0:
        last = pool([p for p in parts if p["iteration"] == last_it])
        out.update({f"{k}/last_iter": last[k] for k in ("loss", "clip_ratio", "ppo_kl", "pg_clipfrac_lower")})
    return out
