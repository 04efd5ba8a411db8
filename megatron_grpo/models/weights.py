"""HF weights in and out of Megatron chunks: the single source of truth for the mapping.

``load_hf_weights``: each rank reads, from the HF safetensors, only the tensors of its PP
stage and copies its TP shard. ``iter_hf_weights``: the reverse, gathered over TP: full
HF-named, HF-layout tensors, used by the HF exporter AND the trainer -> rollout weight sync.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_grpo.models.architectures import TE_ALIASES, ParamMapping, get_architecture
from megatron_grpo.models.architectures.moe import MoEMLP
from megatron_grpo.models.errors import ModelError
from megatron_grpo.models.lora import MODULE_NAME as LORA_MODULE
from megatron_grpo.models.lora import merged_source


class SafetensorsReader:
    """Lazy, by-name access to the tensors of a HF directory (single file or sharded index)."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), "pt") as f:
                self.weight_map = {k: single.name for k in f.keys()}
        else:
            raise ModelError(f"{self.dir}: no model.safetensors nor model.safetensors.index.json")
        self._open: dict[str, object] = {}

    def get(self, name: str) -> torch.Tensor:
        file = self.weight_map.get(name)
        if file is None:
            raise ModelError(f"{self.dir}: tensor {name} is missing from the safetensors files")
        if file not in self._open:
            from safetensors import safe_open

            path = self.dir / file
            if not path.is_file():
                raise ModelError(f"{path}: not found (listed in model.safetensors.index.json)")
            self._open[file] = safe_open(str(path), "pt")
        return self._open[file].get_tensor(name)


def resolve_params(chunk, mappings: list[ParamMapping]) -> list[tuple[ParamMapping, torch.nn.Parameter]]:
    """Pair every mapping with the chunk's parameter (local or TE spec name), checking that
    the mapping covers every parameter of the chunk exactly once."""
    # LoRA adapters (models.lora) are not HF weights: they are merged into their base weight
    params = {n: p for n, p in chunk.named_parameters() if not n.startswith(f"{LORA_MODULE}.")}
    pairs, used = [], set()
    for m in mappings:
        name = m.megatron_name
        if name not in params:
            for local, te in TE_ALIASES.items():
                if name.endswith(local):
                    name = name[: -len(local)] + te
        if name not in params:
            raise ModelError(f"architecture mapping names {m.megatron_name}, which the model lacks")
        used.add(name)
        pairs.append((m, params[name]))
    unmapped = sorted(set(params) - used)
    if unmapped:
        raise ModelError(f"model parameters without an HF mapping: {', '.join(unmapped)}")
    return pairs


def chunk_params(chunk, hf_config) -> list[tuple[ParamMapping, torch.nn.Parameter]]:
    arch = get_architecture(hf_config.model_type)
    return resolve_params(chunk, arch.chunk_mappings(chunk, hf_config))


@torch.no_grad()
def load_hf_weights(model_chunks: list, hf_dir: str | Path, hf_config, *,
                    progress: bool = False) -> None:
    """Copy HF weights into this rank's chunks (this PP stage's tensors, this TP rank's shard).

    ModelError naming the tensor on a missing tensor or a shape mismatch.
    """
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    # experts are split over the expert-tensor-parallel group (etp, megatron's default: tp)
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    reader = SafetensorsReader(hf_dir)
    pairs = [p for chunk in model_chunks for p in chunk_params(chunk, hf_config)]
    if progress:
        from tqdm import tqdm

        pairs = tqdm(pairs, desc="load HF", unit="param")
    for m, param in pairs:
        hf = [reader.get(n) for n in m.hf_names]
        rank, size = (etp_rank, etp) if m.is_expert else (tp_rank, tp)
        try:
            shard = m.layout.to_shard(hf, rank, size)
        except ValueError as e:
            raise ModelError(_shape_error(m, hf, param, str(e))) from None
        if shard.shape != param.shape:
            what = "etp" if m.is_expert else "tp"
            raise ModelError(_shape_error(m, hf, param, f"{what}={size} shard is {list(shard.shape)}"))
        param.copy_(shard)


def _shape_error(m: ParamMapping, hf: list[torch.Tensor], param, detail: str) -> str:
    shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in zip(m.hf_names, hf))
    return (f"shape mismatch: {shapes} -> {m.megatron_name} expects shard {list(param.shape)} "
            f"({detail}); does config.json match the weights?")


