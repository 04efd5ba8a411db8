"""The weight sync's delivery into servers (the embedded engine and SGLang over HTTP):
``ServerDelivery``, the strategy ``sync/driver.py``'s ``WeightSync`` runs for them.

1. ``prepare``: the coordinator pauses generation on every engine (SGLang's default ``abort``
   mode: a synchronous trainer has nothing running then; ``retract`` with ``rollout.mode:
   async``, whose sequences resume with the new weights), flushes the KV cache, and opens the
   ``/begin_weight_update`` bracket when the transport needs it (on every transport for LoRA);
2. ``send``: each stage's SENDER casts each full tensor once to the engine's dtype, packs
   single-dtype byte buckets of ``sync.bucket_mb`` -- the non-expert tensors first, then the
   experts, never both in one bucket -- and hands them to the transport (``transports.py``),
   computing the checksums (and first rows) of what it sent while each bucket is in flight;
3. ``mismatches``: what every engine now serves, the way the engine's adapter can check it
   (exact per-tensor checksums on the embedded engine, ``wire/checksum.py``; the first rows of
   each tensor on SGLang, whose check is partial: the driver also probes it);
4. ``finish``: the coordinator sets ``weight_version``, closes the bracket, flushes the cache
   again and continues generation, engine by engine.

A LoRA policy on an engine that merges on its side (``EngineAdapter.merges_lora``: the embedded
engine) is sent ``lora_sync.py``'s buckets: the frozen base, then the adapters alone; a verified
sync compares the engine's checksums with the trainer's recomputation of its merge.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.models.weights import expert_hf_names
from megatron_grpo.generation.client import RolloutClient
from megatron_grpo.generation.adapters import ENGINES
from megatron_grpo.generation.http_engine import with_api_key
from megatron_grpo.generation.manager import weight_sync_dir
from megatron_grpo.wire.samples import RolloutError
from megatron_grpo.runtime.device import cuda_available
from megatron_grpo.sync.driver import Sent, SyncStats, sync_roles
from megatron_grpo.sync.lora_sync import adapter_buckets, base_stream, mark_base, reference_checksums
from megatron_grpo.sync.transports import TRANSPORTS
from megatron_grpo.wire.buckets import plan_buckets
from megatron_grpo.wire.checksum import tensor_checksum

log = logging.getLogger(__name__)

_SAMPLE_ROWS = 8  # first rows of each tensor kept for engines that verify by rows


def _expert_split_buckets(named_tensors, expert_names: Callable[[], frozenset[str]], bucket_bytes: int):
    """``plan_buckets`` over the non-expert tensors, then over the expert tensors (the stream
    yields them in that order), so that no bucket mixes the two."""
    experts = expert_names()
    for _, group in itertools.groupby(named_tensors, key=lambda nt: nt[0] in experts):
        yield from plan_buckets(group, bucket_bytes)


class ServerDelivery:
    """The ``Delivery`` into the engines at ``urls`` over ``sync.transport`` (module doc)."""

    phase = "send"
    verifies_merge = True
    probe_hint = (": it does not serve the trainer's weights, or serves them at a lower precision "
                  "(then raise the tolerance)")

    def __init__(self, cfg: ExperimentConfig, urls: list[str], hf_config, *, work_dir: Optional[str | Path] = None,
                 master_address: str = "127.0.0.1", client: Optional[RolloutClient] = None):
        """``cfg``: the run's config; the delivery reads ``sync:``, the engine's kind, timeouts and
        quantization (``engine:``) and ``rollout.mode`` (async retracts instead of aborting)."""
        self.sync_cfg, self.engine_cfg, self.mode = cfg.sync, cfg.engine, cfg.rollout.mode
        self.adapter = ENGINES[cfg.engine.kind]
        self.merges_lora = self.adapter.merges_lora
        self.verifies_by_probe = self.adapter.verifies_by_probe
        self.hf_config = hf_config
        self.urls = list(urls)
        roles = sync_roles()
        self.client = client or RolloutClient.from_config(cfg.engine, self.urls)
        self._own_client = client is None
        self.transport = None
        if roles.sender:
            self.transport = TRANSPORTS[cfg.sync.transport](
                self.client, stage=roles.stage, bucket_bytes=cfg.sync.bucket_mb * 2**20,
                timeout_s=cfg.engine.request_timeout_s,
                master_address=cfg.sync.master_address or master_address,
                work_dir=Path(work_dir) if work_dir else None, hf_config=hf_config,
                backend=self.adapter.backend(cfg.sync, cuda_available()),
                tensor_wire=self.adapter.tensor_wire(cuda_available()))
        self._engine_info: Optional[list[dict]] = None
        self._opened: list[str] = []  # engines whose update bracket this sync opened
        self._dtype: Optional[torch.dtype] = None  # the engines' dtype, read at ``begin``

    @classmethod
    def of_engine(cls, cfg: ExperimentConfig, hf_config, engine) -> "ServerDelivery":
        """Into the servers of ``engine`` (an ``HttpEngine``: its URLs, the run's key, rank 0's
        client), the transport's files under the run's weight-sync directory."""
        return cls(with_api_key(cfg, engine.api_key), engine.urls, hf_config,
                   work_dir=weight_sync_dir(cfg.trainer.run_dir), client=engine.client)

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

    # ---- the coordinator's ends of a sync --------------------------------------------------

    def prepare(self, lora: bool) -> None:
        self._opened = []
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

    def finish(self, step: Optional[int]) -> None:
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

    # ---- a stage's sender ------------------------------------------------------------------

    def begin(self, step: int, send_base: bool) -> None:
        self._dtype = self.engine_dtype()
        self.transport.begin(step)

    def send(self, weights, step: int, verify: bool, stats: SyncStats, sent: Sent) -> None:
        """Pack and send the merged weights; on a verified sync note each tensor's checksum and
        first rows while its bucket is in flight."""
        dtype = self._dtype

        def converted():
            for name, tensor in weights:
                yield name, (tensor.to(dtype) if dtype is not None and tensor.dtype != dtype else tensor)

        def checksum(bucket) -> None:  # runs while the bucket is in flight
            c0 = time.perf_counter()
            # over the tensors as the weight iterator gave them, not the packed send buffer:
            # a packing bug (wrong offset, flipped byte) must show as a difference
            for name, tensor in zip(bucket.names, bucket.tensors):
                sent.checksums[name] = tensor_checksum(tensor)
                sent.rows[name] = tensor[:_SAMPLE_ROWS].detach().float().cpu().clone()
            stats.checksum_seconds += time.perf_counter() - c0

        self.transport.request_extras = self.adapter.request_extras(verify)
        for bucket in _expert_split_buckets(converted(), self._expert_names, self.transport.bucket_bytes):
            self.transport.send(bucket, overlap=(lambda b=bucket: checksum(b)) if verify else None)
            stats.num_buckets += 1
            stats.num_tensors += len(bucket.names)
            stats.num_bytes += bucket.nbytes
        self.transport.end(step)

    def send_lora(self, base, adapted: frozenset[str], units, scale: float, step: int, verify: bool,
                  stats: SyncStats, sent: Sent) -> None:
        """The adapter-only sync of this stage (``lora_sync.py``): the frozen base first (when
        ``base`` yields it), then the adapters; on a verified sync ``sent`` gets the checksums
        of what the engine must serve."""
        dtype = self._dtype
        self.transport.request_extras = self.adapter.request_extras(verify)

        def send(bucket, overlap) -> None:
            self.transport.send(bucket, overlap=overlap)
            stats.num_buckets += 1
            stats.num_tensors += len(bucket.names)
            stats.num_bytes += bucket.nbytes

        def checksum(tensors: dict[str, torch.Tensor]) -> None:  # runs while the bucket is in flight
            c0 = time.perf_counter()
            sent.checksums.update((name, tensor_checksum(t)) for name, t in tensors.items())
            stats.checksum_seconds += time.perf_counter() - c0

        def reference(held) -> None:  # the engine's merge, recomputed while the bucket is in flight
            c0 = time.perf_counter()
            sent.checksums.update(reference_checksums(held, scale, dtype))
            stats.checksum_seconds += time.perf_counter() - c0

        for bucket in _expert_split_buckets(base_stream(base, adapted, dtype), self._expert_names,
                                            self.transport.bucket_bytes):
            tensors = dict(zip(bucket.names, bucket.tensors))
            # verified as sent, except the bases: the adapters below are merged over them
            as_sent = {n: tensors[n] for n in mark_base(bucket, adapted)}
            send(bucket, (lambda t=as_sent: checksum(t)) if verify else None)
        for bucket, held in adapter_buckets(units, self.transport.bucket_bytes, scale):
            send(bucket, (lambda h=held: reference(h)) if verify else None)
        self.transport.end(step)

    def collect(self, step: int, lora: bool, verify: bool, stats: SyncStats, sent: Sent) -> None:
        """Nothing to collect: every stage's sender sent to the engines itself."""

    def _expert_names(self) -> frozenset[str]:
        if self.hf_config is None:  # weights come from a caller's ``iter_weights``, no model to ask
            return frozenset()
        return expert_hf_names(self.hf_config)

    def mismatches(self, sent: Sent):
        for url in self.urls:
            yield f"engine {url}", self.adapter.verify(self.client, url, sent.checksums, sent.rows,
                                                       quantized=self.engine_cfg.quantization is not None)

    def served_logprobs(self, tokens: list[int]):
        for url in self.urls:
            yield f"engine {url}", self.client.prompt_logprobs(url, tokens), self.engine_info()[0].get("dtype", "?")

    def reset(self) -> None:
        """Forget engine state (an engine restarted, or a sync failed)."""
        self._engine_info = None
        if self.transport is not None:
            self.transport.reset()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        if self._own_client:
            self.client.close()
