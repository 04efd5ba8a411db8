"""Weight-update requests that carry a LoRA policy's adapters, parsed and checked before any byte
is received or any weight touched.

The trainer of a LoRA run sends the embedded engine the frozen base once, then only the
adapters (``sync/lora_sync.py``). Two optional keys of the weight-update routes say so
(``/update_weights_from_shm``, ``/update_weights_from_distributed``, ``/update_weights_from_tensor``;
a safetensors file's metadata for ``/update_weights_from_disk``), always inside a
``/begin_weight_update`` .. ``/end_weight_update`` session:

* ``"lora_base": [names]``: these tensors of the request are the frozen base of adapted
  weights. The engine loads them as usual and keeps an fp32 copy of each, exactly as received
  (a bf16 engine of an fp32 trainer keeps the fp32 base, not its rounding), which every later
  merge starts from. Loading a parameter any other way drops its kept base.
* ``"lora": {"scale": s, "modules": [[param, a, b], ...]}``: the request's tensors are
  adapters, not weights. For each module, ``a`` names its A ``[r, in]`` and ``b`` its B
  ``[out, r]`` among the request's tensors (a fused q/k/v or gate/up adapter's modules name
  one shared A); the engine serves ``base + s * B @ A`` (``ops.lora_merge.merge_fp32``, fp32,
  cast once) in ``param``, from the kept base. A module whose parameter has no kept base is
  refused ("no LoRA base loaded"): a restarted engine holds none, so a trainer that forgot to
  send the base again learns it at once instead of serving a merge onto the HF weights.

Every check raises ``ValueError`` with one line naming the tensor or key (the engine turns it
into a 400).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_grpo.inference.limits import lora_rank_problem


@dataclass(frozen=True)
class LoraUpdate:
    """A request's ``lora`` key: the scale (alpha / r) and ``(parameter, A name, B name)`` per module."""

    scale: float
    modules: tuple[tuple[str, str, str], ...]


def parse_lora(value: Any) -> Optional[LoraUpdate]:
    """A request's ``lora`` value -> ``LoraUpdate`` (None when absent); ValueError when malformed."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"scale", "modules"}:
        raise ValueError('lora must be an object with exactly the keys "scale" and "modules"')
    scale = value["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"lora.scale must be a finite number, got {scale!r}")
    modules = value["modules"]
    if not isinstance(modules, list) or not modules:
        raise ValueError("lora.modules must be a non-empty list of [parameter, A name, B name]")
    out, seen = [], set()
    for entry in modules:
        if not (isinstance(entry, list) and len(entry) == 3 and all(isinstance(x, str) for x in entry)):
            raise ValueError(f"lora.modules entry {entry!r} is not [parameter, A name, B name] (three strings)")
        if entry[0] in seen:
            raise ValueError(f"lora.modules names parameter {entry[0]!r} twice")
        seen.add(entry[0])
        out.append((entry[0], entry[1], entry[2]))
    return LoraUpdate(scale=float(scale), modules=tuple(out))


def parse_lora_base(value: Any, names: list[str]) -> frozenset[str]:
    """A request's ``lora_base`` value -> the set of its tensor names to keep as LoRA bases."""
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ValueError("lora_base must be a list of tensor names")
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"lora_base names {unknown[0]!r}, which is not a tensor of the request")
    return frozenset(value)


def plan_merge(update: LoraUpdate, names: list[str], shapes: list[list[int]], dtypes: list[torch.dtype],
               params: dict[str, torch.Tensor], bases: dict[str, torch.Tensor]) -> list[tuple[str, int, int]]:
    """``(parameter, index of A, index of B)`` per module of ``update`` over the request's tensors
    (``names``/``shapes``/``dtypes``), after checking that each module names a parameter with a
    kept base (``bases``) and an A ``[r, in]`` and B ``[out, r]`` that fit it, and that every
    tensor of the request is some module's A or B."""
    index = {}
    for i, name in enumerate(names):
        if name in index:
            raise ValueError(f"the request holds tensor {name!r} twice")
        index[name] = i
    plan, used = [], set()
    for param_name, a_name, b_name in update.modules:
        param = params.get(param_name)
        if param is None:
            raise ValueError(f"unknown parameter name {param_name!r}")
        for what, name in (("A", a_name), ("B", b_name)):
            if name not in index:
                raise ValueError(f"{param_name}: LoRA {what} {name!r} is not a tensor of the request")
            if not dtypes[index[name]].is_floating_point:
                raise ValueError(f"{param_name}: LoRA {what} {name!r} is {dtypes[index[name]]}, not a floating dtype")
        a, b = list(shapes[index[a_name]]), list(shapes[index[b_name]])
        out_in = list(param.shape)
        if len(a) != 2 or len(b) != 2 or len(out_in) != 2 or a[0] != b[1] or b[0] != out_in[0] or a[1] != out_in[1]:
            raise ValueError(f"{param_name}: LoRA A {a} / B {b} do not fit the model's {out_in} "
                             "(A must be [r, in] and B [out, r])")
        problem = lora_rank_problem(param_name, a[0], out_in[0], out_in[1])
        if problem:
            raise ValueError(problem)
        if param_name not in bases:
            raise ValueError(f"no LoRA base loaded for {param_name!r}: after the engine starts (or restarts) "
                             "the base must be sent first (a weight update with lora_base)")
        plan.append((param_name, index[a_name], index[b_name]))
        used.update((a_name, b_name))
    unused = [n for n in names if n not in used]
    if unused:
        raise ValueError(f"tensor {unused[0]!r} of the request is not the A or B of any lora.modules entry")
    return plan
