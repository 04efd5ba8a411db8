"""How a packed bucket reaches the engine(s): one class per ``sync.transport``.

Every transport runs on a SENDING rank (one per pipeline stage) and pushes a ``Bucket`` to
every engine URL; ``send`` returns once each engine has loaded it (so buffers can be reused).

* ``distributed``: a process group between this rank (rank 0) and the engines' ranks (SGLang's
  ``/init_weights_update_group``), created on the first sync; per bucket, one
  ``/update_weights_from_distributed`` request (``load_format: flattened_bucket``) per engine
  and ONE uint8 broadcast, inside the begin/end bracket (SGLang 0.5.23 requires it). The
  backend is the one the engine's adapter resolves (gloo, or NCCL where the engine accepts it).
* ``tensor``: colocated engines; the bucket is packed into a buffer on the sender's device and
  each engine opens it by handle, inside the begin/end bracket, in the wire its adapter names
  (``TENSOR_WIRES``): SGLang's ``/update_weights_from_tensor`` (``wire/serialize.py``: a CUDA
  IPC handle on a GPU, zero copy; a torch shared-memory file per bucket on the CPU), or, for
  the embedded engine on the CPU, ONE reused ``/dev/shm`` segment holding the flattened
  bucket plus names/dtypes/shapes over HTTP (``/update_weights_from_shm``, ``wire/shm.py``).
* ``disk``: each bucket becomes a safetensors file in a per-sync directory written under a
  temporary name and renamed when complete; ``/update_weights_from_disk`` loads the directory.

A bucket's own request keys (``Bucket.extras``: a LoRA policy's ``lora``/``lora_base``,
``sync/lora_sync.py``) join the sync's in each of its requests; the disk transport, which sends
one request per directory, writes them into the bucket's file metadata instead.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Optional

import torch

from megatron_grpo.wire.samples import RolloutError
from megatron_grpo.runtime.device import collective_device, compute_device
from megatron_grpo.runtime.errors import one_line
from megatron_grpo.wire.buckets import DISK_UPDATE_KEY, Bucket, unflatten
from megatron_grpo.wire.group import bind_group_store, destroy_custom_process_group, init_custom_process_group
from megatron_grpo.wire.serialize import serialize_named_tensors, use_file_system_sharing
from megatron_grpo.wire.shm import ShmSegment, remove_stale_segments


class Transport:
    """Base: per-sync ``begin``/``end`` hooks around ``send`` of each bucket of this stage."""

    needs_update_session = False
    """True: the coordinator wraps the sync in /begin_weight_update ... /end_weight_update."""

    request_extras: dict = {}
    """Extra keys for the engines' update requests (set by the syncer per sync)."""

    def __init__(self, client, *, stage: int, bucket_bytes: int, timeout_s: float,
                 master_address: str = "127.0.0.1", work_dir: Optional[Path] = None, hf_config=None,
                 backend: str = "gloo", tensor_wire: str = "named_tensors"):
        self.client = client
        self.backend = backend
        self.tensor_wire = tensor_wire
        self.urls = list(client.urls)
        self.stage = stage
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.master_address = master_address
        self.work_dir = work_dir
        self.hf_config = hf_config

    def begin(self, step: int) -> None:
        pass

    def send(self, bucket: Bucket, overlap: Optional[Callable[[], None]] = None) -> None:
        """Deliver ``bucket`` to every engine; ``overlap`` (if given) runs once while the
        bucket is in flight (the syncer computes the bucket's checksums there)."""
        raise NotImplementedError

    def end(self, step: int) -> None:
        pass

    def reset(self) -> None:
        """Forget per-engine state (an engine restarted)."""

    def close(self) -> None:
        self.reset()

    def engine_tp_sizes(self) -> list[int]:
        """TP size of each engine (ranks it contributes to a group, payload copies it needs)."""
        if getattr(self, "_tp_sizes", None) is None:
            self._tp_sizes = [int(self.client.server_info(u).get("tp_size", 1)) for u in self.urls]
        return self._tp_sizes

    def _wait_all(self, futures: list[Future]) -> None:
        for f in futures:
            f.result(timeout=self.timeout_s)


