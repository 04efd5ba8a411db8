"""Qwen2 / Qwen2.5 (``model_type: qwen2``): the base decoder plus a bias on q/k/v (not on
o_proj nor the MLP), fused like the weights into ``linear_qkv.bias``."""

from __future__ import annotations

from megatron_grpo.models.architectures.base import DenseDecoderArch, ParamMapping


class Qwen2Arch(DenseDecoderArch):
    model_type = "qwen2"

    def _arch_kwargs(self, hf_config) -> dict:
        return {"add_qkv_bias": True}

    def attention_mappings(self, hf: str, mg: str, hf_config) -> list[ParamMapping]:
        weight_qkv, *rest = super().attention_mappings(hf, mg, hf_config)
        a = f"{hf}self_attn."
        bias_qkv = ParamMapping(
            f"{mg}self_attention.linear_qkv.bias",
            (f"{a}q_proj.bias", f"{a}k_proj.bias", f"{a}v_proj.bias"),
            weight_qkv.layout,  # same per-group interleaving and TP split as the weight rows
        )
        return [weight_qkv, bias_qkv, *rest]
