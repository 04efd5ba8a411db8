"""The MoE routing of the embedded engine's forwards, for router replay in the trainer.

Forward hooks on the transformers top-k routers (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``:
``forward(hidden [B*L, H]) -> (logits, scores, indices [B*L, k])``) collect, per forward and per
MoE layer (module order = layer order), the top-k expert indices of every input position.
``RoutingRecorder.rows`` turns them into per-row [L_fwd, num_moe_layers, k] blocks.

The wire format (SGLang's) is ``wire.routed_experts``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformers top-k router of every MoE layer, in layer order ([] for a dense model).
    Matched by the router class contract (a ``top_k`` and a ``num_experts`` attribute and a
    ``weight`` [E, H]) rather than by name, so every transformers MoE of this shape is covered."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "num_experts")]


class RoutingRecorder:
    """Top-k indices of each forward run inside ``capture()`` (one list entry per forward)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = moe_routers(model)
        self._current: list[torch.Tensor] = []

    @contextlib.contextmanager
    def capture(self) -> Iterator["RoutingRecorder"]:
        self._current = []
        handles = [r.register_forward_hook(self._hook) for r in self.routers]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _hook(self, router, inputs, output) -> None:
        self._current.append(output[2].detach().to("cpu", torch.int32))  # [B*L, k]

    def take(self, batch_size: int) -> torch.Tensor:
        """The last forward's routing: int32 [B, L, num_moe_layers, k]; resets the capture."""
        layers, self._current = self._current, []
        assert len(layers) == len(self.routers), f"{len(layers)} router calls for {len(self.routers)} routers"
        stacked = torch.stack(layers, dim=1)  # [B*L, num_layers, k]
        return stacked.reshape(batch_size, -1, *stacked.shape[1:])
