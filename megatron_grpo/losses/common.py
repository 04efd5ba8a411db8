"""Masked tensor helpers shared by the loss modules.

Every masked reduction uses ``torch.where`` instead of multiplying by the mask: padded
positions may hold NaN or inf (a right-padded log-prob buffer, a -inf from a masked vocab
entry), and ``nan * 0 == nan`` would leak them into the loss and its gradient.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to +-20 before exp (verl, SkyRL): exp(20) ~ 4.9e8 stays finite in
float32 and in bf16."""

Count = Union[int, float, torch.Tensor]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Loss arithmetic runs in at least float32 (bf16/fp16 log-probs are upcast); float64
    stays float64 so that gradcheck sees the exact function."""
    return torch.promote_types(dtype, torch.float32)


def sanitize(x: torch.Tensor, valid_BT: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` with invalid positions replaced by 0 (shape of ``valid_BT``), in ``dtype``.

    Done once on every input BEFORE any arithmetic: exp/log of a padded NaN would otherwise
    give NaN values whose backward (0 * NaN) poisons the gradient even behind a later where.
    The gradient of the result w.r.t. ``x`` is 0 at invalid positions.
    """
    x = x.to(dtype)
    return torch.where(valid_BT, x, torch.zeros((), dtype=dtype, device=x.device))


def safe_exp(log_ratio: torch.Tensor, clamp: float = LOG_RATIO_CLAMP) -> torch.Tensor:
    """exp(clamp(log_ratio, -clamp, clamp)); gradient 1 * value inside the clamp, 0 outside."""
    return torch.exp(torch.clamp(log_ratio, -clamp, clamp))


def masked_sum(x: torch.Tensor, valid: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of ``x`` over valid positions (all dims, or ``dim``); invalid entries never read."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    kept = torch.where(valid, x, zero)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def as_count(value: Optional[Count], default: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A denominator as a 0-d tensor of ``like``'s dtype/device, clamped to >= 1 so that an
    empty batch gives 0 / 1 = 0 rather than 0 / 0 = NaN. ``None`` selects ``default``."""
    value = default if value is None else value
    return torch.as_tensor(value, dtype=like.dtype, device=like.device).clamp(min=1)
