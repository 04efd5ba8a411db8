"""Qwen3-MoE (``model_type: qwen3_moe``, e.g. Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's
attention (per-head q/k RMSNorm, explicit head_dim) with a sparse MoE MLP on every layer.

Router: softmax over ``num_experts``, top ``num_experts_per_tok``, renormalised iff
``norm_topk_prob`` (see ``moe.py``). No shared experts. Checkpoints that mix dense MLP layers
in (``decoder_sparse_step`` > 1 or a non-empty ``mlp_only_layers``) are rejected: every layer
of the megatron model is built with the same MoE MLP.
"""

from __future__ import annotations

from megatron_grpo.models.architectures.moe import MoEMLP
from megatron_grpo.models.architectures.qwen3 import Qwen3Arch


class Qwen3MoeArch(MoEMLP, Qwen3Arch):
    model_type = "qwen3_moe"

    def validate(self, hf_config) -> None:
        super().validate(hf_config)
        step = getattr(hf_config, "decoder_sparse_step", 1)
        if step != 1:
            self._unsupported(hf_config, "decoder_sparse_step", step, "1 (every layer MoE)")
        dense = list(getattr(hf_config, "mlp_only_layers", None) or [])
        if dense:
            self._unsupported(hf_config, "mlp_only_layers", dense, "[] (every layer MoE)")

    def num_experts(self, hf_config) -> int:
        return int(hf_config.num_experts)

    def normalize_topk(self, hf_config) -> bool:
        return bool(getattr(hf_config, "norm_topk_prob", False))

    def moe_ffn_hidden_size(self, hf_config) -> int:
        return int(hf_config.moe_intermediate_size)
