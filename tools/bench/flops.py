"""Parameter counts and model FLOPs of a decoder from its Hugging Face config, and MFU.

Pure arithmetic (no torch): the numbers behind ``tools/bench/bench_gpu.py``'s MFU column and
``tools/bench/make_sized_model.py``'s parameter counts; the formula is written out in
docs/gpu.md#flops-and-mfu.

FLOPs convention (PaLM's "model FLOPs", appendix B of Chowdhery et al. 2022; Megatron-LM's
MFU, Narayanan et al. 2021): only matrix multiplications count, 2 FLOPs per multiply-add;
norms, activations, softmax, rotary embeddings, biases and the embedding lookup are left out.
Per token of a sequence of ``s`` tokens, one forward:

* attention projections: ``2 h (q + 2 kv) + 2 q h`` with ``q = heads * head_dim`` and
  ``kv = kv_heads * head_dim`` (the q, k, v and output projections);
* attention scores and values: ``2 * 2 q s`` -- the FULL ``s x s`` matrices of ``Q K^T`` and
  ``A V`` are counted, not the causal half (PaLM's ``12 L H Q T`` for a training step and
  Megatron-LM's formula do the same; FlashAttention's own FLOP counter halves it for causal
  masks, so an attention kernel does about half of this term);
* MLP: ``3 * 2 h f`` (gate, up, down; SwiGLU), or for a mixture of experts only the ``k``
  experts a token is routed to, ``k * 3 * 2 h f_expert``, plus the router ``2 h E``;
* LM head: ``2 h V`` (V the config's vocab_size, not megatron's padded one).

All per layer, times the layers, plus the LM head. A training step is forward + backward =
3 x forward (the backward computes gradients of activations and of weights: 2 x). Activation
recomputation re-runs forwards but does NOT add model FLOPs: MFU counts the model's work, not
the hardware's (that would be HFU). Padding tokens are not counted either: callers pass the
real sequence lengths.

MFU = achieved model FLOP/s / the GPU's specified dense bf16 peak (``PEAK_BF16_TFLOPS``, keyed
by ``torch.cuda.get_device_name()``'s exact string; an unknown name gives no MFU, never a
guess).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

PEAK_BF16_TFLOPS: dict[str, float] = {
    # the datasheets' dense (no 2:4 sparsity) bf16 tensor-core peaks
    "NVIDIA H100 80GB HBM3": 989.0,  # H100 SXM5
    "NVIDIA H200": 989.0,  # H200 SXM
    "NVIDIA H100 PCIe": 756.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0,
}
"""Specified dense bf16 peak in TFLOP/s by ``torch.cuda.get_device_name()``."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a decoder that set its parameters and FLOPs (read from an HF config)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """Dense MLP width (unused when ``num_experts`` > 0)."""
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    """A bias on q, k and v (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k (Qwen3): ``2 * head_dim`` weights per layer."""
    num_experts: int = 0
    """0: dense MLP; else experts per MoE layer (every layer)."""
    experts_per_token: int = 0
    moe_intermediate_size: int = 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelShape":
        """From a ``transformers.PretrainedConfig`` or a config.json mapping (llama, qwen2,
        qwen3, qwen3_moe, mixtral)."""
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        model_type = get("model_type")
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        num_experts = int(get("num_experts") or get("num_local_experts") or 0)
        return cls(
            hidden_size=hidden,
            num_layers=int(get("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or hidden // heads),
            intermediate_size=int(get("intermediate_size")),
            vocab_size=int(get("vocab_size")),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            num_experts=num_experts,
            experts_per_token=int(get("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=(int(get("moe_intermediate_size") or get("intermediate_size"))
                                   if num_experts else 0),
        )


@dataclass(frozen=True)
class ParameterCount:
    """Parameters of a model: ``total``; ``embedding`` (input embedding + untied LM head);
    ``active``: those one token uses (the routed experts only, for MoE)."""

    total: int
    embedding: int
    active: int

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def _attention_params(s: ModelShape) -> int:
    weights = s.hidden_size * (s.q_dim + 2 * s.kv_dim) + s.q_dim * s.hidden_size
    bias = (s.q_dim + 2 * s.kv_dim) if s.qkv_bias else 0
    norms = 2 * s.head_dim if s.qk_norm else 0
    return weights + bias + norms


def _expert_params(s: ModelShape) -> int:
    return 3 * s.hidden_size * (s.moe_intermediate_size if s.num_experts else s.intermediate_size)


def count_parameters(s: ModelShape) -> ParameterCount:
    """Every parameter of the HF model (what ``model.num_parameters()`` reports)."""
    embedding = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    layer_norms = 2 * s.hidden_size
    if s.num_experts:
        router = s.hidden_size * s.num_experts
        mlp_total = s.num_experts * _expert_params(s) + router
        mlp_active = s.experts_per_token * _expert_params(s) + router
    else:
        mlp_total = mlp_active = _expert_params(s)
    per_layer = _attention_params(s) + layer_norms
    final_norm = s.hidden_size
    total = embedding + s.num_layers * (per_layer + mlp_total) + final_norm
    active = embedding + s.num_layers * (per_layer + mlp_active) + final_norm
    return ParameterCount(total=total, embedding=embedding, active=active)


def forward_flops_per_token(s: ModelShape, seq_len: float) -> float:
    """Model FLOPs of one forward per token of a sequence of ``seq_len`` tokens (see the
    module docstring for what counts)."""
    h = s.hidden_size
    projections = 2 * h * (s.q_dim + 2 * s.kv_dim) + 2 * s.q_dim * h
    scores = 2 * 2 * s.q_dim * seq_len  # Q K^T and A V, the full s x s matrices
    if s.num_experts:
        mlp = s.experts_per_token * 2 * _expert_params(s) + 2 * h * s.num_experts
    else:
        mlp = 2 * _expert_params(s)
    lm_head = 2 * h * s.vocab_size
    return s.num_layers * (projections + scores + mlp) + lm_head


def forward_flops(s: ModelShape, seq_lens: Iterable[int]) -> float:
    """Model FLOPs of one forward over sequences of these lengths (real tokens, no padding)."""
    return sum(n * forward_flops_per_token(s, n) for n in seq_lens)


def train_flops(s: ModelShape, seq_lens: Iterable[int]) -> float:
    """Model FLOPs of forward + backward (3 x forward) over sequences of these lengths."""
    return 3 * forward_flops(s, seq_lens)


def peak_bf16_flops(device_name: str) -> Optional[float]:
    """The specified dense bf16 peak (FLOP/s) of ``device_name``; None when not in the table."""
    tflops = PEAK_BF16_TFLOPS.get(device_name)
    return None if tflops is None else tflops * 1e12


def mfu(model_flops: float, seconds: float, device_name: str) -> Optional[float]:
    """Model FLOPs utilisation: ``model_flops / seconds`` over the device's specified peak;
    None for a device not in ``PEAK_BF16_TFLOPS``."""
    peak = peak_bf16_flops(device_name)
    return None if peak is None or seconds <= 0 else model_flops / seconds / peak
