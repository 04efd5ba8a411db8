"""``WeightSync``: the one weight sync from the trainer's Megatron chunks into the rollout engine.

``WeightSync.sync(model_chunks, step)`` is collective over ALL trainer ranks and runs the same
stages whatever the engine; only how the tensors reach it is the engine's ``Delivery`` (a
strategy: ``sync/servers.py`` over ``sync.transport`` into servers, ``sync/in_memory.py`` a copy
into the in-process engine; ``sync/factory.py`` picks it for the engine kind):

1. the coordinator (global rank 0) prepares the engine (pause, flush, update bracket);
2. on data-parallel replica 0 every pipeline stage iterates ``models.iter_hf_weights``
   (collective over its TP/EP group), and the stage's SENDER (tp rank 0) hands the stream to
   the delivery; a LoRA policy on an engine that merges on its side sends the frozen base on
   the first sync (after start, resume, ``reset`` or a failed sync), then the adapters alone;
3. every ``sync.verify_every`` syncs the senders compare what they meant to serve with what
   the engine serves (the delivery's check); a difference names the tensor;
4. the coordinator sets the weight version to ``str(step)`` (only after a good sync) and
   resumes the engine, even after a failure;
5. on a verified sync of a LoRA policy, or of an engine whose per-tensor check is partial,
   every rank runs the trainer's probe forward and the coordinator compares the engine's
   log-probs of the same sequence (``sync.verify_logprob_tolerance``).

Each stage's failure on any rank is one line agreed on by every rank (``runtime.collectives
.agree``), so all raise the same ``WeightSyncError``; a sender that fails keeps draining the
weights so its TP peers finish their collectives. docs/weight_sync.md has the details.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.models import iter_hf_weights
from megatron_grpo.models.lora import has_lora
from megatron_grpo.models.lora_export import AdapterUnit, adapted_hf_names, iter_adapter_units
from megatron_grpo.runtime.collectives import agree
from megatron_grpo.runtime.errors import one_line
from megatron_grpo.wire.samples import RolloutError

_PROBE_LENGTH = 32

# probe(token_ids) -> the trainer's log-probs of token_ids[1:] given the prefix, at temperature
# 1, on the rank(s) that hold them (None elsewhere). Collective over every trainer rank.
Probe = Callable[[list[int]], Optional[list[float]]]


class WeightSyncError(RuntimeError):
    """The weight sync failed or the engine does not serve the weights the trainer sent."""


def agree_or_raise(error: Optional[str], what: str) -> None:
    """Collective: raise WeightSyncError on every rank if any rank reported an error (its line)."""
    failure = agree(error)
    if failure is not None:
        raise WeightSyncError(f"weight sync {what} failed on {failure}")


def failure_line(e: Exception) -> str:
    """An engine check's exception as one line: a ``RolloutError`` names its server and route
    itself, anything else gets its type."""
    return str(e) if isinstance(e, RolloutError) else one_line(e, None)


@dataclass
class SyncStats:
    """What one ``sync`` did, as seen by this rank (senders fill the byte counts)."""

    step: int
    seconds: float = 0.0
    send_seconds: float = 0.0
    """Time in iter_hf_weights + packing + delivery on this rank (includes the trainer-side
    checksums, which run while buckets are in flight)."""
    checksum_seconds: float = 0.0
    """CPU time of the trainer-side checksums (overlapped with transfers) plus the time of the
    comparison with the engine's (not overlapped)."""
    num_bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    verified: bool = False
    role: str = "idle"
    """coordinator+sender, sender, peer (a TP rank feeding a sender) or idle (DP replica > 0)."""
    per_engine_seconds: dict = field(default_factory=dict)
    probe_logprob_abs_diff: Optional[float] = None
    """Largest (over engines) mean |engine - trainer| log-prob on the probe, when probed."""


@dataclass
class Sent:
    """What the senders meant the engine to serve, for the check: {HF name: checksum} and
    {HF name: first rows} (for engines that verify by rows)."""

    checksums: dict[str, str] = field(default_factory=dict)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)


def probe_abs_diff(served: list[float], trainer: list[float]) -> float:
    """Mean |engine - trainer| log-prob over the probe's tokens (in float64)."""
    diff = torch.tensor(served, dtype=torch.float64) - torch.tensor(trainer, dtype=torch.float64)
    return float(diff.abs().mean())


def probe_tokens(vocab_size: int, length: int = _PROBE_LENGTH) -> list[int]:
    """A fixed pseudo-random token sequence for the log-prob probe (same on every rank)."""
    gen = torch.Generator().manual_seed(20240917)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


@dataclass(frozen=True)
class SyncRoles:
    """This rank's part in a sync. ``participant``: iterates the weights (expert-dp replica 0:
    with ep > 1 the replicas that together hold every expert); ``sender``: also holds the
    stage's full tensors (dp replica 0, tp rank 0); ``stage``/``pp``: its pipeline stage and
    their number."""

    participant: bool
    sender: bool
    stage: int
    pp: int


