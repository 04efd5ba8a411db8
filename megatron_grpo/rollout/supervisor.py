"""``EngineSupervisor``: every call the trainer makes to the rollout engine (generation,
weight sync, memory release), made collectively and recovered from when the engine fails: a
dead or unreachable engine is restarted (when this run launched it), the trainer's weights are
synced into it again and the call is retried -- a bounded number of times.

Every wait underneath is bounded (the client's per-request timeouts and retries, the
manager's launch deadline, the syncer's collective error agreement), so a dead engine is an
error within minutes at worst, never a hang. Generation runs on rank 0 only; recovery is
collective because the weight sync is. The engine is any ``generation.protocol.RolloutEngine``.

Stopping (``runtime/stop.py``): once any rank received a stop signal, a failed engine is not
restarted. Under Slurm the engine server gets the same SIGTERM as the ranks and exits; the
trainer must stop cleanly without it. A failed generation then raises ``StepInterrupted`` (the
step cannot finish; the driver stops after the previous one), and a failed weight sync is
skipped (the step's training is done and is what the stop's checkpoint saves; a resumed run
syncs a fresh engine first).

Colocated mode (``engine.colocate``, GPU only): ``release_memory()`` after generation hands
the engine's weights and KV cache back to the trainer; ``sync`` takes the weights' memory back
before sending them and the KV cache after, so the engine is whole again before generation.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from megatron_grpo.generation.protocol import RolloutEngine
from megatron_grpo.wire.samples import RolloutError
from megatron_grpo.runtime import stop
from megatron_grpo.runtime.collectives import RunAborted, broadcast
from megatron_grpo.sync.driver import SyncStats, WeightSyncError

log = logging.getLogger(__name__)


class EngineUnavailableError(RunAborted):
    """The rollout engine kept failing after every allowed restart or retry."""


class EngineSupervisor:
    """``rollout(step, fn)``, ``sync(step)`` and ``release_memory()`` with recovery (see the
    module docstring).

    engine: every rank's RolloutEngine (its rank-0 verbs are called on rank 0 only);
    modules: the policy chunks whose weights the engine must serve.
    """

    def __init__(self, engine: RolloutEngine, modules: list, max_attempts: int, retry_wait_s: float = 2.0,
                 colocate: bool = False, *, owner: bool):
        self.engine = engine
        self.owner = owner  # rank 0: generates and talks to the engine
        self.colocate = colocate
        self.released = False  # the engines' memory is released (colocated mode)
        self.modules = modules
        self.max_attempts = max_attempts
        self.retry_wait_s = retry_wait_s
        self.restarts = 0  # rank 0's count, reported in the metrics

    def rollout(self, step: int, fn: Callable[[], Any], first: Optional[Callable[[], Any]] = None) -> Any:
        """Run ``fn`` on rank 0 (generation + scoring) and return its result on every rank.
        ``first``: what rank 0 calls on the first attempt instead (the result of a generation
        already under way in the background); a failure is recovered from as for ``fn``, and
        the retries call ``fn``."""
        for attempt in range(1, self.max_attempts + 1):
            outcome: Optional[tuple[str, Any]] = None
            if self.owner:
                try:
                    outcome = ("ok", (first if attempt == 1 and first is not None else fn)())
                except RolloutError as e:
                    outcome = ("failed", str(e))
            kind, payload = broadcast(outcome)
            if kind == "ok":
                return payload
            if stop.agreed_signal():  # collective: every rank is here, after the broadcast
                raise stop.StepInterrupted(f"generation failed while stopping: {payload}")
            self._recover(step, f"generation failed (attempt {attempt} of {self.max_attempts}): {payload}",
                          attempt)
        raise AssertionError("unreachable")

    def release_memory(self) -> None:
        """Colocated mode: the engines free their GPU memory until the next ``sync`` (a no-op
        otherwise). Collective (every rank learns of a failure)."""
        if self.colocate and not self.released:
            self._on_owner(self.engine.release_memory, "release memory")
            self.released = True

    def _on_owner(self, fn: Callable[[], None], what: str) -> None:
        """Rank 0 calls ``fn``; an error stops every rank."""
        error = None
        if self.owner:
            try:
                fn()
            except RolloutError as e:
                error = str(e)
        error = broadcast(error)
        if error is not None:
            raise EngineUnavailableError(f"rollout engine: {what} failed: {error}")

    def sync(self, step: int) -> SyncStats:
        """Push the weights of ``step`` to the engine(s), recovering from engine failures;
        returns the SyncStats of the sync that succeeded. A released engine (colocated mode)
        takes its weights' memory back first and its KV cache after."""
        if self.released:
            self._on_owner(lambda: self.engine.resume_memory(["weights"]), "resume memory (weights)")
        stats = self._sync(step)
        if self.released:
            self._on_owner(lambda: self.engine.resume_memory(["kv_cache"]), "resume memory (kv_cache)")
            self.released = False
        return stats

    def _sync(self, step: int) -> SyncStats:
        for attempt in range(1, self.max_attempts + 1):
            try:
                return self.engine.receive_weights(self.modules, step)
            except WeightSyncError as e:  # raised on every rank (the syncer agrees on errors)
                if stop.agreed_signal():
                    log.warning("weight sync skipped: the run is stopping and the engine failed (%s)", e)
                    self.engine.forget_weights()
                    return SyncStats(step=step)
                self._recover(step, f"weight sync failed (attempt {attempt} of {self.max_attempts}): {e}",
                              attempt, resync=False)

    def ensure_alive(self, step: int) -> None:
        """Before a rollout: restart a launched engine that died since the last step."""
        if broadcast(self._restart_if_dead() if self.owner else None):
            self._resync(step)

    def _restart_if_dead(self) -> bool:
        restarted = self.engine.restart_if_dead()
        self.restarts += restarted
        return restarted

    def _recover(self, step: int, what: str, attempt: int, resync: bool = True) -> None:
        """Collective: give up after the last attempt, else restart a dead launched engine (or
        wait for an external one) and put the current weights back."""
        if attempt >= self.max_attempts:
            raise EngineUnavailableError(f"rollout engine: {what}; giving up")
        log.warning("rollout engine: %s; recovering", what)
        error = None
        if self.owner:
            try:
                self._restart_if_dead()
            except RolloutError as e:  # restarts used up, or the relaunch failed its deadline
                error = str(e)
            if error is None and not self.engine.restarts_itself:
                time.sleep(self.retry_wait_s * attempt)  # an external server: give it time
        error = broadcast(error)
        if error is not None:
            raise EngineUnavailableError(f"rollout engine: {what}; restart failed: {error}")
        if resync:
            self._resync(step)
        else:
            self.engine.forget_weights()

    def close(self) -> None:
        """Stop what the run started for the engine (every rank)."""
        self.engine.close()

    def _resync(self, step: int) -> SyncStats:
        """A restarted engine serves the initial HF weights: forget its state and sync."""
        self.engine.forget_weights()
        return self._sync(step)
