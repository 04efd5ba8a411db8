"""``rollout.mode: async``: generation that never waits for training, with bounded staleness.

Rank 0 keeps the engine fed with whole groups (one prompt, ``num_generations`` responses, one
request each, in worker threads); a group is scored as soon as it finishes and queued in arrival
order. Step ``s`` (the trainer holds weights of version ``s``) takes the first ``prompts_per_step``
finished groups in arrival order that are fresh enough:

* **the bound**: a group is trained at step ``s`` only if every model token of it was drawn by
  weights of version >= ``s - max_staleness``; older groups are regenerated or dropped
  (``rollout.stale_groups``), and counted. Admission keeps at most the batches of steps v .. v+k
  in flight (v the version the engine serves), so only overtaken groups can go stale;
* **weight updates in flight**: the sync pauses the engine with ``retract``; sequences resume
  re-prefilled with the new weights, and each token records the version that drew it and its
  log-prob under it (``Sample.output_versions``, ``output_logprobs``): the behaviour policy;
* **groups stay whole**: a group with an aborted or failed response is regenerated, and the
  failure raises into the EngineSupervisor; groups failed by that same failure are requeued
  without raising again (``_epoch``).

The batch is a pure function of the arrival order (``take_groups``); each group's sampler seed
depends only on its id and regeneration count; every group's fate goes to
``RUN_DIR/rollouts/async_groups.jsonl`` (cut back on resume like metrics.jsonl). A resumed run
regenerates exactly the unsettled groups with the resumed weights (not the same responses) and
says so in one line (``resume_note``). Details, tests, metrics:
docs/off_policy.md#asynchronous-rollouts-rolloutmode-async.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.metrics_log.jsonl import truncate_metrics
from megatron_grpo.rollout.generate import (GenerationContext, RolloutResult, generate_round, merge_rounds,
                                            result_from_rounds, sampling_seed)
from megatron_grpo.rollout.supervisor import EngineSupervisor
from megatron_grpo.wire.samples import RolloutError


@dataclass
class Group:
    """One prompt's ``n`` responses, generated as one request."""

    gid: int
    """0-based over the run: ``draw * prompts_per_step + position`` in the draw."""
    draw: int
    prompt: object  # data.Prompt
    attempt: int = 0
    """Regenerations so far (the round index of its seed)."""
    epoch: int = 0
    """Engine recoveries before it was submitted."""
    round: Optional[object] = None  # rollout.generate.Round once finished
    error: Optional[str] = None
    arrival: int = -1

    @property
    def start_version(self) -> Optional[int]:
        return start_version(self.round.samples) if self.round is not None else None


def start_version(samples) -> Optional[int]:
    """The oldest weight version that drew any model token of ``samples`` (None: none reported)."""
    versions = [int(v) for s in samples for v in (s.output_versions or []) if v is not None and str(v).isdigit()]
    return min(versions) if versions else None


def token_lags(samples, step: int) -> list[int]:
    """Per model token of ``samples``: ``step`` minus the version that drew it."""
    return [step - int(v) for s in samples for v in (s.output_versions or []) if v is not None and str(v).isdigit()]


def is_stale(version: Optional[int], step: int, max_staleness: int) -> bool:
    """A group whose oldest token is more than ``max_staleness`` versions behind ``step``. A
    group without reported versions (every response empty) is never stale."""
    return version is not None and step - version > max_staleness


def take_groups(arrived: list[Group], step: int, max_staleness: int, count: int
                ) -> tuple[list[Group], list[Group], list[Group]]:
    """(the first ``count`` fresh groups in arrival order, the stale groups before the last of
    them, the rest in order). Pure: the batch depends only on the arrival order."""
    chosen, stale, rest = [], [], []
    for g in arrived:
        if len(chosen) == count:
            rest.append(g)
        elif is_stale(g.start_version, step, max_staleness):
            stale.append(g)
        else:
            chosen.append(g)
    return chosen, stale, rest


