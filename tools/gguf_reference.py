"""An independent Llama forward over a GGUF file's own tensors, to check a conversion against.

Nothing here comes from transformers or megatron_grpo: the ``gguf`` package reads the tensors
(``GGUFReader``) and dequantizes them (``gguf.quants.dequantize``), and a plain-torch forward
(RMSNorm, GQA attention with a causal mask, SwiGLU MLP, RoPE) uses them as llama.cpp stores
them. llama.cpp's converter permutes the rows of attn_q / attn_k within each head so that its
rotary embedding can rotate adjacent pairs (x[2i], x[2i+1]; GPT-J's layout), while HF's Llama
rotates the two halves (x[i], x[i + d/2]; NeoX's). transformers un-permutes on load; this
forward keeps the stored rows and rotates adjacent pairs, so a wrong (or missing)
un-permutation in a conversion shows up as a logit difference instead of being repeated here.
The permutation is the same for q and k of a head, so q·k, and with it every logit, agree.

GGUF lists a tensor's dims fastest first (``[in, out]`` for a linear weight), the reverse of
torch's ``[out, in]``; ``read_llama_weights`` checks every tensor against the torch-order shape
the file's metadata implies.

Used by ``tools/fetch_smollm2.py --check`` and ``tests/test_smollm2_fetch.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGUFReader
from gguf.quants import dequantize


@dataclass(frozen=True, kw_only=True)
class LlamaShape:
    """A llama GGUF's hyper-parameters, read from its ``llama.*`` metadata."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    rope_theta: float
    rms_eps: float
    tied: bool  # no output.weight: the LM head is token_embd


