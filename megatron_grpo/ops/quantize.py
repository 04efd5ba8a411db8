"""Quantized linear layers for rollouts (``engine.quantization``): the one numerical definition
that the embedded engine serves with and the trainer's weight-sync probe reproduces.

Schemes (what SGLang's online ``--quantization fp8`` does on an H100, and int8 weight-only):

* ``fp8``: the weight ``W [O, I]`` gets one scale per output channel, ``s_w[o] = max_i |W[o, i]| /
  FMAX`` (FMAX = 448 for e4m3, 57344 for e5m2), and the activation ``x [T, I]`` one per token,
  ``s_x[t] = max_i |x[t, i]| / FMAX``, computed from each input as it arrives (dynamic). Each is
  divided by its scale, clamped to [-FMAX, FMAX] (saturation: float8_e4m3fn has no infinity) and
  rounded to the float8 format (round to nearest even); ``y = (q_x s_x) (q_w s_w)^T + b``.
  Per-channel and per-token scales do not depend on how rows are fused or split over tensor
  parallelism, so the engine's separate q/k/v and the trainer's fused QKV quantize identically;
* ``int8``: weight-only, ``s_w[o] = max_i |W[o, i]| / 127``, rounded to nearest and clamped to
  [-127, 127]; the activations stay in the compute dtype (near-lossless).

Two ways to compute the product, one numerical definition: on CUDA with e4m3 in bf16,
``torch._scaled_mm`` (row-wise scales, fp32 accumulation, the scales applied in its epilogue);
everywhere else fake quantization: the dequantized values ``q * s`` in the compute dtype through
an ordinary matmul -- the same products up to the accumulation order.

Only the decoder's attention and dense-MLP projections are quantized (as SGLang's and vLLM's
fp8 do): not the embeddings, norms, lm_head or MoE router (the callers choose the layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""engine.fp8_format -> torch's float8 dtype."""

INT8_MAX = 127
_MIN_SCALE = 1e-12  # an all-zero row gets this scale (its values stay 0) instead of 0/0


@dataclass(frozen=True)
class QuantScheme:
    """What a quantized linear layer does: ``method`` fp8 (weights and activations) or int8
    (weights only); ``fp8_format`` e4m3 or e5m2 (fp8 only)."""

    method: str
    fp8_format: str = "e4m3"

    def __post_init__(self):
        assert self.method in ("fp8", "int8"), self.method
        assert self.fp8_format in FP8_DTYPES, self.fp8_format

    @property
    def qmax(self) -> float:
        """The largest representable magnitude: 448 (e4m3), 57344 (e5m2) or 127 (int8)."""
        return float(torch.finfo(FP8_DTYPES[self.fp8_format]).max) if self.method == "fp8" else float(INT8_MAX)

    @property
    def storage_dtype(self) -> torch.dtype:
        return FP8_DTYPES[self.fp8_format] if self.method == "fp8" else torch.int8

    @property
    def quantizes_activations(self) -> bool:
        return self.method == "fp8"

    def describe(self) -> str:
        """``fp8-e4m3`` or ``int8`` (server info, logs)."""
        return f"fp8-{self.fp8_format}" if self.method == "fp8" else "int8"


def scheme_of(quantization: Optional[str], fp8_format: str = "e4m3") -> Optional[QuantScheme]:
    """The scheme of ``engine.quantization`` / ``engine.fp8_format`` (None: unquantized)."""
    return None if quantization is None else QuantScheme(quantization, fp8_format)


def row_absmax(x_R_C: torch.Tensor) -> torch.Tensor:
    """``max |x|`` along the last dim, in fp32: [..., C] -> [..., 1]. Callers whose rows are split
    over ranks (a row-parallel layer's columns) all-reduce it with MAX before ``scales_from``."""
    return x_R_C.detach().abs().amax(dim=-1, keepdim=True).float()


def scales_from(absmax: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Per-row scales [..., 1] fp32: ``absmax / qmax`` (the largest value maps to qmax)."""
    return absmax.clamp(min=_MIN_SCALE * scheme.qmax) / scheme.qmax


def quantize(x: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """``x / scale`` clamped to [-qmax, qmax] (saturation) and rounded to the storage dtype
    (float8 round-to-nearest-even, or int8 round-half-even); same shape as ``x``."""
    scaled = (x.float() / scale).clamp(-scheme.qmax, scheme.qmax)
    if scheme.method == "int8":
        scaled = scaled.round()
    return scaled.to(scheme.storage_dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` (in fp32) cast to ``dtype``: the values a scaled matmul multiplies."""
    return (q.float() * scale).to(dtype)


def fake_quantize(x_R_C: torch.Tensor, scheme: QuantScheme, absmax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize-dequantize with one scale per row (a weight's output channel, an activation's
    token): [..., C] -> [..., C] in ``x``'s dtype. ``absmax`` [..., 1]: the rows' max |x| when
    the caller computed it over more than ``x`` (tensor parallelism), else ``row_absmax(x)``."""
    scale = scales_from(row_absmax(x_R_C) if absmax is None else absmax, scheme)
    return dequantize(quantize(x_R_C, scale, scheme), scale, x_R_C.dtype)


class QuantizedWeight(NamedTuple):
    """A weight in its quantized form: ``q [O, I]`` (float8 or int8) and ``scale [O, 1]`` fp32."""

    q: torch.Tensor
    scale: torch.Tensor


def quantize_weight(weight_OI: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Per-output-channel quantization of ``weight_OI`` [O, I]."""
    scale = scales_from(row_absmax(weight_OI), scheme)
    return QuantizedWeight(quantize(weight_OI, scale, scheme), scale)


def scaled_mm_supported(device: torch.device, dtype: torch.dtype, scheme: QuantScheme, shape_OI) -> bool:
    """True where ``torch._scaled_mm`` with row-wise scales computes the fp8 product: CUDA compute
    capability >= 8.9, e4m3, bf16 output, both weight dims multiples of 16."""
    if not (scheme.method == "fp8" and scheme.fp8_format == "e4m3" and device.type == "cuda"
            and dtype == torch.bfloat16 and hasattr(torch, "_scaled_mm")):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9) and shape_OI[0] % 16 == 0 and shape_OI[1] % 16 == 0


def quantized_linear(x_TI: torch.Tensor, weight: QuantizedWeight, bias: Optional[torch.Tensor], scheme: QuantScheme,
                     dequantized_OI: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y [..., O]`` of a quantized linear layer on ``x [..., I]`` (module docstring).

    ``dequantized_OI``: the weight's ``dequantize(q, scale, x.dtype)``, when the caller keeps it
    (the fake-quantized path then costs one ordinary matmul); computed here when None.
    """
    if scheme.quantizes_activations and scaled_mm_supported(x_TI.device, x_TI.dtype, scheme, weight.q.shape):
        flat = x_TI.reshape(-1, x_TI.shape[-1])
        scale_x = scales_from(row_absmax(flat), scheme)
        out = torch._scaled_mm(quantize(flat, scale_x, scheme), weight.q.t(), scale_a=scale_x,
                               scale_b=weight.scale.t(), out_dtype=x_TI.dtype)
        out = out if bias is None else out + bias
        return out.reshape(*x_TI.shape[:-1], out.shape[-1])
    w = dequantized_OI if dequantized_OI is not None else dequantize(weight.q, weight.scale, x_TI.dtype)
    x = fake_quantize(x_TI, scheme) if scheme.quantizes_activations else x_TI
    return F.linear(x, w, bias)
