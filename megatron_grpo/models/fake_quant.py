"""The trainer's forward through a quantized engine's numerics (the weight-sync probe of
``engine.quantization``): the same ``ops/quantize.py`` functions on Megatron's layers.

``with fake_quantized(model_chunks, scheme):`` every decoder layer's ``linear_qkv``,
``linear_proj``, ``linear_fc1`` and ``linear_fc2`` (a dense MLP's; MoE experts and the output
layer are left alone, as the engines leave them) computes with fake-quantized weights (one
scale per output channel) and, for fp8, fake-quantized inputs (one scale per token); on exit
the weights are restored bitwise. Tensor parallelism: a row-parallel layer holds a slice of
each output channel and of each token's input, so the max |.| of both is all-reduced (MAX)
over the tp group before the scales are taken; a column-parallel layer holds whole rows, and
per-token scales of a sequence-parallel input do not care where the sequence is split. So the
result equals the engine's (separate q/k/v, gate/up) up to the order of accumulation.

Megatron-core's local layer spec only: TransformerEngine's fused layer-norm linears see the
input before the norm, so they are refused with an error.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP
from megatron.core.utils import get_attr_wrapped_model

from megatron_grpo.ops.quantize import QuantScheme, fake_quantize, row_absmax


def _tp_group():
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1:
        return ps.get_tensor_model_parallel_group()
    return None


def _absmax(x: torch.Tensor, group) -> torch.Tensor:
    """Per-row max |x| [..., 1], over the whole row when ``group`` splits it (MAX all-reduce)."""
    amax = row_absmax(x)
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def quantized_linears(model_chunks) -> list[torch.nn.Module]:
    """The Megatron layers an engine quantizes (module docstring), over every chunk."""
    out = []
    for chunk in model_chunks:
        for layer in get_attr_wrapped_model(chunk, "decoder").layers:
            modules = [layer.self_attention.linear_qkv, layer.self_attention.linear_proj]
            if isinstance(layer.mlp, MLP):  # a MoE layer's experts stay unquantized
                modules += [layer.mlp.linear_fc1, layer.mlp.linear_fc2]
            for m in modules:
                if not isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
                    raise ValueError(f"engine.quantization: the trainer's probe fake-quantizes megatron-core's "
                                     f"local-spec linears only, not {type(m).__name__} (TransformerEngine); set "
                                     "sync.verify_every: 0 or run without TransformerEngine")
            out += modules
    return out


@contextlib.contextmanager
def fake_quantized(model_chunks, scheme: Optional[QuantScheme]) -> Iterator[None]:
    """Run the chunks' forward as a ``scheme``-quantized engine would (no-op for None)."""
    if scheme is None:
        yield
        return
    group = _tp_group()
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = []
    try:
        with torch.no_grad():
            for module in quantized_linears(model_chunks):
                split = group if isinstance(module, RowParallelLinear) else None
                weight = module.weight
                saved.append((weight, weight.detach().clone()))
                weight.copy_(fake_quantize(weight, scheme, _absmax(weight, split)))
                if scheme.quantizes_activations:
                    handles.append(module.register_forward_pre_hook(_input_hook(scheme, split)))
        yield
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for weight, original in saved:
                weight.copy_(original)


def _input_hook(scheme: QuantScheme, group):
    def hook(module, args):
        x = args[0]
        return (fake_quantize(x, scheme, _absmax(x, group)), *args[1:])
    return hook
