"""Fused core attention for megatron-core's local layer spec: torch's scaled-dot-product
attention (SDPA) in place of megatron-core's ``DotProductAttention``.

megatron-core's local spec computes attention unfused (a [b, heads, s, s] score buffer, memory
quadratic in the length). ``SDPAttention`` has the same constructor and forward signature (it
drops into the spec's ``self_attention.submodules.core_attention``) and calls
``torch.nn.functional.scaled_dot_product_attention``: flash or memory-efficient kernels on CUDA,
the math kernel on CPU. It holds no parameters: checkpoints and the HF weight mapping are unchanged.

Layouts (megatron's names):

* ``sbhd`` (no ``packed_seq_params``): q [s, b, np, hn], k/v [s, b, ng, hn]; causal through
  ``is_causal`` (no mask tensor, so CUDA can pick flash).
* ``thd`` (packed, ``models.packing``): q [t, np, hn], k/v [t, ng, hn], rows concatenated along t
  with boundaries ``cu_seqlens_q``; attention stays inside each row (CPU: one call with a
  block-diagonal causal mask; CUDA: one causal call per row, a host loop).
* ``thd`` with a shared prefix (``BranchedSeqParams``): a query sees the keys of its segment not
  after it in the prefix or its own branch (``branched_mask``); on CUDA one call per segment.
* context parallelism (``models.context_parallel``): the query is the rank's chunks; keys and
  values are all-gathered over the CP group and masked by true positions (``sdpa_context_parallel``).

Departures from ``DotProductAttention``: attention dropout must be 0 (SDPA's dropout would draw
from another RNG stream than megatron's), only ``softmax_type: vanilla`` and no sliding window
(unused here; each is refused at construction). Why, and tests: docs/models.md#attention-and-packed-sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from megatron_grpo.models.context_parallel import gather_whole, sdpa_context_parallel


def attention_scale(config: TransformerConfig, layer_number: int, softmax_scale: Optional[float] = None) -> float:
    """The scale megatron's ``DotProductAttention`` applies to q.k: ``softmax_scale`` or
    1/sqrt(kv_channels), divided by the layer number with ``apply_query_key_layer_scaling``
    (kv_channels is the head dim, e.g. qwen3's explicit ``head_dim``)."""
    scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
    if config.apply_query_key_layer_scaling:
        scale /= max(1, layer_number)
    return scale


def block_causal_mask(cu_seqlens: Tensor, total: int) -> Tensor:
    """bool [total, total]: True where query i may attend to key j, i.e. j <= i and both in the
    same row of the pack. cu_seqlens [rows + 1] (0, ..., total). E.g. cu_seqlens (0, 2, 3) ->
    [[1,0,0],[1,1,0],[0,0,1]]."""
    positions = torch.arange(total, device=cu_seqlens.device)
    row = torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)  # [total]
    same_row = row.unsqueeze(0) == row.unsqueeze(1)
    return same_row & (positions.unsqueeze(0) <= positions.unsqueeze(1))


def branched_mask(cu_seqlens: Tensor, position: Tensor, branch: Tensor) -> Tensor:
    """bool [t, t]: True where query i may attend to key j: same segment, position[j] <=
    position[i], and j in the shared prefix (branch 0) or in i's branch. cu_seqlens [segments +
    1], position / branch long [t] (``models.packing``). With every branch 0 and positions
    restarting per segment this is ``block_causal_mask``. E.g. one segment, positions (0, 1, 1),
    branches (0, 1, 2) -> [[1,0,0],[1,1,0],[1,0,1]]."""
    total = position.shape[0]
    segment = torch.searchsorted(cu_seqlens[1:].to(torch.long), torch.arange(total, device=position.device), right=True)
    same_segment = segment.unsqueeze(0) == segment.unsqueeze(1)
    seen_branch = (branch.unsqueeze(0) == 0) | (branch.unsqueeze(0) == branch.unsqueeze(1))
    return same_segment & seen_branch & (position.unsqueeze(0) <= position.unsqueeze(1))


@dataclass
class BranchedSeqParams(PackedSeqParams):
    """megatron's thd ``PackedSeqParams`` plus each packed token's position id and branch
    (long [t]) and which segments hold a shared prefix (``models.packing``). The masks are
    built once per forward and reused by every layer. With no shared segment the attention
    is the plain packed one."""

    position: Optional[Tensor] = None
    branch: Optional[Tensor] = None
    segment_shared: tuple = ()
    _masks: dict = field(default_factory=dict, repr=False)

    def masks(self, per_row: bool):
        """per_row False: the whole pack's bool [t, t] mask, or None (plain block-causal); True:
        one entry per segment, its [l, l] ``branched_mask`` or None (plain causal)."""
        if not any(self.segment_shared):
            return None
        if per_row not in self._masks:
            cu = self.cu_seqlens_q
            if not per_row:
                self._masks[per_row] = branched_mask(cu, self.position, self.branch)
            else:
                bounds = cu.tolist()
                self._masks[per_row] = [
                    branched_mask(torch.tensor([0, e - s], device=cu.device), self.position[s:e], self.branch[s:e])
                    if shared else None
                    for s, e, shared in zip(bounds[:-1], bounds[1:], self.segment_shared)]
        return self._masks[per_row]


