"""What the adapter-only weight sync of a LoRA policy sends to an engine that merges on its side
(the embedded engine over HTTP: ``EngineAdapter.merges_lora``), and the checksums it verifies.

``ServerDelivery`` (``servers.py``) sends it in place of the merged weights when the policy has
adapters (``models/lora.py``); the request keys are the engine's (``inference/lora_update.py``):

1. the first sync after the sync starts (a run's start or resume) or after ``reset`` (an engine
   restarted, or a sync failed) sends every weight, each adapted one as its frozen base in the
   trainer's own dtype (the engine keeps it in fp32 as sent), named in its bucket's ``lora_base``
   key (``base_stream``, ``mark_base``);
2. every sync then sends the adapters: per megatron adapter one A ``[r, in]`` (shared by a fused
   linear's modules) and one B ``[out, r]`` per HF module, fp32, gathered over TP
   (``lora_export.iter_adapter_units``), in buckets whose ``lora`` key maps each module to its A
   and B (``adapter_buckets``); an adapter never straddles two buckets;
3. on a verified sync the trainer computes what the engine must now serve (``merge_fp32`` of the
   base, A and B, cast once to the engine's dtype: the engine's own operations) and compares
   checksums (``reference_checksums``). A merge on another kind of device than the engine's
   rounds differently and fails this check; the log-prob probe, which also runs, does not mind.

Departure from the merged sync: the verified syncs gather the adapted base weights over TP
again (nothing is kept between syncs) to compute the reference; the bytes sent stay the
adapters'. More: docs/lora.md#what-each-engine-receives.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

import torch

from megatron_grpo.models.lora_export import AdapterUnit
from megatron_grpo.ops.lora_merge import merge_fp32
from megatron_grpo.wire.buckets import Bucket
from megatron_grpo.wire.checksum import tensor_checksum


def base_stream(weights: Iterable[tuple[str, torch.Tensor]], adapted: frozenset[str],
                dtype: Optional[torch.dtype]) -> Iterator[tuple[str, torch.Tensor]]:
    """The first sync's tensors: each cast to the engine's ``dtype`` (None: as they are), except
    the adapted weights' bases, sent in their own dtype."""
    for name, tensor in weights:
        if name not in adapted and dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        yield name, tensor


def mark_base(bucket: Bucket, adapted: frozenset[str]) -> list[str]:
    """Name ``bucket``'s adapted bases in its ``lora_base`` key; returns the other names (the
    tensors the engine serves as sent, which the sync verifies as sent)."""
    bases = [n for n in bucket.names if n in adapted]
    if bases:
        bucket.extras = {"lora_base": bases}
    return [n for n in bucket.names if n not in adapted]


def adapter_tensors(unit: AdapterUnit) -> tuple[list[tuple[str, torch.Tensor]], list[list[str]]]:
    """``unit``'s tensors to send, named ``<HF weight>.lora_A`` / ``.lora_B`` (a shared A once,
    under its first module), and its ``lora.modules`` entries ``[HF weight, A name, B name]``."""
    named, modules, a_names = [], [], {}
    for hf_name, a, b in zip(unit.hf_names, unit.a, unit.b):
        a_name = a_names.get(id(a))
        if a_name is None:
            a_name = a_names[id(a)] = f"{hf_name}.lora_A"
            named.append((a_name, a))
        named.append((f"{hf_name}.lora_B", b))
        modules.append([hf_name, a_name, f"{hf_name}.lora_B"])
    return named, modules


def adapter_buckets(units: Iterable[AdapterUnit], bucket_bytes: int,
                    scale: float) -> Iterator[tuple[Bucket, list[AdapterUnit]]]:
    """fp32 buckets of whole adapters (at most ``bucket_bytes`` unless one adapter is larger),
    each with its ``lora`` key, and the units it holds (for the reference checksums)."""
    bucket, held, modules = Bucket(dtype=torch.float32), [], []
    for unit in units:
        named, unit_modules = adapter_tensors(unit)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        if bucket.names and bucket.nbytes + nbytes > bucket_bytes:
            bucket.extras = {"lora": {"scale": scale, "modules": modules}}
            yield bucket, held
            bucket, held, modules = Bucket(dtype=torch.float32), [], []
        for name, tensor in named:
            bucket.add(name, tensor.float())
        held.append(unit)
        modules.extend(unit_modules)
    if bucket.names:
        bucket.extras = {"lora": {"scale": scale, "modules": modules}}
        yield bucket, held


def reference_checksums(units: Iterable[AdapterUnit], scale: float, dtype: Optional[torch.dtype]) -> dict[str, str]:
    """{HF weight: checksum} of what the engine serves after merging ``units`` (gathered with
    their bases): ``merge_fp32(base, A, B, scale)`` cast to the engine's ``dtype`` (None: the
    base's)."""
    out = {}
    for unit in units:
        assert unit.bases is not None, "reference_checksums needs the units' bases (with_base=True)"
        for name, a, b, base in zip(unit.hf_names, unit.a, unit.b, unit.bases):
            out[name] = tensor_checksum(merge_fp32(base, a, b, scale).to(dtype or base.dtype))
    return out
