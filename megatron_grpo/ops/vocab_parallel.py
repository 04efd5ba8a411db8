"""Per-token log-probabilities and entropies from vocab-parallel logits, without gathering V.

Megatron's output layer leaves each tensor-parallel rank with a slice of the vocabulary:
rank ``r`` of ``tp`` holds columns ``[r * V_shard, (r + 1) * V_shard)`` of the padded
vocabulary (``VocabUtility.vocab_range_from_per_partition_vocab_size``). GRPO needs, for
every response token, ``log p(target)`` and the entropy ``H(p)`` of ``p = softmax(logits / T)``
with gradients. ``vocab_parallel_log_probs`` computes both in one ``autograd.Function``:

forward (no logits-sized state is kept):
  1. per chunk of tokens, on this rank's valid columns only: local max ``m_r``, local
     ``S_r = sum exp(z - m_r)``, local ``D_r = sum exp(z - m_r) * (z - m_r)`` (entropy) and
     the target's ``z_t - m_r`` when the target lives on this rank;
  2. two small all-reduces over the TP group for *all* tokens at once (MAX of ``m_r``, then
     SUM of the rescaled ``[S_r, D_r, t_r]``), so the number of collectives does not grow
     with the number of chunks;
  3. ``log p_t = z_t - M - log S`` and ``H = log S - D / S`` with ``M = max_r m_r``.

backward (no collective: every rank already has ``log Z`` and ``H`` per token), per chunk:
  ``log p = z - log Z`` and ``p = exp(log p)`` are recomputed from the logits (which autograd
  keeps alive anyway as the input), then
  ``d/dz log p_t = onehot(t) - p`` and ``d/dz H = -p * (log p + H)``, both times ``1 / T``
  for the logits.

Why recompute rather than save the softmax (what megatron's cross-entropy does): the softmax
is a second logits-sized float32 tensor, and on CPU a chunk that fits in the cache makes the
recomputation cheaper than streaming a saved softmax through DRAM. Peak extra memory is the
logits gradient (one shard, unavoidable) plus two ``[chunk, V_shard]`` float32 work buffers.

Padded vocabulary: columns at or beyond ``vocab_size`` (Megatron pads V to a multiple of
``make_vocab_size_divisible_by * tp``) do not exist in the HF model or the rollout engine.
They are excluded from every reduction, i.e. they get probability exactly 0 and gradient 0,
and never produce NaN (not even on a rank that holds only padding).

Preconditions (not checked, to avoid a device sync): ``0 <= targets < vocab_size``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

# Work-buffer budget per chunk, in float32 elements, when chunk_size is None. On CPU the
# two [chunk, V_shard] buffers should stay inside the last-level cache (multi-MB), which is
# what makes the chunked recomputation fast; on GPU a larger chunk keeps kernels big while
# the buffers stay a small fraction of a logits shard.
_AUTO_CHUNK_ELEMENTS = {"cpu": 1 << 19, "cuda": 1 << 24}
_DEFAULT_CHUNK_ELEMENTS = 1 << 22


def resolve_tp_group(tp_group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The tensor-parallel group to reduce over: ``tp_group`` if given; else megatron's TP
    group when model parallelism is initialised; else None (a single, local rank)."""
    if tp_group is not None:
        return tp_group
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return None


