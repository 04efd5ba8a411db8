"""Router replay: the trainer's MoE routers use the rollout engine's routing.

The engine and the trainer can send the same token to different experts (different kernels,
dtypes, or weights one sync behind), which changes the log-probs far more than float rounding.
With ``algorithm.router_replay`` the trainer's log-prob passes (old log-probs and the training
forward) route every position to the experts the engine chose for it (``TrainBatch.
routed_experts``); the expert weights are still the router's own probabilities of those
experts (megatron-core's ``RouterReplay``: ``scores.gather(top_indices)``), so the router
still gets a gradient.

Mechanism: every megatron ``TopKRouter`` gets a ``LayerReplay`` (megatron-core's ``RouterReplay``
contract). Departure: megatron's own instances register in a process-global list, which would
mix the policy's and the reference model's layers in one process; ours stay per router. A
forward pre-hook sets each layer's target for the micro-batch in flight from the router's input
shape (global ``layer_number``; with sequence parallelism the tp rank's slice of the sequence).
Positions the engine never routed (padding, the longest row's last token) get experts
``0..k-1``; they are never scored and cannot reach scored positions.

``moe/routing_mismatch_frac``: over the scored positions, the fraction of (token, layer) pairs
whose own top-k expert set differs from the engine's, summed over every rank (exact, except the
interleaved schedule's forward-only pass counting its repeated last micro-batch twice).

Limit: activation recomputation is refused at config load with router replay (it would re-run
the router after later micro-batches set their targets). More: docs/moe.md#router-replay.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplay

from megatron_grpo.models.errors import ModelError
from megatron_grpo.runtime.device import collective_tensor
from megatron_grpo.trainer.moe_metrics import local_rows, megatron_routers


class LayerReplay(RouterReplay):
    """One router's replay target and its own last top-k (not in megatron's global list)."""

    def __init__(self):  # noqa: super().__init__ would register in the global list
        self.target_topk_idx: Optional[torch.Tensor] = None
        self.recorded_topk_idx: Optional[torch.Tensor] = None  # own top-k of the last forward
        self.engine_topk_idx: Optional[torch.Tensor] = None  # the rollout's, for the mismatch count
        self.router_replay_action = None
        self.replay_backward_list: list = []

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.recorded_topk_idx = own.detach()
        if self.target_topk_idx is None:
            return probs, own
        idx = self.target_topk_idx.to(scores.device)
        return scores.gather(1, idx), idx


def layer_targets(routed_BTF: torch.Tensor, layer: int, k: int, s_local: int, b: int, config) -> torch.Tensor:
    """The engine's routing of one MoE layer (0-based) for this rank's router input
    [s_local, b]: long [s_local * b, k], rows ``s * b + b_i``. ``routed_BTF`` int
    [B, T, L * k] (``TrainBatch.routed_experts``); positions the engine never routed (-1,
    or past T) get experts 0..k-1."""
    tp, start = 1, 0
    if config.sequence_parallel:
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        start = ps.get_tensor_model_parallel_rank() * s_local
    default = torch.arange(k, dtype=torch.long)
    full = default.expand(s_local * tp, b, k).clone()  # [S_pad, B, k]
    t = min(routed_BTF.shape[1], s_local * tp)
    engine = routed_BTF[:, :t, layer * k:(layer + 1) * k].transpose(0, 1).long().cpu()
    full[:t] = torch.where(engine < 0, default, engine)
    return full[start:start + s_local].reshape(s_local * b, k)


class RoutingReplay:
    """Router replay and the routing-mismatch count for one model's chunks."""

    def __init__(self, model_chunks: list, replay: bool):
        """ModelError (one line, naming the key) when ``replay`` is asked of a dense model."""
        self.routers = megatron_routers(model_chunks)
        if replay and not self.routers:
            model_type = getattr(getattr(model_chunks[0], "hf_config", None), "model_type", "?")
            raise ModelError(f"algorithm.router_replay needs a mixture-of-experts model; model_type "
                             f"{model_type!r} has no router (set router_replay: false)")
        self.replay = replay
        self._routed: Optional[torch.Tensor] = None
        self._valid_SB: Optional[torch.Tensor] = None
        self.mismatched = 0
        self.total = 0
        for r in self.routers:
            if not isinstance(r.router_replay, LayerReplay):
                r.router_replay = LayerReplay()

    @property
    def active(self) -> bool:
        return bool(self.routers)

    def set_micro_batch(self, routed_BTF: torch.Tensor, loss_mask_BT: torch.Tensor) -> None:
        """The next forward's engine routing int [B, T, L * k] and scored positions [B, T]
        (-> bool [S, B], sequence-first like megatron's hidden states)."""
        b, t = loss_mask_BT.shape
        valid = torch.zeros(b, t + 1, dtype=torch.bool)
        valid[:, :t] = loss_mask_BT.cpu() > 0
        self._routed, self._valid_SB = routed_BTF, valid.t().contiguous()

    @contextlib.contextmanager
    def applied(self) -> Iterator["RoutingReplay"]:
        """Replay (when on) and count mismatches for the forwards run inside."""
        handles = [r.register_forward_pre_hook(self._pre_hook) for r in self.routers]
        handles += [r.register_forward_hook(self._hook) for r in self.routers]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            for r in self.routers:
                r.router_replay.clear_indices()
            self._routed = self._valid_SB = None

    def _pre_hook(self, router, inputs) -> None:
        hidden = inputs[0]  # [S_local, B, H]
        target = layer_targets(self._routed, int(router.layer_number) - 1, router.topk, hidden.shape[0],
                               hidden.shape[1], router.config)
        router.router_replay.target_topk_idx = target.to(hidden.device) if self.replay else None
        router.router_replay.engine_topk_idx = target

    def _hook(self, router, inputs, output) -> None:
        hidden = inputs[0]
        own = router.router_replay.recorded_topk_idx.cpu().sort(dim=-1).values
        engine = router.router_replay.engine_topk_idx.sort(dim=-1).values
        rows = local_rows(self._valid_SB, hidden.shape[0], hidden.shape[1], router.config).reshape(-1)
        differs = (own != engine).any(dim=-1)[rows]
        self.mismatched += int(differs.sum())
        self.total += int(rows.sum())

    def take_metrics(self) -> dict[str, float]:
        """``metrics()`` of the forwards counted so far, then the counts restart."""
        out = self.metrics()
        self.mismatched = self.total = 0
        return out

    def metrics(self) -> dict[str, float]:
        """``moe/routing_mismatch_frac`` pooled over every rank (collective; {} when dense)."""
        if not self.active:
            return {}
        counts = torch.tensor([float(self.mismatched), float(self.total)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            counts = collective_tensor(counts.tolist(), None)
            dist.all_reduce(counts)
            counts = counts.cpu()
        return {"moe/routing_mismatch_frac": float(counts[0] / counts[1].clamp_min(1.0))}
