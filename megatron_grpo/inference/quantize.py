"""The embedded engine's quantized linear layers (``--quantization``; numerics in ``ops/quantize.py``).

``quantize_decoder_linears(model, scheme)`` replaces each decoder layer's attention projections
(``self_attn.{q,k,v,o}_proj``) and dense-MLP projections (``mlp.{gate,up,down}_proj``) with a
``QuantizedLinear`` that keeps the SAME ``weight`` and ``bias`` parameters: their names, and so
the weight sync's names, checksums and ``/get_weights_by_name``, are those of the
high-precision weights the trainer sent. Generation runs on a quantized copy that
``requantize()`` rebuilds from them after every load. Embeddings, norms, lm_head, MoE routers
and experts stay in the compute dtype (as in SGLang's and vLLM's fp8).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_grpo.ops.quantize import (QuantizedWeight, QuantScheme, dequantize, quantize_weight, quantized_linear,
                                        scaled_mm_supported)

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class QuantizedLinear(nn.Module):
    """A linear layer served from a quantized copy of its (high-precision) ``weight`` [O, I]."""

    def __init__(self, linear: nn.Linear, scheme: QuantScheme):
        super().__init__()
        self.weight = linear.weight  # the same Parameter objects: loads write into them
        self.bias = linear.bias
        self.scheme = scheme
        self.quantized: Optional[QuantizedWeight] = None
        self.dequantized: Optional[torch.Tensor] = None
        self.requantize()

    @torch.no_grad()
    def requantize(self) -> None:
        """Rebuild the quantized copy from ``weight`` (after every load)."""
        self.quantized = quantize_weight(self.weight, self.scheme)
        use_scaled_mm = self.scheme.quantizes_activations and scaled_mm_supported(
            self.weight.device, self.weight.dtype, self.scheme, self.weight.shape)
        # the fake-quantized path multiplies dequantized values: keep them instead of
        # dequantizing at every step
        self.dequantized = None if use_scaled_mm else dequantize(*self.quantized, self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.quantized, self.bias, self.scheme, self.dequantized)

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, {self.scheme.describe()}"


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", None)  # *ForCausalLM -> its decoder (Llama, Qwen2/3, Mixtral)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers at .model.layers to quantize")
    return layers


def quantize_decoder_linears(model: nn.Module, scheme: QuantScheme) -> dict[int, QuantizedLinear]:
    """Swap the decoder's projections for ``QuantizedLinear`` (module docstring), in place.
    Returns ``{id(weight parameter): its QuantizedLinear}`` so a load can requantize what it wrote."""
    quantized: dict[int, QuantizedLinear] = {}
    for layer in _decoder_layers(model):
        for parent_name, names in (("self_attn", ATTENTION_PROJECTIONS), ("mlp", MLP_PROJECTIONS)):
            parent = getattr(layer, parent_name, None)
            for name in names:
                linear = getattr(parent, name, None)
                if type(linear) is nn.Linear:  # a MoE block's experts are not nn.Linear: left alone
                    module = QuantizedLinear(linear, scheme)
                    setattr(parent, name, module)
                    quantized[id(module.weight)] = module
    if not quantized:
        raise ValueError(f"{type(model).__name__}: no decoder projections to quantize")
    return quantized