def sync_roles() -> SyncRoles:
    """This rank's ``SyncRoles`` (a single sender without megatron parallel state)."""
    if not ps.model_parallel_is_initialized():
        return SyncRoles(True, True, 0, 1)
    participant = ps.get_expert_data_parallel_rank() == 0
    sender = (participant and ps.get_data_parallel_rank(with_context_parallel=True) == 0
              and ps.get_tensor_model_parallel_rank() == 0)
    return SyncRoles(participant, sender, ps.get_pipeline_model_parallel_rank(),
                     ps.get_pipeline_model_parallel_world_size())


class Delivery(Protocol):
    """How a sync's tensors reach the engine and how it is checked: ``WeightSync``'s strategy.
    Methods say on which ranks the driver calls them; their exceptions are agreed on by it."""

    phase: str
    """The name of the send stage in error lines (``weight sync <phase> (step N) failed``)."""
    merges_lora: bool
    """The engine keeps a LoRA policy's frozen base and merges the adapters it is sent."""
    verifies_by_probe: bool
    """Every verified sync is also probed (the per-tensor check is partial)."""
    verifies_merge: bool
    """A verified LoRA sync compares checksums of the engine's merge (needs the bases again)."""
    probe_hint: str
    """Appended to the probe's error line."""

    def prepare(self, lora: bool) -> None:
        """Coordinator: make the engine ready to take weights (``lora``: a LoRA sync)."""

    def begin(self, step: int, send_base: bool) -> None:
        """Senders: before this stage's tensors (``send_base``: a LoRA base follows)."""

    def send(self, weights: Iterator[tuple[str, torch.Tensor]], step: int, verify: bool, stats: SyncStats,
             sent: Sent) -> None:
        """Senders: deliver this stage's merged weights (noting in ``sent`` what to check)."""

    def send_lora(self, base: Iterator[tuple[str, torch.Tensor]], adapted: frozenset[str],
                  units: Iterator[AdapterUnit], scale: float, step: int, verify: bool, stats: SyncStats,
                  sent: Sent) -> None:
        """Senders: this stage's LoRA base (empty unless sent) with its ``adapted`` names, then
        its adapters (``scale``: alpha / r)."""

    def collect(self, step: int, lora: bool, verify: bool, stats: SyncStats, sent: Sent) -> None:
        """Every rank, collective: what the stages handed over reaches the engine."""

    def mismatches(self, sent: Sent) -> Iterator[tuple[str, list[str]]]:
        """Senders: (engine described, names it serves differently from ``sent``) per engine."""

    def served_logprobs(self, tokens: list[int]) -> Iterator[tuple[str, list[float], str]]:
        """Coordinator: (whose, the engine's prompt log-probs of ``tokens``, its dtype) per engine."""

    def finish(self, step: Optional[int]) -> None:
        """Coordinator: set the version to ``step`` (None: a failed sync keeps it) and resume."""

    def reset(self) -> None: ...

    def close(self) -> None: ...


def _drain(streams: Iterable[Iterator]) -> None:
    for _ in itertools.chain(*streams):  # TP peers (and a failed sender) keep the collectives going
        pass