def sdpa_packed(q_THD: Tensor, k_TGD: Tensor, v_TGD: Tensor, cu_seqlens: Tensor, scale: float,
                per_row: bool, masks=None) -> Tensor:
    """Causal attention inside each segment of a pack. q [t, np, hn], k/v [t, ng, hn] (ng divides
    np: grouped-query attention), cu_seqlens [segments + 1] -> [t, np, hn]. ``masks``: None
    (each segment is one row) or ``BranchedSeqParams.masks(per_row)`` (shared prefixes).

    per_row False: one SDPA call with the [t, t] mask (``block_causal_mask`` without
    ``masks``); True: one SDPA call per segment, causal (no mask tensor) where the segment has
    no mask of its own (what CUDA runs). Both compute the same function."""
    gqa = q_THD.shape[1] != k_TGD.shape[1]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q_THD, k_TGD, v_TGD))  # [1, heads, t, hn]
    if not per_row:
        mask = block_causal_mask(cu_seqlens, q_THD.shape[0]) if masks is None else masks
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return out.squeeze(0).transpose(0, 1)
    bounds = cu_seqlens.tolist()
    masks = masks or [None] * (len(bounds) - 1)
    out = torch.cat([
        F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], attn_mask=mask,
                                       is_causal=mask is None, scale=scale, enable_gqa=gqa)
        for a, b, mask in zip(bounds[:-1], bounds[1:], masks)
    ], dim=2)
    return out.squeeze(0).transpose(0, 1)


class SDPAttention(MegatronModule):
    """megatron-core's core-attention interface (``DotProductAttention``'s signature) on
    ``scaled_dot_product_attention``; see the module docstring."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout != 0:
            raise ValueError(f"SDPAttention needs attention_dropout 0, got {dropout}")
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise ValueError(f"SDPAttention supports neither sliding windows nor softmax_type {config.softmax_type!r}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp = pg_collection.tp.size()
        cp_group = getattr(pg_collection, "cp", None)
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None
        self.attn_mask_type = attn_mask_type
        self.num_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_groups_per_partition = divide(config.num_query_groups, tp)
        self.softmax_scale = attention_scale(config, layer_number, softmax_scale)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> Tensor:
        """sbhd: q [s, b, np, hn], k/v [s, b, ng, hn] -> [s, b, np * hn]. thd: q [t, np, hn],
        k/v [t, ng, hn] -> [t, np * hn]. ``attention_mask`` (sbhd only): bool, True = masked
        out (megatron's convention), or None for the layer's mask type (causal here)."""
        assert attention_bias is None, "attention bias is not supported by SDPAttention"
        gqa = self.num_heads_per_partition != self.num_groups_per_partition
        if self.cp_group is not None:
            return self._context_parallel(query, key, value, attention_mask, packed_seq_params, gqa)
        if packed_seq_params is not None:
            assert packed_seq_params.qkv_format == "thd", packed_seq_params.qkv_format
            assert attention_mask is None, "a packed batch takes its mask from cu_seqlens"
            per_row = query.is_cuda
            masks = packed_seq_params.masks(per_row) if isinstance(packed_seq_params, BranchedSeqParams) else None
            out = sdpa_packed(query, key, value, packed_seq_params.cu_seqlens_q, self.softmax_scale, per_row, masks)
            return out.reshape(out.shape[0], -1)
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        if attention_mask is None:
            assert mask_type == AttnMaskType.causal or mask_type == AttnMaskType.no_mask, mask_type
            causal = mask_type == AttnMaskType.causal
            assert not causal or q.shape[2] == k.shape[2], "causal SDPA needs as many queries as keys"
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, np * hn]

    def _context_parallel(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                          packed_seq_params: Optional[PackedSeqParams], gqa: bool) -> Tensor:
        """``forward`` under context parallelism: the same shapes, the rank's tokens only (module
        docstring). The causal mask is the whole sequence's, from the layout."""
        assert attention_mask is None, "context parallelism takes its mask from the layout"
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        if packed_seq_params is None:  # sbhd: every row is one segment of S_loc * cp tokens
            lengths = [query.shape[0] * cp]
            q = query.permute(1, 2, 0, 3)  # [b, np, s_loc, hn]
            k, v = (gather_whole(x, lengths, self.cp_group).permute(1, 2, 0, 3) for x in (key, value))
        else:
            assert packed_seq_params.qkv_format == "thd", packed_seq_params.qkv_format
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            lengths = (cu[1:] - cu[:-1]).tolist()
            q = query.transpose(0, 1).unsqueeze(0)  # [1, np, t_loc, hn]
            k, v = (gather_whole(x, lengths, self.cp_group).transpose(0, 1).unsqueeze(0) for x in (key, value))
        out = sdpa_context_parallel(q, k, v, lengths, cp, rank, self.softmax_scale, gqa, per_chunk=query.is_cuda)
        if packed_seq_params is None:
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)  # [s_loc, b, np * hn]
        return out.squeeze(0).transpose(0, 1).reshape(query.shape[0], -1)  # [t_loc, np * hn]
