"""Llama (``model_type: llama``; also Llama 3.x with llama3 rope scaling): the base decoder,
without any linear bias."""

from __future__ import annotations

from megatron_grpo.models.architectures.base import DenseDecoderArch


class LlamaArch(DenseDecoderArch):
    model_type = "llama"

    def validate(self, hf_config) -> None:
        super().validate(hf_config)
        # Megatron's add_bias_linear would put a bias on every linear layer, not only the ones
        # llama's flags name: reject rather than approximate.
        for key in ("attention_bias", "mlp_bias"):
            if getattr(hf_config, key, False):
                self._unsupported(hf_config, key, True, False)
