"""The weight sync into an in-process engine (``rollout.engine: inprocess``): an in-memory copy.

``InMemorySyncer.sync(model_chunks, step)`` is collective over ALL trainer ranks, like
``WeightSyncer.sync``, and keeps its checks; what it drops is the transfer:

1. on data-parallel replica 0, every pipeline stage iterates ``models.iter_hf_weights`` (the
   single HF <-> Megatron mapping, collective over the stage's TP group: the same gather and
   layout as the HTTP sync); global rank 0 (stage 0's TP rank 0) copies each full tensor
   straight into the engine's parameter of the same HF name (``EmbeddedEngine.load_weights``:
   names and shapes checked, cast to the engine's dtype, a quantized copy rebuilt);
2. with pipeline parallelism the other stages' TP rank 0 hand their tensors to rank 0 in one
   ``gather_object`` over the default group (every rank joins it, so none waits forever);
3. every ``rollout.verify_weights_every`` syncs rank 0 compares the checksum of each tensor as
   it meant to load it (``wire/checksum.py``, after the cast) with the engine's checksum of its
   parameter after the copy; a difference raises ``WeightSyncError`` naming the tensor;
4. rank 0 sets the engine's weight version to ``str(step)``.

No pause or flush is needed: the copy holds the engine (``EmbeddedEngine.exclusive``), which
waits for a running batch to finish and admits none meanwhile, so every sequence is generated
by one weight version. No probe either: the engine's check is exact. Failures are agreed on
collectively after each phase, so every rank raises the same one-line error.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_grpo.models import iter_hf_weights
from megatron_grpo.rollout.embedded.engine import EmbeddedEngine
from megatron_grpo.sync.syncer import SyncStats, WeightSyncError
from megatron_grpo.wire.checksum import compare_checksums, tensor_checksum


def agree(error: Optional[str], what: str) -> None:
    """Collective: raise WeightSyncError on every rank if any rank reported an error."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        rank, message = failed[0]
        more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        raise WeightSyncError(f"weight sync {what} failed on rank {rank}{more}: {message}")


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _roles() -> tuple[bool, bool, int]:
    """(participant, stage sender, pp size) of this rank: participants iterate the weights
    (collective over TP/EP), a stage's sender keeps the full tensors (dp 0, tp 0)."""
    if not ps.model_parallel_is_initialized():
        return True, True, 1
    participant = ps.get_expert_data_parallel_rank() == 0
    sender = participant and ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    return participant, sender, ps.get_pipeline_model_parallel_world_size()


class InMemorySyncer:
    """Per-step sync of Megatron chunks into rank 0's ``engine`` (None on the other ranks)."""

    def __init__(self, rollout_cfg, hf_config, engine: Optional[EmbeddedEngine], *,
                 iter_weights: Optional[Callable] = None):
        self.rollout_cfg = rollout_cfg
        self.hf_config = hf_config
        self.engine = engine
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.participant, self.sender, self.pp = _roles()
        if self.rank == 0 and engine is None:
            raise ValueError("InMemorySyncer: rank 0 needs the engine")
        self._iter_weights = iter_weights or iter_hf_weights
        self.num_syncs = 0

    def sync(self, model_chunks: list, step: int) -> SyncStats:
        """Make the engine serve ``model_chunks``' weights as weight_version ``str(step)``."""
        started = time.perf_counter()
        every = self.rollout_cfg.verify_weights_every
        verify = every > 0 and self.num_syncs % every == 0
        stats = SyncStats(step=step, verified=verify,
                          role="coordinator+sender" if self.rank == 0 else
                          "sender" if self.sender else "peer" if self.participant else "idle")
        expected: dict[str, str] = {}
        kept: list[tuple[str, torch.Tensor]] = []  # a later stage's tensors, for rank 0
        error = None
        if self.participant:
            error = self._stage(model_chunks, verify, stats, expected, kept)
        agree(error, f"copy (step {step})")
        if self.pp > 1:
            self._gather_stages(kept, verify, stats, expected, step)
        if verify:
            problem = None
            if self.rank == 0:
                c0 = time.perf_counter()
                try:
                    served = {n: v["checksum"] for n, v in self.engine.checksums(sorted(expected)).items()}
                    bad = compare_checksums(expected, served)
                    if bad:
                        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
                        problem = f"{bad[0]}{more} differs between the trainer and the in-process engine " \
                                  f"after the step {step} sync"
                except Exception as e:  # noqa: BLE001 - agreed on below
                    problem = f"cannot verify: {_one_line(e)}"
                stats.checksum_seconds += time.perf_counter() - c0
            agree(problem, f"verification (step {step})")
        if self.rank == 0:
            self.engine.weight_version = str(step)
        self.num_syncs += 1
        stats.seconds = time.perf_counter() - started
        return stats

    def _load(self, named: Iterator[tuple[str, torch.Tensor]], verify: bool, stats: SyncStats,
              expected: dict[str, str]) -> None:
        """Rank 0: copy ``named`` into the engine, noting each tensor's checksum as loaded."""
        dtype = self.engine.dtype

        def converted():
            for name, tensor in named:
                tensor = tensor.to(device=self.engine.device, dtype=dtype)
                if verify:  # of the tensor as meant to be served, before the engine touches it
                    c0 = time.perf_counter()
                    expected[name] = tensor_checksum(tensor)
                    stats.checksum_seconds += time.perf_counter() - c0
                stats.num_tensors += 1
                stats.num_bytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        with self.engine.exclusive():
            self.engine.load_weights(converted(), compute_checksums=verify)

    def _stage(self, model_chunks, verify, stats, expected, kept) -> Optional[str]:
        """Iterate this stage's weights: rank 0 loads them, a later stage's sender keeps them,
        TP peers only feed the gather. Returns an error or None (after draining the iterator,
        so TP peers are never left in a collective)."""
        t0 = time.perf_counter()
        weights = self._iter_weights(model_chunks, self.hf_config)
        error = None
        try:
            if self.rank == 0:
                self._load(weights, verify, stats, expected)
            elif self.sender:
                # CPU copies: gather_object pickles them (a GPU tensor would pickle a device handle)
                kept.extend((name, tensor.detach().cpu()) for name, tensor in weights)
        except Exception as e:  # noqa: BLE001 - reported collectively by the caller
            error = _one_line(e)
        for _ in weights:
            pass
        stats.send_seconds = time.perf_counter() - t0
        return error

    def _gather_stages(self, kept, verify, stats, expected, step) -> None:
        """Collective (pp > 1): the later stages' tensors to rank 0, which loads them."""
        gathered = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(kept if self.sender and self.rank != 0 else None, gathered, dst=0)
        error = None
        if self.rank == 0:
            try:
                t0 = time.perf_counter()
                self._load((nt for part in gathered if part for nt in part), verify, stats, expected)
                stats.send_seconds += time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                error = _one_line(e)
        agree(error, f"copy of the later pipeline stages (step {step})")

    def reset(self) -> None:
        """Nothing to forget: the engine lives and dies with this process."""

    def close(self) -> None:
        """Nothing to close (the engine is closed by its ``InProcessEngine``)."""