class DistributedTransport(Transport):
    """Broadcast over a process group shared with the engines (see the module docstring)."""

    needs_update_session = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = None
        # Unique per transport: torch (in this process) and the engine both refuse a name twice.
        self.group_name = f"megatron_grpo_stage{self.stage}_{uuid.uuid4().hex[:8]}"
        self._buffer: Optional[torch.Tensor] = None

    def _init_group(self) -> None:
        backend = self.backend
        tp_sizes = self.engine_tp_sizes()
        world_size = 1 + sum(tp_sizes)
        # bound first, then handed to the engines: nothing can take the port in between
        listen = bind_group_store(self.master_address)
        port = listen.getsockname()[1]
        futures, offset = [], 1
        for url, tp in zip(self.urls, tp_sizes):
            futures.append(self.client.submit(self.client.aio.init_weights_update_group(
                url, master_address=self.master_address, master_port=port, rank_offset=offset,
                world_size=world_size, group_name=self.group_name, backend=backend)))
            offset += tp
        self.group = init_custom_process_group(backend=backend, master_address=self.master_address,
                                               master_port=port, world_size=world_size, rank=0,
                                               group_name=self.group_name, timeout_s=self.timeout_s,
                                               listen_socket=listen)
        self._wait_all(futures)

    def begin(self, step: int) -> None:
        if self.group is None:
            self._init_group()

    def send(self, bucket: Bucket, overlap: Optional[Callable[[], None]] = None) -> None:
        if self._buffer is None or self._buffer.numel() < bucket.nbytes:
            # where the group's backend reads from: the GPU for NCCL, the CPU for gloo
            self._buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=collective_device(self.group))
        flat = bucket.pack(out=self._buffer)
        futures = [self.client.submit(self.client.aio.update_weights_from_distributed(
            url, names=bucket.names, dtypes=[bucket.dtype_name] * len(bucket.names), shapes=bucket.shapes,
            group_name=self.group_name, load_format="flattened_bucket", extra={**self.request_extras, **bucket.extras}))
            for url in self.urls]
        try:
            self._broadcast(flat, futures, overlap)
        except RolloutError:
            self.reset()
            raise
        except Exception as e:  # noqa: BLE001 - gloo/NCCL errors: name the engines
            self.reset()
            raise RolloutError(",".join(self.urls), "broadcast (weight update group)",
                               one_line(e, None)) from None
        self._wait_all(futures)

    def _broadcast(self, flat: torch.Tensor, futures: list[Future], overlap: Optional[Callable[[], None]]) -> None:
        import torch.distributed as dist

        work = dist.broadcast(flat, src=0, group=self.group, async_op=True)
        if overlap is not None:
            overlap()
        # An engine that rejects the request never joins the broadcast: watch the HTTP
        # answers while waiting, so a refusal is an error now, not a hang until timeout.
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:
                raise failed[0].exception()
            if time.monotonic() > deadline:
                raise RolloutError(",".join(self.urls), "broadcast (weight update group)",
                                   f"bucket not received within {self.timeout_s:.0f}s")
            time.sleep(0.0005)
        work.wait()

    def reset(self) -> None:
        self._tp_sizes = None
        group, self.group = self.group, None
        if group is not None:
            for url in self.urls:  # best effort: the engine may be the one that died
                try:
                    self.client.call("destroy_weights_update_group", {"group_name": self.group_name},
                                     url=url, timeout_s=10, retry=False)
                except RolloutError:
                    pass
            try:
                destroy_custom_process_group(group)
            except Exception:  # noqa: BLE001 - a broken group cannot always be torn down cleanly
                pass