def auto_chunk_size(num_cols: int, device: torch.device) -> int:
    """Tokens per chunk so that one ``[chunk, num_cols]`` float32 buffer fits the budget."""
    budget = _AUTO_CHUNK_ELEMENTS.get(device.type, _DEFAULT_CHUNK_ELEMENTS)
    return max(1, budget // max(1, num_cols))


def _group_size_and_rank(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _local_stats(
    logits_2d: torch.Tensor,
    local_targets: torch.Tensor,
    owned: torch.Tensor,
    num_valid: int,
    inv_temperature: float,
    chunk_size: int,
    with_entropy: bool,
) -> torch.Tensor:
    """This rank's per-token softmax statistics relative to its own max.

    logits_2d: [N, V_shard] (any float dtype); local_targets: [N] int64 column on this rank
    (0 where not owned); owned: [N] bool. Returns stats [4, N] float64 rows: the local max
    logit m_r over the valid columns (raw logit units) and, with z = (logits - m_r) / T,
    S_r = sum exp(z), D_r = sum exp(z) * z (0 without entropy), t_r = z_target (0 if not owned).

    Precision: subtracting the max before scaling keeps z's rounding relative to z itself;
    the max element's exp(0) = 1 is left out of the float32 sum and added back in float64,
    so log S stays accurate when S is close to 1 (a peaked distribution, small entropy).
    """
    num_tokens, device = logits_2d.shape[0], logits_2d.device
    stats = torch.zeros(4, num_tokens, dtype=torch.float32, device=device)
    if num_valid == 0:  # a rank holding only vocabulary padding contributes nothing
        stats[0].fill_(float("-inf"))
        return stats.double()
    rows = min(chunk_size, num_tokens)
    # Reused work buffers: a fresh large allocation per chunk would cost page faults on CPU.
    shifted = torch.empty(rows, num_valid, dtype=torch.float32, device=device)
    exps = torch.empty_like(shifted)
    argmax = torch.empty(rows, dtype=torch.long, device=device)
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        z, e, top = shifted[: end - start], exps[: end - start], argmax[: end - start]
        z.copy_(logits_2d[start:end, :num_valid])
        m = stats[0, start:end]
        torch.max(z, dim=-1, out=(m, top))
        z.sub_(m.unsqueeze(-1))
        if inv_temperature != 1.0:
            z.mul_(inv_temperature)
        stats[3, start:end] = z.gather(-1, local_targets[start:end].unsqueeze(-1)).squeeze(-1)
        torch.exp(z, out=e)
        e.scatter_(-1, top.unsqueeze(-1), 0.0)  # the max's 1, added back below in float64
        torch.sum(e, dim=-1, out=stats[1, start:end])
        if with_entropy:
            # Row-wise dot product without materialising e * z.
            torch.bmm(e.unsqueeze(-2), z.unsqueeze(-1), out=stats[2, start:end].view(-1, 1, 1))
    stats = stats.double()
    stats[1] += 1.0
    stats[3].masked_fill_(~owned, 0.0)
    return stats


def _combine_over_ranks(
    stats: torch.Tensor,
    owned: torch.Tensor,
    inv_temperature: float,
    group: Optional[dist.ProcessGroup],
    tp: int,
) -> torch.Tensor:
    """Merge per-rank statistics [4, N] into global ones, in place: rows become (M, S, D, t)
    with M the global max logit and z = (logits - M) / T. Two all-reduces for all tokens."""
    if tp == 1:
        return stats
    local_max = stats[0].clone()
    dist.all_reduce(stats[0], op=dist.ReduceOp.MAX, group=group)
    delta = (local_max - stats[0]) * inv_temperature  # <= 0; -inf on a padding-only rank
    scale = torch.exp(delta)
    # D_r relative to M: sum e_r * exp(delta) * ((z - m_r) + delta). where() keeps a
    # padding-only rank (S_r = 0, delta = -inf) from producing 0 * inf = NaN.
    stats[2] = torch.where(stats[1] > 0, scale * (stats[2] + delta * stats[1]), 0.0)
    stats[1].mul_(scale)
    stats[3] = torch.where(owned, stats[3] + delta, 0.0)
    dist.all_reduce(stats[1:], op=dist.ReduceOp.SUM, group=group)
    return stats


class _VocabParallelLogProbs(torch.autograd.Function):
    """(logits shard [N, V_shard], targets [N]) -> (log p_target [N], entropy [N] or [0])."""

    @staticmethod
    def forward(ctx, logits_2d, targets, group, tp, rank, inv_temperature, num_valid, chunk_size, with_entropy):
        vocab_start = rank * logits_2d.shape[-1]
        owned = (targets >= vocab_start) & (targets < vocab_start + num_valid)
        local_targets = torch.where(owned, targets - vocab_start, 0)
        stats = _local_stats(
            logits_2d, local_targets, owned, num_valid, inv_temperature, chunk_size, with_entropy
        )
        # The [4, N] statistics are combined in float64 (cheap: O(tokens)); H = log S - D / S
        # adds two non-negative terms (D <= 0), so no cancellation.
        stats = _combine_over_ranks(stats, owned, inv_temperature, group, tp)
        log_sum = torch.log(stats[1])
        log_probs = (stats[3] - log_sum).float()
        entropy = (log_sum - stats[2] / stats[1]).float() if with_entropy else log_sum.new_empty(0)
        # M is a logit value, exact in float32; backward recomputes log p = (x - M) / T - log S.
        max_logit, log_sum = stats[0].float(), log_sum.float()
        ctx.save_for_backward(logits_2d, local_targets, owned, max_logit, log_sum, entropy)
        ctx.inv_temperature, ctx.num_valid, ctx.chunk_size = inv_temperature, num_valid, chunk_size
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits_2d, local_targets, owned, max_logit, log_sum, entropy = ctx.saved_tensors
        grad_logits = _logits_grad(
            logits_2d, local_targets, owned, max_logit, log_sum, entropy, grad_log_probs,
            grad_entropy if entropy.numel() else None,
            ctx.inv_temperature, ctx.num_valid, ctx.chunk_size,
        )
        return grad_logits, None, None, None, None, None, None, None, None


def _logits_grad(
    logits_2d, local_targets, owned, max_logit, log_sum, entropy, grad_log_probs, grad_entropy,
    inv_temperature, num_valid, chunk_size,
):
    """d(loss)/d(logits) [N, V_shard] in the logits' dtype, chunk by chunk.

    With z = logits / T, p = softmax(z) over the valid vocabulary:
    d log p_t / dz = onehot(t) - p and dH / dz = -p * (log p + H); both times 1/T.
    """
    num_tokens, shard = logits_2d.shape
    grad = torch.empty_like(logits_2d, memory_format=torch.contiguous_format)
    if num_valid < shard:
        grad[:, num_valid:] = 0.0  # padded vocabulary: probability 0, gradient 0
    if num_valid == 0 or (grad_log_probs is None and grad_entropy is None):
        if num_valid:
            grad.zero_()
        return grad
    # Per-token coefficients, folded with 1/T once: grad = a * onehot - a * p - b * p (log p + H).
    coef_lp = grad_log_probs.float() * inv_temperature if grad_log_probs is not None else None
    coef_h = grad_entropy.float() * inv_temperature if grad_entropy is not None else None
    rows = min(chunk_size, num_tokens)
    log_p_buf = torch.empty(rows, num_valid, dtype=torch.float32, device=logits_2d.device)
    p_buf = torch.empty_like(log_p_buf)
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        log_p, p = log_p_buf[: end - start], p_buf[: end - start]
        log_p.copy_(logits_2d[start:end, :num_valid])
        log_p.sub_(max_logit[start:end].unsqueeze(-1))
        if inv_temperature != 1.0:
            log_p.mul_(inv_temperature)
        log_p.sub_(log_sum[start:end].unsqueeze(-1))
        torch.exp(log_p, out=p)
        if coef_h is not None:
            out = log_p
            out.add_(entropy[start:end].unsqueeze(-1)).mul_(p)
            out.mul_(-coef_h[start:end].unsqueeze(-1))
            if coef_lp is not None:
                out.addcmul_(p, coef_lp[start:end].unsqueeze(-1), value=-1.0)
        else:
            out = p.mul_(-coef_lp[start:end].unsqueeze(-1))
        if coef_lp is not None:
            hit = torch.where(owned[start:end], coef_lp[start:end], 0.0)
            out.scatter_add_(-1, local_targets[start:end].unsqueeze(-1), hit.unsqueeze(-1))
        grad[start:end, :num_valid].copy_(out)
    return grad


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    *,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probability of ``targets`` and entropy under ``softmax(logits / temperature)``.

    logits: this rank's vocabulary shard ``[..., V_padded / tp]`` (float32/bf16/fp16; the math
        is float32). targets: ``[...]`` global token ids in ``[0, vocab_size)``.
    tp_group: the tensor-parallel group; None = megatron's TP group if model parallelism is
        initialised, else a single local rank.
    temperature: the rollout engine's sampling temperature (it samples from logits / T).
    vocab_size: the true vocabulary size; padded columns ``>= vocab_size`` get probability 0.
        None = every column is real.
    chunk_size: tokens processed at a time (forward and backward), bounding the float32 work
        buffers to ``2 * chunk_size * V_shard``; None = automatic (a cache/memory-sized
        budget, see ``auto_chunk_size``).
    with_entropy: False skips the entropy's work and returns None for it.

    Returns ``(log_probs [...], entropy [...] or None)``, float32, differentiable w.r.t. logits.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal logits' leading shape "
            f"{tuple(logits.shape[:-1])}"
        )
    group = resolve_tp_group(tp_group)
    tp, rank = _group_size_and_rank(group)
    shard = logits.shape[-1]
    padded_vocab = shard * tp
    if vocab_size is None:
        vocab_size = padded_vocab
    if not 1 <= vocab_size <= padded_vocab:
        raise ValueError(
            f"vocab_size {vocab_size} must be in [1, {padded_vocab}] (shard {shard} x tp {tp})"
        )
    num_valid = min(max(vocab_size - rank * shard, 0), shard)
    if chunk_size is None:
        chunk_size = auto_chunk_size(shard, logits.device)
    logits_2d = logits.reshape(-1, shard)
    log_probs, entropy = _VocabParallelLogProbs.apply(
        logits_2d, targets.reshape(-1).long(), group, tp, rank, 1.0 / temperature,
        num_valid, chunk_size, with_entropy,
    )
    lead = logits.shape[:-1]
    return log_probs.view(lead), (entropy.view(lead) if with_entropy else None)
