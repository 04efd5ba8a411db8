"""The dense pre-norm decoder shared by llama, qwen2 and qwen3: config and weight mapping.

An architecture answers two questions, both from the HF ``config.json`` alone:

* ``transformer_config_kwargs(hf_config)``: the architecture part of megatron's
  ``TransformerConfig`` (sizes, GQA, norm, activation, biases) and ``gpt_model_kwargs``: the
  ``GPTModel`` arguments (rotary base and scaling, tied embeddings);
* ``chunk_mappings(chunk, hf_config)``: for one ``GPTModel`` chunk (any PP stage), the list of
  ``ParamMapping`` HF tensors <-> Megatron parameter, with the ``Layout`` that slices them.

Subclasses override the few hooks that differ (``attention_mappings``, ``_arch_kwargs``,
``validate``): qwen2 adds the QKV bias, qwen3 the per-head q/k RMSNorm.

Names are those of megatron-core's *local* layer spec. The transformer-engine spec fuses the
pre-attention / pre-MLP norms into the following linear layer; ``TE_ALIASES`` translates
(megatron-core's own ``sharded_state_dict_keys_map`` does the same for checkpoints, which is
why checkpoints are interchangeable between the two specs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from megatron_grpo.models.errors import ModelError
from megatron_grpo.models.layouts import (
    FusedQKV,
    GatedFC1,
    Layout,
    Replicated,
    TPSplit,
    VocabSplit,
)

# local-spec name suffix -> transformer-engine-spec name suffix
TE_ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}

# megatron-core's RotaryEmbedding hard-codes these llama3 scaling constants (Llama 3.1/3.2 use
# them); any other values would silently change the frequencies, so they are rejected.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter of a chunk and the HF tensors it is made of."""

    megatron_name: str
    """Parameter name inside the GPTModel chunk (local spec, chunk-local layer index)."""
    hf_names: tuple[str, ...]
    """HF tensor names, in the order the layout expects."""
    layout: Layout
    exported: bool = True
    """False for the last PP stage's copy of tied embeddings: exporters skip it (the HF
    model has no lm_head.weight when embeddings are tied)."""
    ep_hf_names: tuple[tuple[str, ...], ...] = ()
    """Expert parameters only: the ``hf_names`` of this local expert slot on every expert-
    parallel rank, ordered by EP rank (this rank's own included). Its layout then splits over
    the expert-tensor-parallel group, and exporters gather the slot over the EP group."""

    @property
    def is_expert(self) -> bool:
        return bool(self.ep_hf_names)


