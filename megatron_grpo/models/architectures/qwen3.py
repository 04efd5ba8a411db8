"""Qwen3 dense (``model_type: qwen3``): the base decoder with an explicit ``head_dim`` and an
RMSNorm over each query and key head before RoPE (megatron's ``qk_layernorm``); no QKV bias."""

from __future__ import annotations

from megatron_grpo.models.architectures.base import DenseDecoderArch, ParamMapping
from megatron_grpo.models.layouts import Replicated


class Qwen3Arch(DenseDecoderArch):
    model_type = "qwen3"

    def validate(self, hf_config) -> None:
        super().validate(hf_config)
        if getattr(hf_config, "attention_bias", False):
            self._unsupported(hf_config, "attention_bias", True, False)

    def _arch_kwargs(self, hf_config) -> dict:
        return {"qk_layernorm": True}

    def attention_mappings(self, hf: str, mg: str, hf_config) -> list[ParamMapping]:
        weight_qkv, *rest = super().attention_mappings(hf, mg, hf_config)
        a = f"{hf}self_attn."
        # [head_dim] weights shared by all heads, hence identical on every TP rank.
        norms = [
            ParamMapping(f"{mg}self_attention.q_layernorm.weight", (f"{a}q_norm.weight",), Replicated()),
            ParamMapping(f"{mg}self_attention.k_layernorm.weight", (f"{a}k_norm.weight",), Replicated()),
        ]
        return [weight_qkv, *norms, *rest]