def _field(reader: GGUFReader, key: str, default=None):
    """The value of metadata ``key``; ``default`` when absent (ValueError when that is None)."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF metadata key {key!r} missing")
        return default
    return field.contents()


def read_shape(reader: GGUFReader) -> LlamaShape:
    """The shape of a ``general.architecture: llama`` GGUF; ValueError for another one."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture is {arch!r}, expected 'llama'")
    hidden, heads = _field(reader, "llama.embedding_length"), _field(reader, "llama.attention.head_count")
    vocab = _field(reader, "llama.vocab_size", 0) or len(_field(reader, "tokenizer.ggml.tokens"))
    return LlamaShape(
        num_layers=_field(reader, "llama.block_count"), hidden_size=hidden, num_heads=heads,
        num_kv_heads=_field(reader, "llama.attention.head_count_kv", heads),
        head_dim=_field(reader, "llama.attention.key_length", hidden // heads),
        ffn_size=_field(reader, "llama.feed_forward_length"), vocab_size=vocab,
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        tied="output.weight" not in {t.name for t in reader.tensors})


def expected_shapes(shape: LlamaShape) -> dict[str, tuple[int, ...]]:
    """Every tensor's name -> its shape in torch order (``[out, in]`` for a linear weight)."""
    h, ffn = shape.hidden_size, shape.ffn_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    out = {"token_embd.weight": (shape.vocab_size, h), "output_norm.weight": (h,)}
    if not shape.tied:
        out["output.weight"] = (shape.vocab_size, h)
    for i in range(shape.num_layers):
        out |= {f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.attn_q.weight": (q, h),
                f"blk.{i}.attn_k.weight": (kv, h), f"blk.{i}.attn_v.weight": (kv, h),
                f"blk.{i}.attn_output.weight": (h, q), f"blk.{i}.ffn_norm.weight": (h,),
                f"blk.{i}.ffn_gate.weight": (ffn, h), f"blk.{i}.ffn_up.weight": (ffn, h),
                f"blk.{i}.ffn_down.weight": (h, ffn)}
    return out


def read_llama_weights(reader: GGUFReader) -> tuple[LlamaShape, dict[str, torch.Tensor]]:
    """``(shape, {GGUF name: float32 tensor in torch order})`` of an open GGUF file; ValueError
    when a tensor is missing, unexpected, or of another shape than the metadata implies."""
    gguf_path = reader.data.filename
    try:
        shape = read_shape(reader)
    except ValueError as e:
        raise ValueError(f"{gguf_path}: {e}") from None
    expected = expected_shapes(shape)
    weights = {}
    for tensor in reader.tensors:
        listed = tuple(int(d) for d in reversed(tensor.shape))  # GGUF: fastest dim first
        values = dequantize(tensor.data, tensor.tensor_type)  # numpy, already in torch order
        if tensor.name not in expected or listed != expected[tensor.name] or values.shape != listed:
            raise ValueError(f"{gguf_path}: tensor {tensor.name} has GGUF dims {list(tensor.shape)} "
                             f"(dequantized {values.shape}), expected torch shape {expected.get(tensor.name)}")
        weights[tensor.name] = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy
    if missing := sorted(set(expected) - set(weights)):
        raise ValueError(f"{gguf_path}: tensors missing: {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    return shape, weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` [..., H] normalised by its root mean square, times ``weight`` [H]."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotary_angles(num_tokens: int, head_dim: int, theta: float) -> torch.Tensor:
    """[T, D/2]: position t times frequency theta^(-2i/D)."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (torch.arange(num_tokens, dtype=torch.float64)[:, None] * freqs[None]).float()


def rotate_adjacent_pairs(x_TND: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's rotary embedding (GPT-J layout): pair i of a head is (x[2i], x[2i+1])."""
    angles = rotary_angles(x_TND.shape[0], x_TND.shape[-1], theta)[:, None]  # [T, 1, D/2]
    cos, sin = angles.cos(), angles.sin()
    even, odd = x_TND[..., 0::2], x_TND[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


Rotary = Callable[[torch.Tensor, float], torch.Tensor]


def attention(h_TH: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, shape: LlamaShape,
              rotate: Rotary) -> torch.Tensor:
    """Causal grouped-query self-attention of one layer: [T, H] -> [T, H]."""
    T, D = h_TH.shape[0], shape.head_dim
    q = rotate((h_TH @ w[prefix + "attn_q.weight"].T).view(T, shape.num_heads, D), shape.rope_theta)
    k = rotate((h_TH @ w[prefix + "attn_k.weight"].T).view(T, shape.num_kv_heads, D), shape.rope_theta)
    v = (h_TH @ w[prefix + "attn_v.weight"].T).view(T, shape.num_kv_heads, D)
    group = shape.num_heads // shape.num_kv_heads  # query heads per KV head, consecutive
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("tnd,snd->nts", q, k) / D**0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("nts,snd->tnd", scores.softmax(-1), v).reshape(T, shape.num_heads * D)
    return out @ w[prefix + "attn_output.weight"].T


def swiglu_mlp(h_TH: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """[T, H] -> [T, H]: down(silu(gate(h)) * up(h))."""
    gate, up = h_TH @ w[prefix + "ffn_gate.weight"].T, h_TH @ w[prefix + "ffn_up.weight"].T
    return (F.silu(gate) * up) @ w[prefix + "ffn_down.weight"].T


@torch.no_grad()
def llama_logits(shape: LlamaShape, w: dict[str, torch.Tensor], ids_T: torch.Tensor,
                 rotate: Rotary = rotate_adjacent_pairs) -> torch.Tensor:
    """Logits [T, V] of one sequence of token ids [T]. ``rotate``: the rotary embedding (a test
    swaps in the half rotation to show the comparison notices the layout)."""
    x = w["token_embd.weight"][ids_T]
    for i in range(shape.num_layers):
        prefix = f"blk.{i}."
        x = x + attention(rms_norm(x, w[prefix + "attn_norm.weight"], shape.rms_eps), w, prefix, shape, rotate)
        x = x + swiglu_mlp(rms_norm(x, w[prefix + "ffn_norm.weight"], shape.rms_eps), w, prefix)
    head = w["token_embd.weight" if shape.tied else "output.weight"]
    return rms_norm(x, w["output_norm.weight"], shape.rms_eps) @ head.T


def max_logit_diff(expected: list[torch.Tensor], shape: LlamaShape, w: dict[str, torch.Tensor],
                   sequences: list[list[int]], rotate: Rotary = rotate_adjacent_pairs) -> float:
    """max |Δlogit| between ``expected[i]`` [T_i, V] (e.g. a converted model's logits) and
    ``llama_logits`` of ``sequences[i]``, over every position of every sequence."""
    return max((logits.float() - llama_logits(shape, w, torch.tensor(ids), rotate)).abs().max().item()
               for logits, ids in zip(expected, sequences, strict=True))
