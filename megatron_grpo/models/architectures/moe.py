"""The mixture-of-experts MLP shared by qwen3_moe and mixtral: router options and expert mapping.

``MoEMLP`` is a mixin placed before a dense architecture (``class Qwen3MoeArch(MoEMLP,
Qwen3Arch)``): attention, norms and embeddings stay the dense architecture's; the MLP of every
layer becomes megatron-core's ``MoELayer`` (router + ``SequentialMLP`` experts).

Routing, as Hugging Face computes it (softmax over all experts, top-k per token), through
megatron's router options: ``normalize_topk`` (Qwen3-MoE ``norm_topk_prob``; always for Mixtral)
maps to ``moe_router_pre_softmax=False`` (the same numbers), not normalised to ``True``. No
capacity limit, no token dropping; each expert's output is scaled by its weight after the expert
(``moe_apply_probs_on_input`` off), as HF does. No load-balancing loss inside the model (HF adds
its own only with ``output_router_logits``); router load metrics are in ``trainer.moe_metrics``.

Expert weights: HF's on-disk per-expert gate/up/down matrices map to ``SequentialMLP``'s local
experts, slot ``i`` of EP rank ``r`` being global expert ``r * num_local + i``; ``linear_fc1`` is
[gate; up] split like the dense ``GatedFC1``, ``linear_fc2`` by columns; the router is replicated.

Departures: grouped-GEMM experts (``TEGroupedMLP``) are not used, so a GPU run computes the
experts one after another (``SequentialMLP``); on CPU the token dispatcher is ``allgather``
(megatron's ``alltoall`` dispatcher allocates CUDA streams), on GPU ``alltoall``.
Why the router options match, and the layout: docs/moe.md#supported.
"""

from __future__ import annotations

import torch

from megatron_grpo.models.architectures.base import ParamMapping
from megatron_grpo.models.layouts import GatedFC1, Replicated, TPSplit


class MoEMLP:
    """Mixin: the MoE MLP. Subclasses set the HF names and read the HF config keys."""

    hf_mlp = "mlp"
    """HF module of the sparse block inside a layer (``mlp`` / ``block_sparse_moe``)."""
    hf_router = "gate"
    hf_expert_projs = ("gate_proj", "up_proj", "down_proj")
    """HF names of an expert's gate, up and down projections."""

    # ---- config: subclasses read their keys -------------------------------------------------
    def num_experts(self, hf_config) -> int:
        raise NotImplementedError

    def normalize_topk(self, hf_config) -> bool:
        raise NotImplementedError

    def moe_ffn_hidden_size(self, hf_config) -> int:
        raise NotImplementedError

    def _arch_kwargs(self, hf_config) -> dict:
        top_k = int(hf_config.num_experts_per_tok)
        num_experts = self.num_experts(hf_config)
        if not 1 <= top_k <= num_experts:
            self._unsupported(hf_config, "num_experts_per_tok", top_k,
                              f"an integer in [1, {num_experts}]")
        return {
            **super()._arch_kwargs(hf_config),
            "num_moe_experts": num_experts,
            "moe_router_topk": top_k,
            "moe_ffn_hidden_size": self.moe_ffn_hidden_size(hf_config),
            "moe_router_score_function": "softmax",
            "moe_router_pre_softmax": not self.normalize_topk(hf_config),
            "moe_router_load_balancing_type": "none",
            "moe_aux_loss_coeff": 0.0,
            "moe_expert_capacity_factor": None,
            "moe_grouped_gemm": False,
            # megatron's alltoall dispatcher creates torch.cuda.Stream objects in its constructor
            "moe_token_dispatcher_type": "alltoall" if torch.cuda.is_available() else "allgather",
        }

    # ---- weights ------------------------------------------------------------------------------
    def expert_hf_names(self, hf: str, expert: int) -> tuple[str, str, str]:
        """HF (gate, up, down) weight names of global ``expert`` in the layer prefixed ``hf``."""
        e = f"{hf}{self.hf_mlp}.experts.{expert}."
        return tuple(f"{e}{proj}.weight" for proj in self.hf_expert_projs)

    def mlp_mappings(self, hf: str, mg: str, hf_config, layer) -> list[ParamMapping]:
        moe = layer.mlp
        num_local = moe.num_local_experts
        ep = self.num_experts(hf_config) // num_local  # the layer was built for this ep
        out = [ParamMapping(f"{mg}mlp.router.weight", (f"{hf}{self.hf_mlp}.{self.hf_router}.weight",),
                            Replicated())]
        for slot, expert in enumerate(moe.local_expert_indices):
            per_rank = [self.expert_hf_names(hf, r * num_local + slot) for r in range(ep)]
            gate_up = tuple(names[:2] for names in per_rank)
            down = tuple(names[2:] for names in per_rank)
            gate, up, down_name = self.expert_hf_names(hf, expert)
            x = f"{mg}mlp.experts.local_experts.{slot}."
            out += [
                ParamMapping(f"{x}linear_fc1.weight", (gate, up), GatedFC1(), ep_hf_names=gate_up),
                ParamMapping(f"{x}linear_fc2.weight", (down_name,), TPSplit(dim=1), ep_hf_names=down),
            ]
        return out
