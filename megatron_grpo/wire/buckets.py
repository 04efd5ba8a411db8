"""Byte buckets of named tensors: SGLang's ``FlattenedTensorBucket`` layout.

A bucket is ONE contiguous uint8 tensor holding its tensors' bytes back to back (no padding)
plus, per tensor, its name, dtype and shape. Buckets hold a single dtype each, so every
tensor starts at a multiple of its element size and the receiver can view the bytes in place.
``plan_buckets`` groups a stream of tensors into buckets of at most ``bucket_bytes`` (a
larger tensor gets a bucket of its own: an engine cannot receive half a tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch

DISK_UPDATE_KEY = "megatron_grpo_update"
"""Metadata key of a bucket's safetensors file (the disk transport) holding the JSON of the
bucket's ``extras``: the keys its request would carry over the other wires."""


@dataclass
class Bucket:
    """Named tensors packed (or to be packed) into one uint8 buffer."""

    dtype: torch.dtype
    names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    extras: dict = field(default_factory=dict)
    """Keys this bucket's weight-update request carries besides the sync's own (the embedded
    engine's ``lora``/``lora_base``, ``inference/lora_update.py``)."""

    def add(self, name: str, tensor: torch.Tensor) -> None:
        assert tensor.dtype == self.dtype, (name, tensor.dtype, self.dtype)
        self.names.append(name)
        self.shapes.append(list(tensor.shape))
        self.tensors.append(tensor)
        self.nbytes += tensor.numel() * tensor.element_size()

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def pack(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The bucket's bytes as one uint8 tensor [nbytes] (written into ``out[:nbytes]`` if given)."""
        flat = out[: self.nbytes] if out is not None else torch.empty(self.nbytes, dtype=torch.uint8)
        offset = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            flat[offset: offset + n].view(t.dtype).view(t.shape).copy_(t)
            offset += n
        return flat


def plan_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group tensors into single-dtype buckets of at most ``bucket_bytes`` (streaming).

    Tensors keep their order within a dtype; a bucket is yielded as soon as it is full, so
    at most one bucket per dtype is held in memory.
    """
    open_buckets: dict[torch.dtype, Bucket] = {}
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        bucket = open_buckets.get(tensor.dtype)
        if bucket is not None and bucket.names and bucket.nbytes + nbytes > bucket_bytes:
            yield open_buckets.pop(tensor.dtype)
            bucket = None
        if bucket is None:
            bucket = open_buckets[tensor.dtype] = Bucket(dtype=tensor.dtype)
        bucket.add(name, tensor)
    yield from (b for b in open_buckets.values() if b.names)


def unflatten(flat: torch.Tensor, names: list[str], dtypes: list[torch.dtype],
              shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
    """Views of a received uint8 bucket as the named tensors (copies only misaligned ones)."""
    out = []
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        numel = 1
        for d in shape:
            numel *= int(d)
        n = numel * dtype.itemsize
        piece = flat[offset: offset + n]
        if piece.storage_offset() % dtype.itemsize:
            piece = piece.clone()  # a mixed-dtype bucket from another sender: realign
        out.append((name, piece.view(dtype).view(shape)))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"bucket holds {flat.numel()} bytes but its tensors need {offset}")
    return out
