"""Mixtral (``model_type: mixtral``, e.g. Mixtral-8x7B): Llama's attention with a sparse MoE
block (``block_sparse_moe``) on every layer.

Router: top ``num_experts_per_tok`` of ``num_local_experts``, softmax over the k selected
logits (= the full softmax renormalised over them; see ``moe.py``). Experts' ``w1`` / ``w3`` /
``w2`` are the gate / up / down projections. Sliding-window attention and the training-time
router jitter are rejected (neither exists in the megatron model).
"""

from __future__ import annotations

from megatron_grpo.models.architectures.llama import LlamaArch
from megatron_grpo.models.architectures.moe import MoEMLP


class MixtralArch(MoEMLP, LlamaArch):
    model_type = "mixtral"
    hf_mlp = "block_sparse_moe"
    hf_expert_projs = ("w1", "w3", "w2")

    def validate(self, hf_config) -> None:
        super().validate(hf_config)
        window = getattr(hf_config, "sliding_window", None)
        if window is not None:
            self._unsupported(hf_config, "sliding_window", window, "null (full attention)")
        jitter = float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0)
        if jitter:
            self._unsupported(hf_config, "router_jitter_noise", jitter, 0.0)

    def num_experts(self, hf_config) -> int:
        return int(hf_config.num_local_experts)

    def normalize_topk(self, hf_config) -> bool:
        return True

    def moe_ffn_hidden_size(self, hf_config) -> int:
        return int(hf_config.intermediate_size)
