"""Registry of supported architectures, keyed by the HF ``config.json`` ``model_type``.

Adding an architecture = one module here with a ``DenseDecoderArch`` subclass overriding the
hooks that differ, plus one line in ``ARCHITECTURES`` (see docs/models.md#adding-an-architecture).
Mixture-of-experts architectures put the ``moe.MoEMLP`` mixin before a dense one.
"""

from __future__ import annotations

from megatron_grpo.models.architectures.base import TE_ALIASES, DenseDecoderArch, ParamMapping
from megatron_grpo.models.architectures.llama import LlamaArch
from megatron_grpo.models.architectures.mixtral import MixtralArch
from megatron_grpo.models.architectures.qwen2 import Qwen2Arch
from megatron_grpo.models.architectures.qwen3 import Qwen3Arch
from megatron_grpo.models.architectures.qwen3_moe import Qwen3MoeArch
from megatron_grpo.models.errors import ModelError

ARCHITECTURES: dict[str, DenseDecoderArch] = {
    arch.model_type: arch
    for arch in (LlamaArch(), Qwen2Arch(), Qwen3Arch(), Qwen3MoeArch(), MixtralArch())
}


def get_architecture(model_type: str, where: str = "config.json") -> DenseDecoderArch:
    """The architecture for ``model_type``; ModelError naming the supported ones otherwise."""
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise ModelError(
            f"{where}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        ) from None


__all__ = ["ARCHITECTURES", "DenseDecoderArch", "ParamMapping", "TE_ALIASES", "get_architecture"]
