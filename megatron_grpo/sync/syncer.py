"""Push the trainer's weights into the rollout engine(s) after an optimizer step, verified.

``WeightSyncer.sync(model_chunks, step)`` is collective over ALL trainer ranks:

1. the coordinator (global rank 0) pauses generation on every engine (SGLang's default
   ``abort`` mode: a synchronous trainer has nothing running then; ``retract`` with
   ``rollout.mode: async``, whose sequences resume with the new weights), flushes the KV cache, and
   opens the ``/begin_weight_update`` bracket when the transport needs it;
2. on data-parallel replica 0, every pipeline stage iterates ``models.iter_hf_weights`` (the
   single HF <-> Megatron mapping, collective over the stage's TP group; with expert
   parallelism the ep replicas holding the experts iterate too, each expert gathered over
   them; with bf16/fp16 training these are the optimizer's fp32 main weights); the stage's TP
   rank 0 of replica 0 (the SENDER) casts each full tensor once to the engine's dtype, packs single-dtype byte buckets of ``sync.bucket_mb`` --
   the non-expert tensors first, then the experts, never both in one bucket -- and hands them
   to the transport (``transports.py``);
3. every ``sync.verify_every`` syncs, each sender compares what it meant to send
   with what every engine now serves, the way the engine's adapter can (exact per-tensor
   checksums on the embedded engine, ``wire/checksum.py``; the first rows of each tensor on
   SGLang); a difference raises ``WeightSyncError`` naming the tensor, on every rank;
4. the coordinator sets the engines' ``weight_version`` to ``str(step)``, closes the bracket,
   flushes the cache again and continues generation;
5. on a verified sync of an engine whose per-tensor check is partial (SGLang), every rank runs
   ``probe`` (the trainer's own forward, collective) on a fixed probe sequence and the
   coordinator compares its log-probs with each engine's prompt log-probs of the same
   sequence: a weight the row check could not see, or a layout the engine's loader
   misreads, shows as a mean |difference| above ``sync.verify_logprob_tolerance``. With
   ``engine.quantization`` the trainer's probe forward runs through the engine's fake
   quantization (``models.fake_quant``), so the tolerance stays that of unquantized weights.

A LoRA policy on an engine that merges on its side (``EngineAdapter.merges_lora``: the embedded
engine) takes ``lora_sync.py``'s path in step 2 instead: the frozen base on the first sync (after
start, resume, ``reset`` or a failed sync), then the adapters alone; the update bracket is opened
on every transport, step 3 compares the engine's checksums with the trainer's recomputation of
its merge, and step 5's probe runs for it too.

Failures are agreed on collectively (an ``all_gather_object`` after each phase), so every rank
raises the same one-line error instead of some ranks waiting forever in the next collective.
A sender whose transport fails keeps draining ``iter_hf_weights`` so its TP peers finish too.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.models import iter_hf_weights
from megatron_grpo.models.lora import has_lora
from megatron_grpo.models.lora_export import adapted_hf_names, iter_adapter_units
from megatron_grpo.models.weights import expert_hf_names
from megatron_grpo.generation.client import RolloutClient
from megatron_grpo.generation.engines import ENGINES
from megatron_grpo.wire.samples import RolloutError
from megatron_grpo.runtime.collectives import agree
from megatron_grpo.runtime.device import cuda_available
from megatron_grpo.runtime.errors import one_line
from megatron_grpo.sync.lora_sync import adapter_buckets, base_stream, mark_base, reference_checksums
from megatron_grpo.sync.transports import TRANSPORTS
from megatron_grpo.wire.buckets import plan_buckets
from megatron_grpo.wire.checksum import tensor_checksum

log = logging.getLogger(__name__)

_SAMPLE_ROWS = 8  # first rows of each tensor kept for engines that verify by rows
_PROBE_LENGTH = 32

# probe(token_ids) -> the trainer's log-probs of token_ids[1:] given the prefix, at temperature
# 1, on the rank(s) that hold them (None elsewhere). Collective over every trainer rank.
Probe = Callable[[list[int]], Optional[list[float]]]


def _expert_split_buckets(named_tensors, expert_names: Callable[[], frozenset[str]], bucket_bytes: int):
    """``plan_buckets`` over the non-expert tensors, then over the expert tensors (the stream
    yields them in that order), so that no bucket mixes the two."""
    experts = expert_names()
    for _, group in itertools.groupby(named_tensors, key=lambda nt: nt[0] in experts):
        yield from plan_buckets(group, bucket_bytes)


class WeightSyncError(RuntimeError):
    """The weight sync failed or the engine does not serve the weights the trainer sent."""


def agree_or_raise(error: Optional[str], what: str) -> None:
    """Collective: raise WeightSyncError on every rank if any rank reported an error (its line)."""
    failure = agree(error)
    if failure is not None:
        raise WeightSyncError(f"weight sync {what} failed on {failure}")


@dataclass
class SyncStats:
    """What one ``sync`` did, as seen by this rank (senders fill the byte counts)."""

    step: int
    seconds: float = 0.0
    send_seconds: float = 0.0
    """Time in iter_hf_weights + packing + transport on this rank (includes the trainer-side
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


def probe_abs_diff(served: list[float], trainer: list[float]) -> float:
    """Mean |engine - trainer| log-prob over the probe's tokens (in float64)."""
    diff = torch.tensor(served, dtype=torch.float64) - torch.tensor(trainer, dtype=torch.float64)
    return float(diff.abs().mean())


def probe_tokens(vocab_size: int, length: int = _PROBE_LENGTH) -> list[int]:
    """A fixed pseudo-random token sequence for the log-prob probe (same on every rank)."""
    gen = torch.Generator().manual_seed(20240917)
    return torch.randint(0, vocab_size, (length,), generator=gen).tolist()


def _parallel_ranks() -> tuple[int, int, int, int]:
    """(dp_rank, expert-dp rank, tp_rank, pp_rank) of this process (all 0 without megatron
    parallel state). The expert-dp rank equals the dp rank unless ep > 1."""
    if not ps.model_parallel_is_initialized():
        return 0, 0, 0, 0
    return (ps.get_data_parallel_rank(with_context_parallel=True), ps.get_expert_data_parallel_rank(),
            ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())


class WeightSyncer:
    """Per-step weight sync from Megatron chunks to the engines at ``urls`` (see module doc)."""

    def __init__(self, cfg: ExperimentConfig, urls: list[str], hf_config, *, work_dir: Optional[str | Path] = None,
                 master_address: str = "127.0.0.1", client: Optional[RolloutClient] = None,
                 iter_weights: Optional[Callable] = None, probe: Optional[Probe] = None):
        """``cfg``: the run's config; the sync reads ``sync:``, the engine's kind, timeouts and
        quantization (``engine:``) and ``rollout.mode`` (async retracts instead of aborting)."""
        self.sync_cfg, self.engine_cfg, self.mode = cfg.sync, cfg.engine, cfg.rollout.mode
        self.adapter = ENGINES[cfg.engine.kind]
        self.probe = probe
        self.hf_config = hf_config
        self.urls = list(urls)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        dp_rank, expert_dp_rank, tp_rank, pp_rank = _parallel_ranks()
        # MoE with ep > 1: the ep dp replicas that together hold every expert all iterate the
        # weights (the experts are gathered over them); dp replica 0 alone sends
        self.participant = expert_dp_rank == 0
        self.sender = self.participant and dp_rank == 0 and tp_rank == 0
        self.coordinator = self.rank == 0
        self.stage = pp_rank
        self.client = client or RolloutClient.from_config(cfg.engine, self.urls)
        self._own_client = client is None
        self._iter_weights = iter_weights or iter_hf_weights
        self.transport = None
        if self.sender:
            self.transport = TRANSPORTS[cfg.sync.transport](
                self.client, stage=pp_rank, bucket_bytes=cfg.sync.bucket_mb * 2**20,
                timeout_s=cfg.engine.request_timeout_s,
                master_address=cfg.sync.master_address or master_address,
                work_dir=Path(work_dir) if work_dir else None, hf_config=hf_config,
                backend=self.adapter.backend(cfg.sync, cuda_available()),
                tensor_wire=self.adapter.tensor_wire(cuda_available()))
        self.num_syncs = 0
        # a LoRA policy on an engine that merges on its side (lora_sync.py): the engines hold the
        # frozen base, so a sync sends the adapters alone. False after start, resume and reset.
        self.lora_base_loaded = False
        self._engine_info: Optional[list[dict]] = None
        self._opened: list[str] = []  # engines whose update bracket this sync opened

    # ---- collective helpers -------------------------------------------------------------

    def _run(self, fn: Callable[[], None], what: str, *, on: bool) -> None:
        error = None
        if on:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - reported collectively below
                error = one_line(e, None)
        agree_or_raise(error, what)

    def engine_info(self) -> list[dict]:
        """/get_server_info of every engine (cached until ``reset``)."""
        if self._engine_info is None:
            self._engine_info = [self.client.server_info(u) for u in self.urls]
        return self._engine_info

    def engine_dtype(self) -> Optional[torch.dtype]:
        """The dtype the engines store weights in, if they all report the same one."""
        names = {str(info.get("dtype", "auto")) for info in self.engine_info()}
        if len(names) != 1:
            return None
        dtype = getattr(torch, names.pop(), None)
        return dtype if isinstance(dtype, torch.dtype) else None

    # ---- the sync ---------------------------------------------------------------------

    def sync(self, model_chunks: list, step: int) -> SyncStats:
        """Make the engines serve ``model_chunks``' weights as weight_version ``str(step)``."""
        started = time.perf_counter()
        every = self.sync_cfg.verify_every
        verify = every > 0 and self.num_syncs % every == 0
        stats = SyncStats(step=step, verified=verify,
                          role="coordinator+sender" if self.coordinator else
                          "sender" if self.sender else "peer" if self.participant else "idle")
        ok = False
        self._opened = []
        lora = self.adapter.merges_lora and has_lora(model_chunks)  # adapter-only (module docstring)
        # the base goes first unless the last sync loaded it; a sync that fails from here on may
        # leave the engines with part of it, so only a whole successful sync sets this again
        send_base, self.lora_base_loaded = lora and not self.lora_base_loaded, False
        try:
            self._run(lambda: self._prepare_engines(lora), "prepare (pause/flush)", on=self.coordinator)
            expected: dict[str, str] = {}
            samples: dict[str, torch.Tensor] = {}
            error = None
            if self.participant:
                if lora:
                    error = self._send_lora_stage(model_chunks, step, verify, stats, expected, send_base)
                else:
                    error = self._send_stage(model_chunks, step, verify, stats, expected, samples)
            agree_or_raise(error, f"send (step {step})")
            if verify:
                self._verify(step, expected, samples, stats)
            ok = True
        finally:
            # Every rank gets here together (failures above are agreed collectively). The
            # engines must leave the update bracket and generate again even after a failed
            # sync -- including one that failed while pausing a dead engine after a live one
            # had opened its bracket -- or the retry's /begin_weight_update is refused; only a
            # good sync moves weight_version.
            try:
                self._run(lambda: self._finish_engines(step if ok else None), "finish (version/continue)",
                          on=self.coordinator)
            except WeightSyncError:
                if ok:
                    raise
        # a LoRA sync is probed too: the engine's own merge, checked end to end
        if verify and (self.adapter.verifies_by_probe or lora) and self.probe is not None:
            self._verify_probe(step, stats)
        self.lora_base_loaded = lora
        self.num_syncs += 1
        stats.seconds = time.perf_counter() - started
        return stats

    def _prepare_engines(self, lora: bool = False) -> None:
        # async rollouts: sequences in flight are retracted and resume with the new weights
        # (re-prefilled; each token records its version), instead of being aborted
        mode = "retract" if self.mode == "async" else "abort"
        for url in self.urls:
            self.client.pause_generation(url, mode=mode)
            self.client.flush_cache(url)
            # the engine takes LoRA updates only inside the bracket, on every transport
            if TRANSPORTS[self.sync_cfg.transport].needs_update_session or lora:
                self._open_bracket(url)

    def _open_bracket(self, url: str) -> None:
        """/begin_weight_update on ``url``; a bracket an earlier trainer left open is closed first.

        A trainer killed mid-sync leaves an external engine inside the bracket, and the engine
        then refuses every later /begin_weight_update: the resumed trainer would never sync.
        """
        try:
            self.client.begin_weight_update(url)
        except RolloutError as first:
            if first.status is None:  # no answer: nothing to close
                raise
            try:
                self.client.end_weight_update(url)
            except RolloutError:
                raise first from None
            log.warning("rollout engine %s had a weight-update bracket open (an earlier sync did not "
                        "finish); closed it", url)
            self.client.begin_weight_update(url)
        self._opened.append(url)

    def _finish_engines(self, step: Optional[int]) -> None:
        """Close the bracket, flush, continue; set weight_version to ``step`` unless None.

        Each engine is finished on its own: one that fails (dead, restarting) must not leave
        the others paused or inside the bracket. The first failure is raised afterwards.
        """
        errors = []
        for url in self.urls:
            try:
                if step is not None:
                    self.client.update_weight_version(url, str(step))
                if url in self._opened:
                    self.client.end_weight_update(url)
                self.client.flush_cache(url)
                self.client.continue_generation(url)
            except Exception as e:  # noqa: BLE001 - the other engines still need finishing
                errors.append(e)
        if errors:
            raise errors[0]

    def _send_stage(self, model_chunks, step, verify, stats, expected, samples) -> Optional[str]:
        """Iterate this stage's weights; the sender packs and sends. Returns an error or None."""
        t0 = time.perf_counter()
        error = None
        dtype = None
        try:
            if self.sender:
                dtype = self.engine_dtype()
                self.transport.begin(step)
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
        weights = self._iter_weights(model_chunks, self.hf_config)
        if not self.sender or error:
            for _ in weights:  # TP peers (and a failed sender) keep the collective going
                pass
            return " ".join(error.split()) if error else None

        def converted():
            for name, tensor in weights:
                yield name, (tensor.to(dtype) if dtype is not None and tensor.dtype != dtype else tensor)

        def checksum(bucket) -> None:  # runs while the bucket is in flight
            c0 = time.perf_counter()
            # over the tensors as the weight iterator gave them, not the packed send buffer:
            # a packing bug (wrong offset, flipped byte) must show as a difference
            for name, tensor in zip(bucket.names, bucket.tensors):
                expected[name] = tensor_checksum(tensor)
                samples[name] = tensor[:_SAMPLE_ROWS].detach().float().cpu().clone()
            stats.checksum_seconds += time.perf_counter() - c0

        self.transport.request_extras = self.adapter.request_extras(verify)
        try:
            for bucket in _expert_split_buckets(converted(), self._expert_names, self.transport.bucket_bytes):
                self.transport.send(bucket, overlap=(lambda b=bucket: checksum(b)) if verify else None)
                stats.num_buckets += 1
                stats.num_tensors += len(bucket.names)
                stats.num_bytes += bucket.nbytes
            self.transport.end(step)
        except Exception as e:  # noqa: BLE001 - drain so TP peers are not left in a collective
            error = one_line(e, None)
            for _ in weights:
                pass
        stats.send_seconds = time.perf_counter() - t0
        return error

    def _send_lora_stage(self, model_chunks, step, verify, stats, expected, send_base: bool) -> Optional[str]:
        """The adapter-only sync of this stage (``lora_sync.py``): the frozen base first when
        ``send_base``, then the adapters; on a verified sync ``expected`` gets the checksums of
        what the engine must serve. Returns an error or None; TP peers iterate the same
        collectives and a failed sender drains them."""
        t0 = time.perf_counter()
        error, dtype = None, None
        try:
            if self.sender:
                dtype = self.engine_dtype()
                self.transport.begin(step)
        except Exception as e:  # noqa: BLE001
            error = one_line(e, None)
        base = iter_hf_weights(model_chunks, self.hf_config, merge_lora=False) if send_base else iter(())
        units = iter_adapter_units(model_chunks, self.hf_config, with_base=verify)
        if not self.sender or error:
            for _ in itertools.chain(base, units):  # TP peers (and a failed sender) keep the collectives going
                pass
            return error
        self.transport.request_extras = self.adapter.request_extras(verify)
        scale = model_chunks[0].lora_spec.scale

        def send(bucket, overlap) -> None:
            self.transport.send(bucket, overlap=overlap)
            stats.num_buckets += 1
            stats.num_tensors += len(bucket.names)
            stats.num_bytes += bucket.nbytes

        def checksum(tensors: dict[str, torch.Tensor]) -> None:  # runs while the bucket is in flight
            c0 = time.perf_counter()
            expected.update((name, tensor_checksum(t)) for name, t in tensors.items())
            stats.checksum_seconds += time.perf_counter() - c0

        def reference(held) -> None:  # the engine's merge, recomputed while the bucket is in flight
            c0 = time.perf_counter()
            expected.update(reference_checksums(held, scale, dtype))
            stats.checksum_seconds += time.perf_counter() - c0

        try:
            adapted = adapted_hf_names(model_chunks, self.hf_config)
            for bucket in _expert_split_buckets(base_stream(base, adapted, dtype), self._expert_names,
                                                self.transport.bucket_bytes):
                tensors = dict(zip(bucket.names, bucket.tensors))
                # verified as sent, except the bases: the adapters below are merged over them
                as_sent = {n: tensors[n] for n in mark_base(bucket, adapted)}
                send(bucket, (lambda t=as_sent: checksum(t)) if verify else None)
            for bucket, held in adapter_buckets(units, self.transport.bucket_bytes, scale):
                send(bucket, (lambda h=held: reference(h)) if verify else None)
            self.transport.end(step)
        except Exception as e:  # noqa: BLE001 - drain so TP peers are not left in a collective
            error = one_line(e, None)
            for _ in itertools.chain(base, units):
                pass
        stats.send_seconds = time.perf_counter() - t0
        return error

    def _expert_names(self) -> frozenset[str]:
        if self.hf_config is None:  # weights come from a caller's ``iter_weights``, no model to ask
            return frozenset()
        return expert_hf_names(self.hf_config)

    def _verify(self, step: int, expected: dict[str, str], samples: dict[str, torch.Tensor],
                stats: SyncStats) -> None:
        """Compare the engines' weights with what this stage sent; raise on every rank if not equal."""
        problem = None
        if self.sender:
            c0 = time.perf_counter()
            try:
                for url in self.urls:
                    bad = self.adapter.verify(self.client, url, expected, samples,
                                              quantized=self.engine_cfg.quantization is not None)
                    if bad:
                        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                        problem = (f"{bad[0]}{more} differs between the trainer and engine {url} after the "
                                   f"step {step} sync")
                        break
            except RolloutError as e:
                problem = f"cannot verify: {e}"
            stats.checksum_seconds += time.perf_counter() - c0
        agree_or_raise(problem, f"verification (step {step})")

    def _verify_probe(self, step: int, stats: SyncStats) -> None:
        """Collective: the engines' prompt log-probs of the probe equal the trainer's (module doc, 5)."""
        tokens = probe_tokens(self.hf_config.vocab_size)
        error, mine = None, None
        try:
            mine = self.probe(tokens)
        except Exception as e:  # noqa: BLE001 - agreed on below
            error = f"{type(e).__name__}: {e}"
        agree_or_raise(error, f"probe forward (step {step})")
        gathered: list = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(gathered, mine)
        trainer = next((g for g in gathered if g is not None), None)
        problem = None
        if self.coordinator:
            try:
                stats.probe_logprob_abs_diff = 0.0
                for url in self.urls:
                    served = self.client.prompt_logprobs(url, tokens)
                    mean = probe_abs_diff(served, trainer)
                    stats.probe_logprob_abs_diff = max(stats.probe_logprob_abs_diff, mean)
                    if not mean <= self.sync_cfg.verify_logprob_tolerance:
                        problem = (f"engine {url} log-probs on the probe differ from the trainer's by {mean:.3g} "
                                   f"on average after the step {step} sync (sync.verify_logprob_tolerance="
                                   f"{self.sync_cfg.verify_logprob_tolerance}; engine dtype "
                                   f"{self.engine_info()[0].get('dtype', '?')}): it does not serve the trainer's "
                                   "weights, or serves them at a lower precision (then raise the tolerance)")
                        break
            except RolloutError as e:
                problem = f"cannot probe: {e}"
        agree_or_raise(problem, f"probe verification (step {step})")

    def reset(self) -> None:
        """Forget engine state (call on every rank after an engine restarted, or after a failed
        sync): the next sync of a LoRA policy sends the base again."""
        self.lora_base_loaded = False
        self._engine_info = None
        if self.transport is not None:
            self.transport.reset()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self._own_client:
            self.client.close()