def settled_state(unsettled_draws: dict[int, set[int]], next_draw: int, prompts_per_step: int) -> dict:
    """A checkpoint's ``rollouts`` entry: ``{"draw": the oldest draw with an unsettled group,
    "settled": the ids of every group settled (trained or dropped) from that draw on, "drawn":
    next_draw}``. ``unsettled_draws``: draw -> the settled positions of each draw with a group not
    yet settled; a draw before ``next_draw`` that is absent was settled whole (and forgotten),
    so all its ids count as settled: a draw settled between two unsettled ones is not drawn again.
    (Listing only the unsettled draws' ids had a resumed run train such a draw a second time.)"""
    if not unsettled_draws:
        return {"draw": next_draw, "settled": [], "drawn": next_draw}
    oldest = min(unsettled_draws)
    settled = []
    for draw in range(oldest, next_draw):
        positions = unsettled_draws.get(draw, range(prompts_per_step))
        settled += [draw * prompts_per_step + p for p in sorted(positions)]
    return {"draw": oldest, "settled": settled, "drawn": next_draw}


def resume_note(resume: Optional[dict], step: int, prompts_per_step: int) -> str:
    """The line a run resumed at ``step`` in async mode prints: what the checkpoint's
    ``rollouts`` entry (``resume_state``) restores, and what the resumed run cannot reproduce."""
    if not resume:
        return (f"async resume at step {step}: the checkpoint has no async rollout state (not an async run's): "
                f"generation starts from its data position")
    draw, settled = int(resume["draw"]), len(resume["settled"])
    drawn = resume.get("drawn")  # absent from checkpoints written before it was stored
    unsettled = "the" if drawn is None else str((int(drawn) - draw) * prompts_per_step - settled)
    return (f"async resume at step {step}: data position restored to draw {draw} (group ids from "
            f"{draw * prompts_per_step}); {settled} groups from there already trained or dropped are skipped; "
            f"{unsettled} groups drawn but not yet trained at the checkpoint (in flight, finished or waiting) are "
            f"generated again with the step-{step} weights; not reproduced: their responses, which weight version "
            f"draws which token, and the arrival order from here differ from the uninterrupted run")


def admission_limit(version: int, first_version: int, max_staleness: int, prompts_per_step: int,
                    num_steps: int) -> int:
    """How many groups may be taken or outstanding while the engine serves ``version``: the
    batches of steps first_version .. version + max_staleness, and none past the run."""
    return min(version - first_version + max_staleness + 1, num_steps - first_version) * prompts_per_step


class _LockedScorer:
    """The reward scorer, one call at a time (groups are scored in worker threads)."""

    def __init__(self, scorer):
        self.scorer = scorer
        self.lock = threading.Lock()

    def score_samples(self, samples):
        with self.lock:
            return self.scorer.score_samples(samples)


