"""Megatron-core GPT models built from Hugging Face configs, and their weights both ways.

Data flow::

    HF dir --load_hf_config--> PretrainedConfig --build_model--> [GPTModel chunk]  (this TP/PP rank)
    HF safetensors --load_hf_weights--> chunks --iter_hf_weights--> (HF name, full tensor)...
    chunks <--save/load_megatron_checkpoint--> dist checkpoint (any TP/PP) + hf/ metadata

``architectures/`` holds the registry keyed by HF ``model_type`` (llama, qwen2, qwen3): one
module per architecture over a shared dense-decoder base; ``layouts.py`` the tensor slicing
(fused QKV, gate/up, vocab padding, TP splits) both directions use.
"""

from megatron_grpo.models.architectures import ARCHITECTURES, get_architecture
from megatron_grpo.models.builder import (
    build_model,
    padded_vocab_size,
    transformer_config,
    use_transformer_engine,
)
from megatron_grpo.models.checkpoint import (
    checkpoint_hf_config,
    load_megatron_checkpoint,
    model_sharded_state_dict,
    save_megatron_checkpoint,
)
from megatron_grpo.models.errors import ModelError
from megatron_grpo.models.forward import forward_logits, gather_vocab
from megatron_grpo.models.hf_config import load_hf_config
from megatron_grpo.models.hf_export import save_hf_checkpoint
from megatron_grpo.models.weights import iter_hf_weights, load_hf_weights

__all__ = [
    "ARCHITECTURES",
    "ModelError",
    "build_model",
    "checkpoint_hf_config",
    "forward_logits",
    "gather_vocab",
    "get_architecture",
    "iter_hf_weights",
    "load_hf_config",
    "load_hf_weights",
    "load_megatron_checkpoint",
    "model_sharded_state_dict",
    "padded_vocab_size",
    "save_hf_checkpoint",
    "save_megatron_checkpoint",
    "transformer_config",
    "use_transformer_engine",
]