class DenseDecoderArch:
    """Llama-style decoder: RMSNorm pre-norm, GQA attention with RoPE, SwiGLU MLP."""

    model_type = "llama"

    # ---- config ---------------------------------------------------------------------------
    def validate(self, hf_config) -> None:
        """Raise ModelError for HF features this mapping does not reproduce exactly."""
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            self._unsupported(hf_config, "hidden_act", act, "silu")
        layer_types = getattr(hf_config, "layer_types", None) or []
        if getattr(hf_config, "use_sliding_window", False) or any(
            t != "full_attention" for t in layer_types
        ):
            self._unsupported(hf_config, "use_sliding_window/layer_types", "sliding attention",
                              "full attention on every layer")
        if hf_config.num_attention_heads % hf_config.num_key_value_heads:
            self._unsupported(hf_config, "num_key_value_heads", hf_config.num_key_value_heads,
                              "a divisor of num_attention_heads")
        self.rope_kwargs(hf_config)  # raises for unsupported rope types

    def head_dim(self, hf_config) -> int:
        explicit = getattr(hf_config, "head_dim", None)
        return int(explicit or hf_config.hidden_size // hf_config.num_attention_heads)

    def transformer_config_kwargs(self, hf_config) -> dict:
        """Architecture fields of megatron's TransformerConfig, from config.json alone."""
        self.validate(hf_config)
        return {**dict(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            ffn_hidden_size=hf_config.intermediate_size,
            num_attention_heads=hf_config.num_attention_heads,
            num_query_groups=hf_config.num_key_value_heads,
            kv_channels=self.head_dim(hf_config),
            normalization="RMSNorm",
            layernorm_epsilon=hf_config.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            qk_layernorm=False,
            attention_dropout=0.0,
            hidden_dropout=0.0,
        ), **self._arch_kwargs(hf_config)}

    def _arch_kwargs(self, hf_config) -> dict:
        """Overrides of ``transformer_config_kwargs`` for a subclass (e.g. add_qkv_bias)."""
        return {}

    def rope_kwargs(self, hf_config) -> dict:
        """GPTModel rotary arguments. HF >= 5 keeps them in ``rope_parameters``, older
        versions in ``rope_theta`` + ``rope_scaling``."""
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        rope.update(getattr(hf_config, "rope_scaling", None) or {})
        base = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        kwargs = dict(position_embedding_type="rope", rotary_base=base, rotary_percent=1.0)
        if rope_type == "default":
            return kwargs
        if rope_type == "llama3" and all(
            float(rope.get(k, -1)) == v for k, v in _MEGATRON_LLAMA3_ROPE.items()
        ):
            return kwargs | dict(rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
        self._unsupported(hf_config, "rope_parameters.rope_type", rope_type,
                          f"default, or llama3 with {_MEGATRON_LLAMA3_ROPE}")

    def gpt_model_kwargs(self, hf_config) -> dict:
        return dict(
            max_sequence_length=hf_config.max_position_embeddings,
            share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
            **self.rope_kwargs(hf_config),
        )

    def _unsupported(self, hf_config, key, value, accepted) -> None:
        raise ModelError(
            f"{self.model_type}: config.json {key}={value!r} is not supported (accepted: {accepted})"
        )

    # ---- weights --------------------------------------------------------------------------
    def attention_mappings(self, hf: str, mg: str, hf_config) -> list[ParamMapping]:
        """``hf``/``mg``: the layer's name prefixes ('model.layers.7.', 'decoder.layers.3.')."""
        qkv = FusedQKV(hf_config.num_attention_heads, hf_config.num_key_value_heads,
                       self.head_dim(hf_config))
        a = f"{hf}self_attn."
        return [
            ParamMapping(f"{mg}self_attention.linear_qkv.weight",
                         (f"{a}q_proj.weight", f"{a}k_proj.weight", f"{a}v_proj.weight"), qkv),
            ParamMapping(f"{mg}self_attention.linear_proj.weight", (f"{a}o_proj.weight",),
                         TPSplit(dim=1)),
        ]

    def mlp_mappings(self, hf: str, mg: str, hf_config, layer) -> list[ParamMapping]:
        """``layer``: the megatron TransformerLayer (MoE architectures read its experts)."""
        m = f"{hf}mlp."
        return [
            ParamMapping(f"{mg}mlp.linear_fc1.weight", (f"{m}gate_proj.weight", f"{m}up_proj.weight"),
                         GatedFC1()),
            ParamMapping(f"{mg}mlp.linear_fc2.weight", (f"{m}down_proj.weight",), TPSplit(dim=1)),
        ]

    def layer_mappings(self, hf_layer: int, local_layer: int, hf_config, layer) -> list[ParamMapping]:
        hf, mg = f"model.layers.{hf_layer}.", f"decoder.layers.{local_layer}."
        return [
            ParamMapping(f"{mg}input_layernorm.weight", (f"{hf}input_layernorm.weight",), Replicated()),
            *self.attention_mappings(hf, mg, hf_config),
            ParamMapping(f"{mg}pre_mlp_layernorm.weight", (f"{hf}post_attention_layernorm.weight",),
                         Replicated()),
            *self.mlp_mappings(hf, mg, hf_config, layer),
        ]

    def chunk_mappings(self, chunk, hf_config) -> list[ParamMapping]:
        """All parameters of one GPTModel chunk (its PP stage decides which ends it has)."""
        vocab = VocabSplit(hf_config.vocab_size, chunk.vocab_size)
        tied = bool(hf_config.tie_word_embeddings)
        out: list[ParamMapping] = []
        if chunk.pre_process:
            out.append(ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                                    vocab))
        for local, layer in enumerate(chunk.decoder.layers):
            # layer_number is megatron's 1-based global index (includes the PP stage offset)
            out += self.layer_mappings(layer.layer_number - 1, local, hf_config, layer)
        if chunk.post_process:
            out.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",),
                                    Replicated()))
            if not tied:
                out.append(ParamMapping("output_layer.weight", ("lm_head.weight",), vocab))
            elif not chunk.pre_process:
                # Tied and PP > 1: the last stage holds its own copy of the embeddings.
                out.append(ParamMapping("output_layer.weight", ("model.embed_tokens.weight",),
                                        vocab, exported=False))
        return out
