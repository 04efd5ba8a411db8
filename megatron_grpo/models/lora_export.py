"""LoRA adapters out of Megatron chunks as a peft adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the HF base.

Names and shapes are peft's for a causal LM: ``base_model.model.<HF module>.lora_A.weight``
``[r, in]`` and ``...lora_B.weight`` ``[out, r]``; ``lora_alpha`` is the config's alpha, so
peft's scale ``lora_alpha / r`` is ours. A fused megatron adapter is written per HF module:
its A for each of q/k/v (gate/up), its B split by the base weight's own layout (``FusedQKV``,
``GatedFC1``). Collective like ``weights.iter_hf_weights``: the TP peers gather, each PP
stage's first replica sends its part to global rank 0, which writes (temp dir, then rename).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_grpo.models.checkpoint import replace_dir
from megatron_grpo.models.layouts import TPSplit
from megatron_grpo.models.lora import LoraSpec
from megatron_grpo.models.weights import all_gather_shards, chunk_params, exports_weights, weight_source

PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_names(hf_weight_name: str) -> tuple[str, str]:
    """``model.layers.0.self_attn.q_proj.weight`` -> its peft lora_A and lora_B names."""
    module = PEFT_PREFIX + hf_weight_name.removesuffix(".weight")
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def _gather_tp(tensor: torch.Tensor) -> list[torch.Tensor]:
    from megatron.core import parallel_state as ps

    return all_gather_shards(tensor, ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group())


@dataclass
class AdapterUnit:
    """One megatron adapter, in HF terms: the HF modules it serves (q/k/v or gate/up of a fused
    linear, else one), per module its A ``[r, in]`` (a column adapter's modules share one tensor)
    and its B ``[out_i, r]``, full fp32 tensors, and with ``with_base`` each module's frozen base
    weight ``[out_i, in]`` (in its own dtype), gathered over TP like ``iter_hf_weights``' with
    ``merge_lora=False``."""

    hf_names: list[str]
    a: list[torch.Tensor]
    b: list[torch.Tensor]
    bases: Optional[list[torch.Tensor]] = None


@torch.no_grad()
def iter_adapter_units(model_chunks: list, hf_config, *, with_base: bool = False) -> Iterator[AdapterUnit]:
    """Every adapter of this PP stage as an ``AdapterUnit`` (the optimizer's fp32 main copies in
    bf16 training). Collective over the TP group (every TP rank of the stage iterates to the end;
    all of them receive the full tensors)."""
    for chunk in model_chunks:
        for m, param in chunk_params(chunk, hf_config):
            adapter = getattr(param, "lora_adapter", None)
            if adapter is None:
                continue
            a = weight_source(adapter.lora_A).detach().float()
            b = weight_source(adapter.lora_B).detach().float()
            if adapter.kind == "column":  # A replicated, B split like the weight's rows
                a_full, b_parts = [a.clone()] * len(m.hf_names), m.layout.from_shards(_gather_tp(b))  # one A, shared
            else:  # row: A split like the weight's columns, B replicated
                a_full, b_parts = TPSplit(dim=1).from_shards(_gather_tp(a)), [b.clone()]
            bases = None
            if with_base:
                base = weight_source(param).detach()
                bases = m.layout.from_shards([base] if m.layout.replicated else _gather_tp(base))
            yield AdapterUnit(list(m.hf_names), list(a_full), list(b_parts), bases)


def iter_adapters_hf(model_chunks: list, hf_config) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(HF weight name, A ``[r, in]``, B ``[out, r]``) of every adapted HF module of this PP
    stage (``iter_adapter_units``; collective over the TP group). A fused adapter gives each of
    its modules its A (the same tensor) and its rows of B."""
    for unit in iter_adapter_units(model_chunks, hf_config):
        yield from zip(unit.hf_names, unit.a, unit.b)


def adapted_hf_names(model_chunks: list, hf_config) -> frozenset[str]:
    """HF names of this PP stage's weights that carry a LoRA adapter (local, no collective)."""
    return frozenset(name for chunk in model_chunks for m, param in chunk_params(chunk, hf_config)
                     if getattr(param, "lora_adapter", None) is not None for name in m.hf_names)


def iter_lora_weights(model_chunks: list, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """(peft name, full fp32 tensor) of every adapter of this PP stage (``iter_adapters_hf``)."""
    for hf_name, a, b in iter_adapters_hf(model_chunks, hf_config):
        name_a, name_b = peft_names(hf_name)
        yield name_a, a.clone()  # a fused adapter's modules share one A: safetensors refuses shared memory
        yield name_b, b


def adapter_config(spec: LoraSpec, base_model_name_or_path: str) -> dict:
    """peft's ``adapter_config.json`` for ``spec``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": spec.hf_target_modules(),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def collect_lora_weights(model_chunks: list, hf_config) -> dict[str, torch.Tensor] | None:
    """Every adapter of the model (all PP stages) on global rank 0, None elsewhere. Collective."""
    from megatron.core import parallel_state as ps

    local = dict(iter_lora_weights(model_chunks, hf_config)) if exports_weights() else {}
    sender = exports_weights() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    parts: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object({k: v.cpu() for k, v in local.items()} if sender else {}, parts, dst=0)
    if dist.get_rank() != 0:
        return None
    return {k: v for part in parts for k, v in part.items()}


def save_peft_adapter(model_chunks: list, hf_config, out_dir: str | Path, *, spec: LoraSpec,
                      base_model_name_or_path: str, dtype: torch.dtype = torch.float32) -> int:
    """Write the adapters to ``out_dir`` (replaced if it exists) as a peft adapter folder;
    returns the bytes of weights written (on rank 0; 0 elsewhere). Collective."""
    from safetensors.torch import save_file

    tensors = collect_lora_weights(model_chunks, hf_config)
    written = 0
    if dist.get_rank() == 0:
        final = Path(out_dir)
        tmp = final.with_name(f".{final.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tensors = {k: v.to(dtype).contiguous() for k, v in sorted(tensors.items())}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        config = adapter_config(spec, base_model_name_or_path)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        replace_dir(tmp, final)
        written = sum(t.nbytes for t in tensors.values())
    dist.barrier()
    return written


def peft_logits(base_dir: str | Path, adapter_dir: str | Path, input_ids_BS: torch.Tensor) -> torch.Tensor:
    """fp32 logits [B, S, V] of the HF model in ``base_dir`` with the peft adapter of
    ``adapter_dir`` loaded by the ``peft`` library (the independent reference of an export)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids_BS).logits.float()