@torch.no_grad()
def iter_hf_weights(model_chunks: list, hf_config, *, merge_lora: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full HF-layout tensor) for every parameter of this PP stage: first the
    non-expert tensors of all chunks, then the experts (MoE models).

    Collective over the TP group of this stage and, for experts, over the expert-tensor-
    parallel and expert-parallel groups: every such rank must iterate to the end in step
    (the ranks with ``exports_weights()``), and every one receives the full tensors
    (gathered over TP, vocab padding removed, fused QKV / gate-up split back; each expert
    slot gathered over EP, so every EP rank yields all experts). Each tensor is the
    parameter's fp32 *main* copy where megatron-core's mixed-precision optimizer keeps one
    (``param.main_param``, bf16/fp16 training: ``weight_source``), else the parameter itself;
    it keeps that tensor's dtype and device and is a fresh copy. A LoRA-adapted weight is
    yielded merged (``W + scale * B @ A`` from the frozen base, in fp32), or as the frozen base
    with ``merge_lora=False`` (what an engine that merges on its side loads first). Tied embeddings are yielded once, as
    ``model.embed_tokens.weight``, by the first PP stage.
    """
    from megatron.core import parallel_state as ps

    pairs = [(m, p) for chunk in model_chunks for m, p in chunk_params(chunk, hf_config) if m.exported]
    tp_group = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group())
    for m, param in pairs:
        if not m.is_expert:
            yield from zip(m.hf_names, m.layout.from_shards(_gather(param, m, *tp_group, merge_lora)))
    if not any(m.is_expert for m, _ in pairs):
        return
    etp_group = (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_group())
    ep, ep_group = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_group()
    for m, param in pairs:
        if not m.is_expert:
            continue
        for j, tensor in enumerate(m.layout.from_shards(_gather(param, m, *etp_group, merge_lora))):
            if ep == 1:
                yield m.hf_names[j], tensor
                continue
            slots = [torch.empty_like(tensor) for _ in range(ep)]
            dist.all_gather(slots, tensor.contiguous(), group=ep_group)
            yield from ((names[j], t) for names, t in zip(m.ep_hf_names, slots))


def weight_source(param) -> torch.Tensor:
    """The tensor that holds ``param``'s true value: its fp32 main copy when megatron-core's
    mixed-precision optimizer (``Float16OptimizerWithFloat16Params``) keeps one -- the bf16
    parameter is only that copy rounded, so a consumer in another dtype (an fp32 engine, an
    fp32 export) gets the real weights and one cast, not a bf16 rounding cast again -- else
    the parameter itself (fp32 training, the frozen reference, the sharded distributed
    optimizer, which keeps no full main copy per parameter)."""
    main = getattr(param, "main_param", None)
    return main if isinstance(main, torch.Tensor) and main.shape == param.shape else param


def _gather(param, m: ParamMapping, size: int, group, merge_lora: bool = True) -> list[torch.Tensor]:
    """The shards of ``param``'s value (``weight_source``; a LoRA-adapted weight merged with its
    adapter, in fp32) on every rank of ``group`` (just this one if replicated)."""
    merged = merged_source(param, weight_source) if merge_lora else None  # fp32 W + scale * B @ A
    local = (merged if merged is not None else weight_source(param)).detach()
    return [local] if m.layout.replicated else all_gather_shards(local, size, group)


def all_gather_shards(local: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    """Every rank's ``local`` over ``group`` (of ``size`` ranks), ordered by rank (no
    collective when ``size`` is 1)."""
    if size == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


def exports_weights() -> bool:
    """Whether this rank takes part in ``iter_hf_weights`` for its PP stage: the first
    data-parallel replica of the experts, i.e. dp rank 0 for a dense model and the ``ep``
    dp ranks whose expert shards make up the model for an MoE one."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_data_parallel_rank() == 0


def expert_hf_names(hf_config) -> frozenset[str]:
    """HF names of every expert weight of the model (empty for a dense model)."""
    arch = get_architecture(hf_config.model_type)
    if not isinstance(arch, MoEMLP):
        return frozenset()
    return frozenset(name for layer in range(hf_config.num_hidden_layers)
                     for e in range(arch.num_experts(hf_config))
                     for name in arch.expert_hf_names(f"model.layers.{layer}.", e))
