"""The embedded engine: a transformers causal LM, a scheduler thread, and weight updates.

The HTTP layer (``server.py``) is a thin translation of SGLang's routes onto this class.

Concurrency (one model, several actors):

* the scheduler thread runs "waves" of queued sequences (``generation.run_wave``); requests
  arriving within ``batch_window_s`` of each other share a wave;
* ``pause(mode)`` follows SGLang: ``abort`` ends running and queued sequences with
  ``finish_reason.type == "abort"``; ``in_place`` parks the running wave between two decode
  steps (its KV cache kept) until ``resume()``; ``retract`` stops the wave and re-queues its
  sequences, which are re-prefilled (prompt + tokens so far) after ``resume()``. Requests that
  arrive while paused wait;
* a weight update waits until no wave is running or the running wave is parked (SGLang's
  update lock), and no new wave starts while it runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Iterator, Optional

import torch

from megatron_grpo.rollout.embedded.generation import Sequence, WaveStep, run_wave
from megatron_grpo.models.weights import SafetensorsReader
from megatron_grpo.rollout.embedded.served_names import served_tensors
from megatron_grpo.wire.buckets import unflatten
from megatron_grpo.wire.checksum import tensor_checksum
from megatron_grpo.wire.shm import open_segment

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAUSE_MODES = ("abort", "in_place", "retract")


class EngineError(ValueError):
    """A bad request to the engine (HTTP 400)."""


class EmbeddedEngine:
    """Serves one HF model directory; thread-safe."""

    def __init__(self, model_dir: str | Path, *, dtype: str = "auto", max_batch_size: int = 64,
                 seed: int = 0, batch_window_s: float = 0.005, device: str = "auto"):
        from transformers import AutoModelForCausalLM

        from megatron_grpo.models.tokenizer import load_tokenizer

        self.model_dir = str(model_dir)
        self.device = engine_device(device)
        torch_dtype = "auto" if dtype == "auto" else DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch_dtype).eval()
        self.model.to(self.device)
        self.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.eos_ids = self._eos_ids()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 1 << 20))
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.weight_version = "default"
        self.shared_generator = torch.Generator().manual_seed(seed)
        # by checkpoint name: what the weight sync sends (MoE experts are fused in memory)
        self._params = served_tensors(dict(self.model.named_parameters()),
                                      list(SafetensorsReader(self.model_dir).weight_map))
        self._cond = threading.Condition()
        self._queue: list[Sequence] = []
        self._paused: Optional[str] = None
        self._running = False
        self._parked = False
        self._updating = 0
        self._update_session = False
        self._stop = False
        self._groups: dict[str, object] = {}
        self._recv_buffers: dict[str, torch.Tensor] = {}
        # (path, mapping as a uint8 tensor) of the sender's /dev/shm segment: mapped once and
        # kept while the sender reuses it (fresh mappings cost a page fault per 4 KiB)
        self._shm: Optional[tuple[str, torch.Tensor]] = None
        # name -> checksum of the parameter as loaded by the last update that asked for it,
        # computed in the background so it overlaps the next bucket's transfer.
        self._checksums: dict[str, Future] = {}
        self._checksum_pool = ThreadPoolExecutor(1, thread_name_prefix="engine-checksum")
        self._thread = threading.Thread(target=self._scheduler, name="engine-scheduler", daemon=True)
        self._thread.start()

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            value = getattr(source, "eos_token_id", None)
            ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(int(i) for i in ids)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ---- generation ------------------------------------------------------------------

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue sequences; each calls its ``on_finish`` when done."""
        for s in seqs:
            if len(s.prompt_ids) >= self.max_context:
                raise EngineError(f"prompt of {len(s.prompt_ids)} tokens does not fit the context "
                                  f"length {self.max_context}")
            if s.prompt_ids and (min(s.prompt_ids) < 0 or max(s.prompt_ids) >= self.model.config.vocab_size):
                raise EngineError(f"input_ids must be in [0, {self.model.config.vocab_size})")
            if s.params.seed is not None:
                s.generator = torch.Generator().manual_seed(s.params.seed)
        with self._cond:
            self._queue.extend(seqs)
            self._cond.notify_all()

    def _scheduler(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or (self._queue and self._paused is None
                                                           and not self._updating))
                if self._stop:
                    return
            time.sleep(self.batch_window_s)  # let concurrent requests join this wave
            with self._cond:
                if self._paused is not None or self._updating or not self._queue:
                    continue
                wave, self._queue = self._queue[: self.max_batch_size], self._queue[self.max_batch_size:]
                self._running = True
            try:
                retracted = run_wave(self.model, wave, eos_ids=self.eos_ids, pad_id=self.pad_id,
                                     shared_generator=self.shared_generator, max_context=self.max_context,
                                     control=self._between_steps, weight_version=lambda: self.weight_version)
            except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("generation failed")
                retracted = []
                for s in wave:
                    if not s.finished:
                        s.finish({"type": "abort", "message": f"engine error: {e}"}, self.weight_version)
            with self._cond:
                self._queue[:0] = retracted
                self._running = False
                self._cond.notify_all()

    def _between_steps(self) -> str:
        with self._cond:
            if self._paused == "in_place":
                self._parked = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._paused != "in_place" or self._stop)
                self._parked = False
            if self._paused == "abort" or self._stop:
                return WaveStep.ABORT
            if self._paused == "retract":
                return WaveStep.RETRACT
            return WaveStep.CONTINUE

    def pause(self, mode: str = "abort") -> None:
        """SGLang /pause_generation; returns once the running wave obeyed."""
        if mode not in PAUSE_MODES:
            raise EngineError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        with self._cond:
            self._paused = mode
            if mode == "abort":
                queued, self._queue = self._queue, []
                for s in queued:
                    s.finish({"type": "abort", "message": "generation paused (mode=abort)"}, self.weight_version)
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._running or self._parked)

    def resume(self) -> None:
        """SGLang /continue_generation."""
        with self._cond:
            self._paused = None
            self._cond.notify_all()

    @property
    def paused(self) -> Optional[str]:
        return self._paused

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self._checksum_pool.shutdown(wait=False, cancel_futures=True)

    # ---- weights ---------------------------------------------------------------------

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the model for a weight update (waits for a running, unparked wave)."""
        with self._cond:
            self._updating += 1
            self._cond.wait_for(lambda: not self._running or self._parked)
        try:
            yield
        finally:
            with self._cond:
                self._updating -= 1
                self._cond.notify_all()

    def begin_weight_update(self) -> None:
        with self._cond:
            if self._update_session:
                raise EngineError("a weight update session is already open (call /end_weight_update)")
            self._update_session = True

    def end_weight_update(self) -> None:
        with self._cond:
            self._update_session = False
            if self._shm is not None and not os.path.exists(self._shm[0]):
                self._shm = None  # the sender unlinked it: let the pages go

    @property
    def in_update_session(self) -> bool:
        return self._update_session

    def check_names(self, names: Iterable[str], shapes: Optional[Iterable[list[int]]] = None) -> None:
        """Raise EngineError unless every name is a parameter (with that shape, if given)."""
        shapes = list(shapes) if shapes is not None else None
        for i, name in enumerate(names):
            param = self._params.get(name)
            if param is None:
                raise EngineError(f"unknown parameter name {name!r}")
            if shapes is not None and list(param.shape) != list(shapes[i]):
                raise EngineError(f"{name}: shape {list(shapes[i])} does not match the model's {list(param.shape)}")

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                     compute_checksums: bool = False) -> int:
        """Copy tensors into the parameters of the same HF name (cast to the engine dtype).

        Call inside ``exclusive()``. With ``compute_checksums`` the loaded parameters'
        checksums are computed in the background for a later ``checksums()``. Returns the
        number of tensors loaded, once the copies are complete (GPU sources included).
        """
        count = 0
        source_devices = set()
        for name, tensor in named_tensors:
            param = self._params.get(name)
            if param is None:
                raise EngineError(f"unknown parameter name {name!r}")
            if tuple(param.shape) != tuple(tensor.shape):
                raise EngineError(f"{name}: shape {list(tensor.shape)} does not match the model's {list(param.shape)}")
            pending = self._checksums.pop(name, None)
            if pending is not None:
                pending.result()  # never overwrite a parameter that is being checksummed
            param.copy_(tensor)
            if tensor.is_cuda:
                source_devices.add(tensor.device)
            if compute_checksums:
                self._checksums[name] = self._checksum_pool.submit(tensor_checksum, param)
            count += 1
        # A GPU copy is only queued: wait for it, because the sender of a CUDA IPC handle
        # reuses (overwrites) that memory as soon as this request is answered.
        for device in source_devices:
            torch.cuda.synchronize(device)
        return count

    def load_from_disk(self, model_path: str, *, compute_checksums: bool = False) -> int:
        """Load every ``*.safetensors`` file of a directory (call inside ``exclusive()``)."""
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise EngineError(f"no *.safetensors files in {model_path}")
        return sum(self.load_weights(load_file(str(f)).items(), compute_checksums=compute_checksums)
                   for f in files)

    def checksums(self, names: Optional[list[str]] = None) -> dict[str, dict[str, str]]:
        """``{name: {"dtype": "float32", "checksum": hex}}`` of the served parameters (the
        background results of the last load when it asked for them, computed now otherwise)."""
        names = list(self._params) if names is None else names
        self.check_names(names)
        with self.exclusive():
            out = {}
            for n in names:
                pending = self._checksums.get(n)
                value = pending.result() if pending is not None else tensor_checksum(self._params[n])
                out[n] = {"dtype": str(self._params[n].dtype).removeprefix("torch."), "checksum": value}
            return out

    def weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang /get_weights_by_name: the first ``truncate_size`` values along the last dim."""
        self.check_names([name])
        with self.exclusive():
            param = self._params[name]
            return param.detach().float()[..., :truncate_size].tolist()

    # ---- update groups (torch.distributed, separate from any default group) -----------

    @property
    def backends(self) -> tuple[str, ...]:
        """Process-group backends this engine can receive with: NCCL needs the model on a GPU."""
        return ("gloo", "nccl") if self.device.type == "cuda" else ("gloo",)

    def init_group(self, group_name: str, *, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, backend: str, timeout_s: float = 300.0) -> None:
        from megatron_grpo.wire.group import init_custom_process_group

        if backend not in self.backends:
            raise EngineError(f"backend {backend!r} is not supported by this engine on {self.device} "
                              f"({', '.join(self.backends)})")
        if group_name in self._groups:
            raise EngineError(f"weight update group {group_name!r} already exists")
        self._groups[group_name] = init_custom_process_group(
            backend=backend, master_address=master_address, master_port=master_port,
            world_size=world_size, rank=rank_offset, group_name=group_name, timeout_s=timeout_s,
        )

    def destroy_group(self, group_name: str) -> None:
        from megatron_grpo.wire.group import destroy_custom_process_group

        group = self._groups.pop(group_name, None)
        self._recv_buffers.pop(group_name, None)
        if group is None:
            raise EngineError(f"no weight update group {group_name!r}")
        destroy_custom_process_group(group)

    def receive_distributed(self, *, names: list[str], dtypes: list[str], shapes: list[list[int]],
                            group_name: str, load_format: Optional[str], compute_checksums: bool = False) -> int:
        """SGLang /update_weights_from_distributed: receive broadcasts from rank 0 and load.

        ``load_format == "flattened_bucket"``: ONE uint8 broadcast holding the tensors' bytes
        back to back (SGLang's FlattenedTensorBucket layout); otherwise one broadcast per tensor.
        """
        import torch.distributed as dist

        from megatron_grpo.runtime.device import collective_device

        group = self._groups.get(group_name)
        if group is None:
            raise EngineError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
        if load_format not in (None, "flattened_bucket"):
            raise EngineError(f"load_format {load_format!r} is not supported (null or 'flattened_bucket')")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise EngineError("names, dtypes and shapes must have the same length")
        torch_dtypes = [_parse_dtype(d) for d in dtypes]
        self.check_names(names, shapes)
        device = collective_device(group)  # the GPU for an NCCL group, the CPU for gloo
        if load_format == "flattened_bucket":
            nbytes = sum(_numel(s) * d.itemsize for s, d in zip(shapes, torch_dtypes))
            # One receive buffer per group, reused: fresh pages cost more than the copy. Safe
            # because the sender waits for this request's answer before the next bucket.
            buffer = self._recv_buffers.get(group_name)
            if buffer is None or buffer.numel() < nbytes:
                buffer = self._recv_buffers[group_name] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            flat = buffer[:nbytes]
            dist.broadcast(flat, src=0, group=group)
            tensors = unflatten(flat, names, torch_dtypes, shapes)
        else:
            tensors = []
            for name, dtype, shape in zip(names, torch_dtypes, shapes):
                t = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(t, src=0, group=group)
                tensors.append((name, t))
        with self.exclusive():
            return self.load_weights(tensors, compute_checksums=compute_checksums)


    def receive_shm(self, *, path: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                    compute_checksums: bool = False) -> int:
        """/update_weights_from_shm: load a flattened bucket from the sender's /dev/shm segment
        (``wire/shm.py``; same layout as a ``flattened_bucket`` broadcast). Returns the count."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise EngineError("names, dtypes and shapes must have the same length")
        torch_dtypes = [_parse_dtype(d) for d in dtypes]
        self.check_names(names, shapes)
        nbytes = sum(_numel(s) * d.itemsize for s, d in zip(shapes, torch_dtypes))
        if self._shm is None or self._shm[0] != path or self._shm[1].numel() < nbytes:
            self._shm = None
            try:
                _, mapped = open_segment(path, nbytes)
            except ValueError as e:
                raise EngineError(str(e)) from None
            self._shm = (path, mapped)
        tensors = unflatten(self._shm[1][:nbytes], names, torch_dtypes, shapes)
        with self.exclusive():
            return self.load_weights(tensors, compute_checksums=compute_checksums)


def engine_device(name: str) -> torch.device:
    """``--device``: auto -> the current CUDA device when CUDA is available, else the CPU;
    otherwise the named device (``cpu``, ``cuda``, ``cuda:1``)."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device {name!r} needs CUDA, which this machine does not have")
    return device


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise EngineError(f"unknown dtype {name!r}")
    return dtype
