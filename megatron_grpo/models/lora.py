"""LoRA adapters on megatron-core's tensor-parallel linears, sharded so no full weight is gathered.

Each adapted linear ``W`` (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``)
computes ``y = x W^T + scale * (x A^T) B^T`` with ``scale = alpha / rank``:

* column-parallel (``linear_qkv``, ``linear_fc1``): A ``[r, in]`` replicated over TP, B
  ``[out/tp, r]`` split like W's rows; ``x A^T`` passes ``copy_to_tensor_model_parallel_region``.
* row-parallel (``linear_proj``, ``linear_fc2``): A ``[r, in/tp]`` split like W's columns, B
  ``[out, r]`` replicated; ``x_tp A_tp^T`` is summed by ``reduce_from_tensor_model_parallel_region``.

So no gradient needs an extra reduction, and a TP shard's merged weight is its own
``W_tp + scale * B_tp A`` (column) or ``W_tp + scale * B A_tp`` (row): the weight sync and the HF
export merge shard by shard, in fp32, from the frozen base (never in place), then gather.
The adapters of a chunk live in one ``LoraAdapters`` module (``chunk.lora_adapters``), keyed by
global layer index and target and applied by a forward hook on the linear: the base parameters
keep their names, and the adapters' checkpoint keys reshard over PP.

Departures from the LoRA paper / peft: on a fused megatron linear one A serves the fused outputs
(q, k, v share A; gate and up share A) where peft has one A per HF module; the export writes that
A for each (exact). A is drawn in full (peft's bound ``1/sqrt(in)``) from a generator seeded by
layer and target, then sliced: the same adapters at every TP/PP. Dropout (``model.lora.dropout``,
default 0, refused at tp > 1) acts only in the update's forward, not the log-prob passes, so it
perturbs the importance ratio like any dropout. Sharding and merging: docs/lora.md.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from megatron_grpo.config.model import LoraConfig
from megatron_grpo.models.architectures import get_architecture
from megatron_grpo.models.architectures.moe import MoEMLP
from megatron_grpo.models.errors import ModelError
from megatron_grpo.ops.lora_merge import merge_fp32

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron-core's names of the linears LoRA adapts (``all-linear``: all four)."""
COLUMN_PARALLEL = frozenset({"linear_qkv", "linear_fc1"})
HF_TARGETS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""The HF (peft ``target_modules``) names of each megatron target, in the fused layout's order."""
_PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention",
           "linear_fc1": "mlp", "linear_fc2": "mlp"}
MODULE_NAME = "lora_adapters"
"""Attribute (and state-dict prefix) of a chunk's ``LoraAdapters``."""


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt and how: ``model.lora`` resolved (targets expanded from ``all-linear``)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    init_seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def hf_target_modules(self) -> list[str]:
        return [name for t in self.targets for name in HF_TARGETS[t]]


def resolve_targets(target_modules: list[str]) -> tuple[str, ...]:
    """``model.lora.target_modules`` -> megatron target names in ``TARGETS`` order."""
    if "all-linear" in target_modules:
        return TARGETS
    return tuple(t for t in TARGETS if t in target_modules)


def spec_from_config(lora_cfg: LoraConfig) -> LoraSpec:
    return LoraSpec(rank=lora_cfg.rank, alpha=lora_cfg.alpha, dropout=lora_cfg.dropout,
                    targets=resolve_targets(lora_cfg.target_modules), init_seed=lora_cfg.init_seed)


def lora_problem(spec: LoraSpec, hf_config, *, tp: int, attention_backend: str,
                 sequence_parallel: bool) -> Optional[tuple[str, str]]:
    """(config key, message) of the first reason this model and layout cannot train ``spec``'s
    adapters, or None. ``attention_backend``: the resolved one (``te``, ``sdpa``, ``unfused``)."""
    experts = [t for t in spec.targets if t in ("linear_fc1", "linear_fc2")]
    if isinstance(get_architecture(hf_config.model_type), MoEMLP) and experts:
        return ("model.lora.target_modules",
                f"{', '.join(experts)} of {hf_config.model_type!r} are mixture-of-experts experts, which LoRA "
                "does not adapt here; use linear_qkv and/or linear_proj")
    if attention_backend == "te":
        return ("model.lora", "needs megatron-core's local layer spec (TransformerEngine fuses the norm into "
                "linear_qkv and linear_fc1, so the adapter would see the un-normalised input); set "
                "model.attention_backend: sdpa")
    if sequence_parallel:
        return ("model.lora", "cannot be combined with parallel.sequence_parallel yet (set it false)")
    if spec.dropout > 0 and tp > 1:
        return ("model.lora.dropout", f"{spec.dropout} needs tp=1 (a replicated adapter input would get a different "
                f"dropout mask on each of the {tp} tensor-parallel ranks); set it to 0")
    return None