class WeightSync:
    """Per-step weight sync from Megatron chunks into the engine ``delivery`` reaches (module doc)."""

    def __init__(self, cfg: ExperimentConfig, hf_config, delivery: Delivery, *,
                 iter_weights: Optional[Callable] = None, probe: Optional[Probe] = None):
        """``cfg``: the run's config (``sync:``); ``iter_weights``: the merged weights' iterator
        (``models.iter_hf_weights``; tests give their own); ``probe``: the trainer's log-probs of
        the probe sequence (collective; None: no probe)."""
        self.sync_cfg = cfg.sync
        self.hf_config = hf_config
        self.delivery = delivery
        self.probe = probe
        self._iter_weights = iter_weights or iter_hf_weights
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.roles = sync_roles()
        self.participant, self.sender = self.roles.participant, self.roles.sender
        self.coordinator = self.rank == 0
        self.num_syncs = 0
        # the engine holds a LoRA policy's frozen base, so a sync sends the adapters alone.
        # False after start, resume, reset and a failed sync
        self.lora_base_loaded = False

    def _run(self, fn: Callable[[], None], what: str, *, on: bool) -> None:
        error = None
        if on:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - reported collectively below
                error = one_line(e, None)
        agree_or_raise(error, what)

    def sync(self, model_chunks: list, step: int) -> SyncStats:
        """Make the engine serve ``model_chunks``' weights as weight_version ``str(step)``."""
        started = time.perf_counter()
        every = self.sync_cfg.verify_every
        verify = every > 0 and self.num_syncs % every == 0
        stats = SyncStats(step=step, verified=verify,
                          role="coordinator+sender" if self.coordinator else
                          "sender" if self.sender else "peer" if self.participant else "idle")
        ok = False
        lora = self.delivery.merges_lora and has_lora(model_chunks)
        # the base goes first unless the last sync loaded it; a sync that fails from here on may
        # leave the engine with part of it, so only a whole successful sync sets this again
        send_base, self.lora_base_loaded = lora and not self.lora_base_loaded, False
        try:
            self._run(lambda: self.delivery.prepare(lora), "prepare (pause/flush)", on=self.coordinator)
            sent = Sent()
            error = self._send_stage(model_chunks, step, verify, lora, send_base, stats, sent) \
                if self.participant else None
            agree_or_raise(error, f"{self.delivery.phase} (step {step})")
            self.delivery.collect(step, lora, verify, stats, sent)
            if verify:
                self._verify(step, sent, stats)
            ok = True
        finally:
            # Every rank gets here together (failures above are agreed collectively). The
            # engine must leave the update bracket and generate again even after a failed
            # sync -- including one that failed while pausing a dead engine after a live one
            # had opened its bracket -- or the retry's /begin_weight_update is refused; only a
            # good sync moves weight_version.
            try:
                self._run(lambda: self.delivery.finish(step if ok else None), "finish (version/continue)",
                          on=self.coordinator)
            except WeightSyncError:
                if ok:
                    raise
        # a LoRA sync is probed too: the engine's own merge, checked end to end
        if verify and (self.delivery.verifies_by_probe or lora) and self.probe is not None:
            self._verify_probe(step, stats)
        self.lora_base_loaded = lora
        self.num_syncs += 1
        stats.seconds = time.perf_counter() - started
        return stats

    def _send_stage(self, model_chunks: list, step: int, verify: bool, lora: bool, send_base: bool,
                    stats: SyncStats, sent: Sent) -> Optional[str]:
        """Iterate this stage's weights (merged, or a LoRA base then adapters); the sender hands
        them to the delivery. Returns an error or None, after draining the iterators."""
        t0 = time.perf_counter()
        error = None
        if self.sender:
            try:
                self.delivery.begin(step, send_base)
            except Exception as e:  # noqa: BLE001 - reported collectively by the caller
                error = one_line(e, None)
        if lora:
            base = iter_hf_weights(model_chunks, self.hf_config, merge_lora=False) if send_base else iter(())
            units = iter_adapter_units(model_chunks, self.hf_config, with_base=verify and self.delivery.verifies_merge)
            streams = (base, units)
        else:
            streams = (self._iter_weights(model_chunks, self.hf_config),)
        if self.sender and error is None:
            try:
                if lora:
                    self.delivery.send_lora(base, adapted_hf_names(model_chunks, self.hf_config), units,
                                            model_chunks[0].lora_spec.scale, step, verify, stats, sent)
                else:
                    self.delivery.send(streams[0], step, verify, stats, sent)
            except Exception as e:  # noqa: BLE001 - drained below so TP peers are not left in a collective
                error = one_line(e, None)
        _drain(streams)
        stats.send_seconds += time.perf_counter() - t0
        return error

    def _verify(self, step: int, sent: Sent, stats: SyncStats) -> None:
        """Compare the engine's weights with what the senders sent; raise on every rank if not equal."""
        problem = None
        if self.sender:
            c0 = time.perf_counter()
            try:
                for engine, bad in self.delivery.mismatches(sent):
                    if bad:
                        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                        problem = f"{bad[0]}{more} differs between the trainer and {engine} after the step {step} sync"
                        break
            except Exception as e:  # noqa: BLE001 - agreed on below
                problem = f"cannot verify: {failure_line(e)}"
            stats.checksum_seconds += time.perf_counter() - c0
        agree_or_raise(problem, f"verification (step {step})")

    def _verify_probe(self, step: int, stats: SyncStats) -> None:
        """Collective: the engine's prompt log-probs of the probe equal the trainer's (module doc, 5)."""
        tokens = probe_tokens(self.hf_config.vocab_size)
        error, mine = None, None
        try:
            mine = self.probe(tokens)
        except Exception as e:  # noqa: BLE001 - agreed on below
            error = one_line(e, None)
        agree_or_raise(error, f"probe forward (step {step})")
        gathered: list = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(gathered, mine)
        trainer = next((g for g in gathered if g is not None), None)
        problem = None
        if self.coordinator:
            tolerance = self.sync_cfg.verify_logprob_tolerance
            try:
                stats.probe_logprob_abs_diff = 0.0
                for whose, served, dtype in self.delivery.served_logprobs(tokens):
                    mean = probe_abs_diff(served, trainer)
                    stats.probe_logprob_abs_diff = max(stats.probe_logprob_abs_diff, mean)
                    if not mean <= tolerance:
                        problem = (f"{whose} log-probs on the probe differ from the trainer's by {mean:.3g} "
                                   f"on average after the step {step} sync (sync.verify_logprob_tolerance="
                                   f"{tolerance}; engine dtype {dtype}){self.delivery.probe_hint}")
                        break
            except Exception as e:  # noqa: BLE001 - agreed on below
                problem = f"cannot probe: {failure_line(e)}"
        agree_or_raise(problem, f"probe verification (step {step})")

    def reset(self) -> None:
        """Forget engine state (call on every rank after an engine restarted, or after a failed
        sync): the next sync of a LoRA policy sends the base again."""
        self.lora_base_loaded = False
        self.delivery.reset()

    def close(self) -> None:
        self.delivery.close()