class AsyncRolloutSchedule:
    """The ``RolloutSource`` of ``rollout.mode: async`` (``rollout/sources.py``; see the module
    docstring).

    engine: every rank's EngineSupervisor; ctx, sampler: rank 0's GenerationContext (its
    ``engine`` the RolloutEngine the groups go to) and PromptSampler (None elsewhere);
    start_step: the run's first step; resume: the checkpoint's ``rollouts`` entry (None: a
    fresh run).
    """

    def __init__(self, cfg: ExperimentConfig, engine: EngineSupervisor, ctx: Optional[GenerationContext], sampler,
                 start_step: int, resume: Optional[dict] = None):
        self.cfg = cfg
        self.engine = engine
        # one scoring call at a time: groups are scored in worker threads
        self.ctx = dataclasses.replace(ctx, scorer=_LockedScorer(ctx.scorer)) if ctx is not None else None
        self.sampler = sampler
        self.num_steps = cfg.trainer.num_steps
        self.k = cfg.rollout.max_staleness
        self.per_step = cfg.rollout.prompts_per_step
        self.first_version = start_step
        self.version = start_step
        self.closed = False
        self._cond = threading.Condition()
        self._pool = (ThreadPoolExecutor(max_workers=(self.k + 1) * self.per_step, thread_name_prefix="async-rollout")
                      if ctx is not None else None)
        self._futures: set[Future] = set()
        self._arrived: list[Group] = []  # finished, in arrival order, not yet taken
        self._retry: list[Group] = []  # to regenerate (stale or failed), oldest first
        self._pending: list[Group] = []  # drawn, not yet submitted
        self._outstanding = 0  # submitted or finished, not yet taken or dropped
        self._taken = 0
        self._arrivals = 0
        self._epoch = 0
        self._counts = {"stale": 0, "regenerated": 0, "dropped": 0, "failed": 0}
        # draw -> (sampler state before it, its prompts' settled positions (trained or dropped))
        self._draws: dict[int, tuple[dict, set[int]]] = {}
        resume = resume or {}
        self._next_draw = int(resume.get("draw", 0))
        self._skip = set(int(g) for g in resume.get("settled", []))
        self._log = (Path(cfg.trainer.run_dir) / "rollouts" / "async_groups.jsonl") if ctx is not None else None
        if self._log is not None:  # cut back to the checkpoint's step, as metrics.jsonl: that work is redone
            truncate_metrics(self._log, start_step)

    # ---- the trainer's interface -----------------------------------------------------------

    def batch_for(self, step: int) -> tuple[RolloutResult, bool]:
        """Collective: step ``step``'s batch on every rank (never generated in order: False)."""
        self.engine.ensure_alive(step)
        if self.ctx is not None:
            with self._cond:
                self.version = step  # the engine serves the weights of version `step` now
            self._fill()
        result = self.engine.rollout(step, lambda: self._take(step))
        return result, False

    def collect_next(self, step: int) -> None:
        """Nothing to collect: generation runs on (the sync retracts what is in flight)."""

    def state(self) -> dict:
        """Rank 0: ``sampler``, the data position before the oldest draw with an unsettled
        group; ``rollouts``, the oldest unsettled draw, the settled group ids from it on, and
        how many draws were made (for the resumed run's ``resume_note``)."""
        with self._cond:
            live = sorted(self._draws)
            return {"sampler": self._draws[live[0]][0] if live else self.sampler.state_dict(),
                    "rollouts": settled_state({d: settled for d, (_, settled) in self._draws.items()},
                                              self._next_draw, self.per_step)}

    def close(self) -> None:
        """No thread outlives the run: stop starting groups, end the requests in flight on the
        engine (abort), and wait for the workers (bounded: aborted requests answer at once)."""
        if self._pool is None:
            return
        with self._cond:
            self.closed = True
            futures = list(self._futures)
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + 120.0
        while any(not f.done() for f in futures) and time.monotonic() < deadline:
            try:
                self.ctx.engine.abort_generation()
            except RolloutError:
                pass  # a dead engine: its requests fail by themselves
            with self._cond:
                self._cond.wait(timeout=2.0)
        self._pool.shutdown(wait=True)

    # ---- rank 0 ------------------------------------------------------------------------

    def _draw(self) -> None:
        """Append the next draw's prompts to ``_pending`` (skipping ids settled before a resume)."""
        draw = self._next_draw
        self._next_draw += 1
        state = self.sampler.state_dict()
        prompts = self.sampler.next_batch()
        settled = {p for p in range(len(prompts)) if draw * self.per_step + p in self._skip}
        self._draws[draw] = (state, settled)
        self._pending += [Group(gid=draw * self.per_step + p, draw=draw, prompt=prompt)
                          for p, prompt in enumerate(prompts) if p not in settled]
        self._forget_settled(draw)

    def _forget_settled(self, draw: int) -> None:
        if len(self._draws[draw][1]) == self.per_step:
            del self._draws[draw]

    def _settle(self, g: Group) -> None:
        state, settled = self._draws[g.draw]
        settled.add(g.gid - g.draw * self.per_step)
        self._forget_settled(g.draw)

    def _fill(self) -> None:
        """Start groups until the admission limit (regenerations first)."""
        while True:
            with self._cond:
                limit = admission_limit(self.version, self.first_version, self.k, self.per_step, self.num_steps)
                if self.closed or self._taken + self._outstanding >= limit:
                    return
                if not self._retry and not self._pending:
                    self._draw()
                    continue
                g = self._retry.pop(0) if self._retry else self._pending.pop(0)
                g.epoch, g.round, g.error = self._epoch, None, None
                self._outstanding += 1
                future = self._pool.submit(self._generate, g)
                self._futures.add(future)
                future.add_done_callback(self._futures.discard)

    def _generate(self, g: Group) -> None:
        """Worker thread: generate and score one group; queue it in arrival order."""
        cfg, n = self.cfg, self.cfg.rollout.num_generations
        seed = sampling_seed(cfg.trainer.seed, g.draw, g.attempt) + (g.gid % self.per_step) * n
        try:
            rnd = generate_round(self.ctx, g.draw, g.attempt, [g.prompt], seed=seed)
            aborted = [s.finish_reason for s in rnd.samples if s.finish_reason == "abort"]
            g.round, g.error = (rnd, None) if not aborted else (None, "a response was aborted")
        except Exception as e:  # noqa: BLE001 - reported to the trainer thread, which decides
            g.error = f"{type(e).__name__}: {e}"
        with self._cond:
            g.arrival = self._arrivals
            self._arrivals += 1
            self._arrived.append(g)
            self._cond.notify_all()

    def _wait_s(self) -> float:
        """The longest wait for the next group to finish: one request's bound, with margin."""
        r = self.cfg.engine
        return r.request_timeout_s * (r.max_retries + 1) + 60.0

    def _take(self, step: int) -> RolloutResult:
        """Rank 0: wait for ``prompts_per_step`` fresh whole groups; build the step's result."""
        t0 = time.monotonic()
        counts = dict.fromkeys(self._counts, 0)
        chosen: list[Group] = []
        while len(chosen) < self.per_step:
            self._fill()
            with self._cond:
                if not self._cond.wait_for(lambda: self._arrived, timeout=self._wait_s()):
                    raise RolloutError("async rollouts", "wait", f"no group finished in {self._wait_s():.0f}s")
                failed = [g for g in self._arrived if g.error is not None]
                self._arrived = [g for g in self._arrived if g.error is None]
                for g in failed:  # never trained half-done: generated again
                    counts["failed"] += 1
                    self._requeue(g)
                fresh_failure = [g for g in failed if g.epoch == self._epoch]
                if fresh_failure:  # the supervisor recovers (restart, resync) and calls _take again
                    self._epoch += 1
                    self._arrived = chosen + self._arrived
                    raise RolloutError("async rollouts", "generate", fresh_failure[0].error)
                got, stale, self._arrived = take_groups(self._arrived, step, self.k, self.per_step - len(chosen))
                chosen += got
                for g in stale:
                    counts["stale"] += 1
                    self._record(step, g, f"stale_{self.cfg.rollout.stale_groups}")  # the attempt that went stale
                    if self.cfg.rollout.stale_groups == "regenerate":
                        counts["regenerated"] += 1
                        self._requeue(g)
                    else:
                        counts["dropped"] += 1
                        self._outstanding -= 1
                        self._settle(g)
        with self._cond:
            self._outstanding -= len(chosen)
            self._taken += len(chosen)
            in_flight = self._outstanding - len(self._arrived)
            for g in chosen:
                self._settle(g)
                self._record(step, g, "trained")
        for key, value in counts.items():
            self._counts[key] += value
        return self._result(step, chosen, counts, in_flight, time.monotonic() - t0)

    def _requeue(self, g: Group) -> None:
        """Under the lock: generate ``g``'s prompt again (a new seed), before new draws."""
        self._outstanding -= 1
        g.attempt += 1
        self._retry.append(g)

    def _record(self, step: int, g: Group, fate: str) -> None:
        self._log.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log, "a") as f:
            f.write(json.dumps({"step": step + 1, "gid": g.gid, "draw": g.draw, "prompt_index": g.prompt.index,
                                "attempt": g.attempt, "start_version": g.start_version, "arrival": g.arrival,
                                "fate": fate}) + "\n")

    def _result(self, step: int, chosen: list[Group], counts: dict, in_flight: int, wait_s: float) -> RolloutResult:
        rnd = merge_rounds([g.round for g in chosen])
        result = result_from_rounds(self.ctx, [rnd], [None], len(chosen))
        stats = result.stats
        lags = token_lags(rnd.samples, step)
        oldest = start_version(rnd.samples)
        stats["rollout/weight_version"] = oldest if oldest is not None else step
        stats["rollout/policy_lag"] = step - stats["rollout/weight_version"]
        stats["rollout/token_lag_min"] = float(min(lags)) if lags else 0.0
        stats["rollout/token_lag_mean"] = float(sum(lags) / len(lags)) if lags else 0.0
        stats["rollout/token_lag_max"] = float(max(lags)) if lags else 0.0
        stats["rollout/generate_s"] = wait_s  # the groups were generated concurrently: the wait
        for key, value in counts.items():
            stats[f"async/groups_{key}"] = float(value)
            stats[f"async/groups_{key}_total"] = float(self._counts[key])
        stats["async/groups_in_flight"] = float(in_flight)
        stats["async/group_arrivals"] = ",".join(str(g.arrival) for g in chosen)
        return result
