"""The engine's weights by checkpoint (safetensors) name, which is what the weight sync sends.

For dense models the transformers module names are the checkpoint names. transformers >= 5
keeps the experts of a mixture-of-experts layer fused in memory
(``mlp.experts.gate_up_proj`` [E, 2I, H] = per expert [gate; up], ``mlp.experts.down_proj``
[E, H, I]) and, for Mixtral, names the sparse block ``mlp`` instead of ``block_sparse_moe``,
while ``save_pretrained`` writes one tensor per expert projection. ``served_tensors`` maps
every checkpoint name to the parameter or to the view into the fused parameter that holds it,
so a received expert tensor is copied in place and checksums read the served values.
"""

from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"^(?P<layer>model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\."
                     r"(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^(?P<layer>model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")
# checkpoint projection name -> (fused parameter, half of gate_up_proj: 0 gate, 1 up, None)
_PROJ = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0),
         "up_proj": ("gate_up_proj", 1), "w3": ("gate_up_proj", 1),
         "down_proj": ("down_proj", None), "w2": ("down_proj", None)}


def served_tensors(params: dict[str, torch.Tensor], checkpoint_names: list[str]) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the tensor serving it (a parameter, or a view into a fused one).

    ``params``: the module's named parameters; ``checkpoint_names``: the names in the model
    directory's safetensors. Parameters that no checkpoint name reaches otherwise (none, for
    the supported models) keep their module name. KeyError names a checkpoint tensor the
    model has nowhere to put.
    """
    out: dict[str, torch.Tensor] = {}
    fused_used: set[str] = set()
    for name in checkpoint_names:
        if name in params:
            out[name] = params[name]
        elif m := _MIXTRAL_ROUTER.match(name):
            out[name] = params[f"{m['layer']}.mlp.gate.weight"]
        elif (m := _EXPERT.match(name)) and m["proj"] in _PROJ:
            fused_name, half = _PROJ[m["proj"]]
            fused_name = f"{m['layer']}.mlp.experts.{fused_name}"
            expert = params[fused_name][int(m["expert"])]  # [2I, H] or [H, I], a view
            out[name] = expert if half is None else expert.chunk(2, dim=0)[half]
            fused_used.add(fused_name)
        elif name != "lm_head.weight":  # a tied model's redundant copy has nowhere to go
            raise KeyError(f"checkpoint tensor {name!r} has no parameter in the served model")
    reached = {id(t) for t in out.values()}
    for name, p in params.items():
        if name not in fused_used and id(p) not in reached:
            out[name] = p
    return out