def tensor_bucket_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """The tensor transport's bucket buffer: on a GPU, plain device memory whose CUDA IPC
    handle the engine opens (no copy through the host); on the CPU, shared memory the engine
    maps."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer if device.type == "cuda" else buffer.share_memory_()


class NamedTensorsWire:
    """SGLang's ``/update_weights_from_tensor``: the packed bucket's views, pickled by handle."""

    def __init__(self):
        use_file_system_sharing()
        self._buffer: Optional[torch.Tensor] = None

    def buffer(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = tensor_bucket_buffer(nbytes, compute_device())
        return self._buffer

    def submit(self, transport: "TensorTransport", flat: torch.Tensor, bucket: Bucket) -> list[Future]:
        named = unflatten(flat, bucket.names, [bucket.dtype] * len(bucket.names), bucket.shapes)
        payload = serialize_named_tensors(named)
        client = transport.client
        extra = {**transport.request_extras, **bucket.extras}
        return [client.submit(client.aio.update_weights_from_tensor(url, [payload] * tp, extra=extra))
                for url, tp in zip(transport.urls, transport.engine_tp_sizes())]

    def release(self) -> None:
        self._buffer = None


class ShmBucketWire:
    """The embedded engine's CPU wire (``wire/shm.py``): one reused /dev/shm segment."""

    def __init__(self):
        remove_stale_segments()  # left by trainers killed with SIGKILL
        self._segment: Optional[ShmSegment] = None

    def buffer(self, nbytes: int) -> torch.Tensor:
        if self._segment is None or self._segment.nbytes < nbytes:
            self.release()
            self._segment = ShmSegment(nbytes)
        return self._segment.tensor

    def submit(self, transport: "TensorTransport", flat: torch.Tensor, bucket: Bucket) -> list[Future]:
        client = transport.client
        return [client.submit(client.aio.update_weights_from_shm(
            url, path=self._segment.path, names=bucket.names, dtypes=[bucket.dtype_name] * len(bucket.names),
            shapes=bucket.shapes, extra={**transport.request_extras, **bucket.extras})) for url in transport.urls]

    def release(self) -> None:
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.close()


# EngineAdapter.tensor_wire(...) -> how the tensor transport hands a packed bucket over
TENSOR_WIRES: dict[str, type] = {
    "named_tensors": NamedTensorsWire,
    "shm_bucket": ShmBucketWire,
}


class TensorTransport(Transport):
    """Buckets passed by handle to colocated engines (see the module docstring)."""

    needs_update_session = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.wire = TENSOR_WIRES[self.tensor_wire]()

    def send(self, bucket: Bucket, overlap: Optional[Callable[[], None]] = None) -> None:
        # The buffer grows to the largest bucket and is reused: each send waits for the
        # engines, so the previous bucket is no longer needed (nor its handle open).
        try:
            flat = bucket.pack(out=self.wire.buffer(bucket.nbytes))
            futures = self.wire.submit(self, flat, bucket)
            if overlap is not None:
                overlap()
            self._wait_all(futures)
        except BaseException:
            self.wire.release()  # a failed send (a dead engine) leaves no segment behind
            raise

    def reset(self) -> None:
        self.wire.release()
        self._tp_sizes = None


class DiskTransport(Transport):
    """safetensors files + /update_weights_from_disk (see the module docstring)."""

    def begin(self, step: int) -> None:
        from safetensors.torch import save_file  # noqa: F401 - fail early if missing

        assert self.work_dir is not None, "the disk transport needs a work_dir"
        self._final = Path(self.work_dir) / f"step{step}_stage{self.stage}"
        self._tmp = self._final.with_name(self._final.name + ".tmp")
        for d in (self._tmp, self._final):
            shutil.rmtree(d, ignore_errors=True)
        self._tmp.mkdir(parents=True)
        self._num_files = 0

    def send(self, bucket: Bucket, overlap: Optional[Callable[[], None]] = None) -> None:
        from safetensors.torch import save_file

        path = self._tmp / f"bucket_{self._num_files:05d}.safetensors"  # loaded in name order: as sent
        # a bucket's own request keys travel in its file (the engine reads them per file)
        metadata = {DISK_UPDATE_KEY: json.dumps(bucket.extras)} if bucket.extras else None
        save_file({n: t.contiguous() for n, t in zip(bucket.names, bucket.tensors)}, str(path), metadata=metadata)
        self._num_files += 1
        if overlap is not None:  # nothing is in flight yet: the engine loads in end()
            overlap()

    def end(self, step: int) -> None:
        if self.hf_config is not None:  # SGLang's loader reads the directory like a checkpoint
            (self._tmp / "config.json").write_text(json.dumps(self.hf_config.to_dict()))
        os.replace(self._tmp, self._final)  # the engine only ever sees a complete directory
        try:
            self._wait_all([self.client.submit(self.client.aio.update_weights_from_disk(
                url, str(self._final), extra=self.request_extras)) for url in self.urls])
        finally:
            shutil.rmtree(self._final, ignore_errors=True)


# sync.transport -> transport class
TRANSPORTS: dict[str, type[Transport]] = {
    "distributed": DistributedTransport,
    "tensor": TensorTransport,
    "disk": DiskTransport,
}
