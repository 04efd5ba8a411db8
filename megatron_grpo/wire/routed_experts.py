"""The wire format of an engine's MoE routing, shared by the engine and the client.

The one SGLang uses for ``return_routed_experts`` (its PR 12162, server flag
``--enable-return-routed-experts``): ``meta_info["routed_experts"]`` is the base64 of
little-endian int32 ``[P, num_moe_layers, k]``, P = prompt + response - 1 positions (the last
sampled token is never fed to the model), entry ``p`` the experts that the input token of
position ``p`` was routed to.
"""

from __future__ import annotations

import base64

import numpy as np
import torch


def encode(routed_PLK: torch.Tensor) -> str:
    """int [P, num_moe_layers, k] -> base64 of little-endian int32 (SGLang's encoding)."""
    return base64.b64encode(routed_PLK.to(torch.int32).numpy().astype("<i4").tobytes()).decode("ascii")


def decode(text: str, num_positions: int) -> torch.Tensor:
    """``encode``'s inverse, flattened over layers: int32 [num_positions, num_moe_layers * k]
    (the client does not know the model; the trainer reshapes with its own layer count and k).
    A count not divisible by ``num_positions`` is an error."""
    flat = np.frombuffer(base64.b64decode(text), dtype="<i4")
    if num_positions <= 0 or flat.size % num_positions:
        raise ValueError(f"routed_experts has {flat.size} entries, not a multiple of {num_positions} positions")
    return torch.from_numpy(flat.copy()).reshape(num_positions, -1)
