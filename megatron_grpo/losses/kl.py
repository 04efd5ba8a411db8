"""Per-token estimators of KL(pi_theta || pi_ref) (docs/loss_spec.md#kl-and-entropy-terms), keyed by
``algorithm.kl_estimator``.

With x = log pi_theta - log pi_ref on a token sampled from pi_theta:

* ``k1``: x                          (unbiased, high variance, can be negative)
* ``k2``: x^2 / 2                    (biased, low variance; verl's "mse")
* ``k3`` / ``low_var_kl``: e^{-x} + x - 1  (unbiased, >= 0; Schulman's k3). The two names are
  aliases, as in verl. Following verl/SkyRL, -x is clamped to [-20, 20] before exp and the
  value to [-10, 10], so a single runaway token cannot dominate the loss.

Each function maps ``log_probs, ref_log_probs: float[B, T]`` to ``float[B, T]``; the caller
sanitises padded positions first and aggregates (see ``loss.py``).
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_grpo.losses.common import LOG_RATIO_CLAMP
from megatron_grpo.losses.registry import Registry

K3_VALUE_CLAMP = 10.0
"""Per-token k3 values are clamped to +-10 (verl, SkyRL)."""

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """x = lp - lref. ``float[B, T] x2 -> float[B, T]``."""
    return log_probs - ref_log_probs


@KL_ESTIMATORS.register("k2")
def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """x^2 / 2. ``float[B, T] x2 -> float[B, T]``."""
    return 0.5 * (log_probs - ref_log_probs).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """clamp(e^{y} - y - 1, +-10) with y = clamp(lref - lp, +-20). ``float[B, T] x2 -> float[B, T]``."""
    y = torch.clamp(ref_log_probs - log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(y) - y - 1, -K3_VALUE_CLAMP, K3_VALUE_CLAMP)
