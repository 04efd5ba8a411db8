"""Router load balance of a mixture-of-experts policy, once per step.

Counted during the old-policy log-prob pass (``compute_log_probs``): the routing of this
step's rollout batch by the policy that generated it, forward-only, so activation
recomputation and the backward pass never count a token twice. The tokens counted are the
positions the loss scores (``loss_mask``: the position whose next token is a response token);
prompt positions and padding are not counted.

Per MoE layer ``l``, ``c[l, e]`` = number of (token, expert) assignments to expert ``e``
(each token is assigned to top-k experts, so ``sum_e c[l, e] = k * num_tokens``):

* ``moe/expert_load_max_over_mean``: max_e c[l, e] / mean_e c[l, e], averaged over layers.
  1 = perfectly balanced; num_experts / k = every token sent to the same k experts;
* ``moe/expert_load_max_over_mean_worst_layer``: the same, the largest over layers;
* ``moe/expert_load_cv``: std_e c[l, e] / mean_e c[l, e] (population std), averaged over layers;
* ``moe/expert_load_min_fraction``: min_e c[l, e] / mean_e c[l, e], the smallest over layers
  (0 = some expert of some layer received no token).

Counts are summed over data-parallel ranks (different rows; the expert-parallel ranks are
among them), over tensor-parallel ranks only with sequence parallelism (each then routes a
slice of the sequence), and the layers of all pipeline stages are gathered.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist


def megatron_routers(model_chunks: list) -> list:
    """Every megatron-core MoE router of ``model_chunks``, in module order (empty: dense)."""
    from megatron.core.transformer.moe.router import Router

    return [m for c in model_chunks for m in c.modules() if isinstance(m, Router)]


class RouterLoad:
    """Tokens per expert per MoE layer, counted by forward hooks on megatron's routers."""

    def __init__(self, model_chunks: list):
        self.routers = megatron_routers(model_chunks)
        self.counts: dict[int, torch.Tensor] = {}  # global 1-based layer number -> long[E]
        self._valid_SB: Optional[torch.Tensor] = None
        self._num_microbatches = 0
        self._calls: dict[int, int] = {}

    @property
    def active(self) -> bool:
        return bool(self.routers)

    def set_micro_batch(self, loss_mask_BT: torch.Tensor) -> None:
        """The next forward's counted positions: ``loss_mask`` [B, T] (T = S - 1) -> [S, B]
        bool, sequence-first like megatron's hidden states."""
        b, t = loss_mask_BT.shape
        valid = torch.zeros(b, t + 1, dtype=torch.bool, device=loss_mask_BT.device)
        valid[:, :t] = loss_mask_BT > 0
        self._valid_SB = valid.t().contiguous()

    @contextlib.contextmanager
    def counting(self, num_microbatches: int) -> Iterator["RouterLoad"]:
        """Count the next ``num_microbatches`` forwards of every router. Later calls are not
        counted: the interleaved schedule repeats a forward-only pass's last micro-batch up to
        a multiple of pp (``models.forward.run_schedule``); every layer sees the micro-batches
        in order, so its calls past ``num_microbatches`` are exactly those repeats."""
        self._num_microbatches, self._calls = num_microbatches, {}
        handles = [r.register_forward_hook(self._hook) for r in self.routers]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()
            self._valid_SB = None

    def _hook(self, router, inputs, output) -> None:
        _, routing_map = output  # bool [S_local * B, E], rows ordered s * B + b
        hidden = inputs[0]  # [S_local, B, H]
        layer = int(router.layer_number)
        self._calls[layer] = self._calls.get(layer, 0) + 1
        if self._calls[layer] > self._num_microbatches:
            return
        rows = local_rows(self._valid_SB, hidden.shape[0], hidden.shape[1], router.config)
        counts = routing_map[rows.reshape(-1).to(routing_map.device)].sum(dim=0).to("cpu", torch.long)
        self.counts[layer] = self.counts.get(layer, 0) + counts

    def metrics(self, sequence_parallel: bool) -> dict[str, float]:
        """The documented metrics over every MoE layer of the model (collective over the
        model-parallel and data-parallel groups; the same dict on every rank). {} for a dense
        model."""
        from megatron.core import parallel_state as ps

        if not self.active:
            return {}
        layers = sorted(self.counts)
        local = torch.stack([self.counts[l] for l in layers]) if layers else torch.zeros(0)
        groups = [ps.get_data_parallel_group()]
        if sequence_parallel:
            groups.append(ps.get_tensor_model_parallel_group())
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(local, group=group)
        gathered: list = [None] * ps.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(gathered, dict(zip(layers, local)), group=ps.get_pipeline_model_parallel_group())
        merged = {l: c for part in gathered for l, c in part.items()}
        return load_metrics(torch.stack([merged[l] for l in sorted(merged)]))


def local_rows(valid_SB: Optional[torch.Tensor], s_local: int, b: int, config) -> torch.Tensor:
    """The counted rows of this rank's router input [s_local, b]: all when no mask was set;
    with sequence parallelism the tp rank's slice of the (padded) sequence."""
    if valid_SB is None:
        return torch.ones(s_local, b, dtype=torch.bool)
    full = valid_SB
    if config.sequence_parallel:
        from megatron.core import parallel_state as ps

        tp = ps.get_tensor_model_parallel_world_size()
        pad = s_local * tp - full.shape[0]  # sequence-parallel right padding (never counted)
        full = torch.cat([full, full.new_zeros(pad, b)]) if pad > 0 else full
        start = ps.get_tensor_model_parallel_rank() * s_local
        return full[start:start + s_local]
    if full.shape[0] < s_local:
        full = torch.cat([full, full.new_zeros(s_local - full.shape[0], b)])
    return full[:s_local]


def load_metrics(counts_LE: torch.Tensor) -> dict[str, float]:
    """Balance metrics of tokens-per-expert counts [L, E] (see the module docstring).
    E.g. [[2, 2, 2, 2]] -> max/mean 1, cv 0; [[8, 0, 0, 0]] -> max/mean 4, cv sqrt(3)."""
    c = counts_LE.double()
    mean = c.mean(dim=1).clamp_min(1e-12)
    max_over_mean = c.max(dim=1).values / mean
    cv = c.std(dim=1, unbiased=False) / mean
    return {
        "moe/expert_load_max_over_mean": float(max_over_mean.mean()),
        "moe/expert_load_max_over_mean_worst_layer": float(max_over_mean.max()),
        "moe/expert_load_cv": float(cv.mean()),
        "moe/expert_load_min_fraction": float((c.min(dim=1).values / mean).min()),
    }