class LoraAdapter(nn.Module):
    """A and B of one parallel linear (this TP rank's shards).

    ``kind``: "column" (A ``[r, in]`` replicated, B ``[out/tp, r]`` split) or "row" (A
    ``[r, in/tp]`` split, B ``[out, r]`` replicated). B starts at zero, so the adapted model
    starts as the base model exactly.
    """

    def __init__(self, kind: str, lora_a: torch.Tensor, out_features: int, spec: LoraSpec):
        super().__init__()
        self.kind = kind
        self.scale = spec.scale
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.lora_A = nn.Parameter(lora_a)
        self.lora_B = nn.Parameter(torch.zeros(out_features, spec.rank, dtype=lora_a.dtype, device=lora_a.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[s, b, in or in/tp]`` (the linear's input) -> the adapter's output ``[s, b, out/tp or out]``."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        h = torch.matmul(self.dropout(x), self.lora_A.t())  # [s, b, r]
        if self.kind == "column":
            h = copy_to_tensor_model_parallel_region(h)  # backward: sum of dL/dh over the B shards
        else:
            h = reduce_from_tensor_model_parallel_region(h)  # forward: sum of the A shards' parts
        return torch.matmul(h, self.lora_B.t()) * self.scale

    @torch.no_grad()
    def merged(self, base: torch.Tensor, value: Callable = lambda p: p) -> torch.Tensor:
        """``base + scale * B @ A`` in fp32 for this shard (``base``: the frozen weight shard;
        ``value``: a parameter -> the tensor holding its true value, e.g. its fp32 main copy)."""
        return merge_fp32(base.detach(), value(self.lora_A).detach(), value(self.lora_B).detach(), self.scale)


def _hook(adapter: LoraAdapter):
    def add_adapter(module, args, output):
        out, bias = output  # megatron's parallel linears return (output, bias-or-None)
        return out + adapter(args[0]).to(out.dtype), bias
    return add_adapter


def adapter_key(layer_index: int, target: str) -> str:
    """Key of an adapter in ``LoraAdapters``: global 0-based layer index and target."""
    return f"layer{layer_index}_{target}"


class LoraAdapters(nn.ModuleDict):
    """A chunk's adapters, keyed by ``adapter_key``; its ``sharded_state_dict`` names every
    tensor by its global key with the TP split axis, so adapter checkpoints reshard over
    TP/PP (megatron-core's default would save a TP-split B as if it were replicated)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

        out = {}
        for key, adapter in self.items():
            split = ("lora_B", 0) if adapter.kind == "column" else ("lora_A", 1)
            for name in ("lora_A", "lora_B"):
                tensor, full_key = getattr(adapter, name), f"{prefix}{key}.{name}"
                if name == split[0]:
                    out[full_key] = make_tp_sharded_tensor_for_checkpoint(tensor, full_key, tp_axis=split[1])
                else:
                    out[full_key] = make_sharded_tensor_for_checkpoint(tensor, full_key)
        return out


def _init_a(spec: LoraSpec, key: str, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The full ``[r, in]`` A of adapter ``key``: uniform in ±1/sqrt(in) (peft's kaiming-uniform
    with a = sqrt(5)), from a generator seeded by ``init_seed`` and the key alone."""
    gen = torch.Generator().manual_seed(spec.init_seed * 1_000_003 + zlib.crc32(key.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(spec.rank, in_features, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).to(dtype)


def apply_lora(chunks: list, spec: LoraSpec, base: Optional[dict] = None) -> None:
    """Freeze every base parameter of ``chunks`` and add ``spec``'s adapters (trainable) to
    their linears. Call after the base weights are loaded and before DDP wraps the chunks
    (DDP and the optimizer then hold state for the adapters only). ``base``: where the base
    weights came from (``{"hf_dir": ..., "megatron_ckpt": ...}``), recorded in checkpoints."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for chunk in chunks:
        chunk.requires_grad_(False)
        adapters = LoraAdapters()
        for layer in chunk.decoder.layers:
            index = layer.layer_number - 1  # global (megatron's layer_number is 1-based)
            for target in spec.targets:
                linear = getattr(getattr(layer, _PARENT[target]), target, None)
                if linear is None:
                    raise ModelError(f"model.lora.target_modules: layer {index} has no {_PARENT[target]}.{target} "
                                     f"(accepted: {', '.join(TARGETS)} on a dense model)")
                key = adapter_key(index, target)
                weight = linear.weight  # [out/tp, in] (column) or [out, in/tp] (row)
                kind = "column" if target in COLUMN_PARALLEL else "row"
                in_full = weight.shape[1] * (tp if kind == "row" else 1)
                lora_a = _init_a(spec, key, in_full, weight.dtype)
                if kind == "row":
                    lora_a = lora_a.chunk(tp, dim=1)[tp_rank].contiguous()
                adapter = LoraAdapter(kind, lora_a.to(weight.device), weight.shape[0], spec)
                split_param, dim = (adapter.lora_B, 0) if kind == "column" else (adapter.lora_A, 1)
                set_tensor_model_parallel_attributes(split_param, is_parallel=True, dim=dim, stride=1)
                adapters[key] = adapter
                weight.lora_adapter = adapter  # read by the weight sync / export (merged_source)
                linear.register_forward_hook(_hook(adapter))
        if chunk.pre_process and chunk.config.recompute_granularity is not None:
            # megatron's recomputation (an autograd Function over the layers' input) runs no
            # backward when that input needs no gradient, which a frozen embedding's output
            # does not: the adapters would silently get none (peft's enable_input_require_grads)
            chunk.embedding.register_forward_hook(lambda module, args, output: output.requires_grad_(True))
        chunk.lora_adapters = adapters
        chunk.lora_spec = spec
        chunk.lora_base = base


def lora_metadata(chunks: list) -> Optional[dict]:
    """What a checkpoint of LoRA ``chunks`` records about them (None without adapters): the
    spec and the base they adapt (``chunk.lora_base``: ``{"hf_dir": ..., "megatron_ckpt": ...}``)."""
    if not has_lora(chunks):
        return None
    spec = chunks[0].lora_spec
    return {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout, "targets": list(spec.targets),
            "init_seed": spec.init_seed, "base": dict(getattr(chunks[0], "lora_base", None) or {})}


def spec_from_metadata(meta: dict) -> LoraSpec:
    return LoraSpec(rank=meta["rank"], alpha=meta["alpha"], dropout=meta["dropout"], targets=tuple(meta["targets"]),
                    init_seed=meta["init_seed"])


def has_lora(chunks: list) -> bool:
    return any(getattr(c, "lora_spec", None) is not None for c in chunks)


def merged_source(param, value: Callable) -> Optional[torch.Tensor]:
    """The merged fp32 weight of an adapted base parameter (``LoraAdapter.merged``), None for
    any other parameter."""
    adapter = getattr(param, "lora_adapter", None)
    return None if adapter is None else adapter.merged(param, value)


def iter_adapters(chunks: list) -> Iterator[tuple[str, LoraAdapter]]:
    for chunk in chunks:
        yield from getattr(chunk, MODULE_NAME, LoraAdapters()).items()


def lora_sharded_state_dict(chunks: list) -> dict:
    """The adapters' sharded state, keyed like ``model_sharded_state_dict`` (``model`` or
    ``model{i}``), without any base weight."""
    def one(chunk):
        return getattr(chunk, MODULE_NAME).sharded_state_dict(prefix=f"{MODULE_NAME}.")
    if len(chunks) == 1:
        return {"model": one(chunks[0])}
    return {f"model{i}": one(c) for i, c in enumerate(chunks)}


def load_lora_state(chunks: list, loaded: dict) -> None:
    """Copy the adapters of ``loaded`` (``dist_checkpointing.load`` of ``lora_sharded_state_dict``)
    into ``chunks``."""
    for key, chunk in zip(lora_sharded_state_dict(chunks), chunks):
        state = {k.removeprefix(f"{MODULE_NAME}."): v for k, v in loaded[key].items()}
        getattr(chunk, MODULE_NAME).load_state_dict(state, strict=True)


def trainable_parameters(chunks: list) -> tuple[int, int]:
    """(trainable, total) parameter counts of this rank's chunks."""
    params = [p for c in chunks for p in c.parameters()]
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
