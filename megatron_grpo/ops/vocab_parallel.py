"""Per-token log-probabilities and entropies from vocab-parallel logits, without gathering V.

Megatron's output layer leaves rank ``r`` of ``tp`` with columns ``[r * V_shard, (r + 1) * V_shard)``
of the padded vocabulary. ``vocab_parallel_log_probs`` returns ``log p(target)`` and ``H(p)``,
``p = softmax(logits / T)``, with gradients, in one ``autograd.Function``: per chunk of tokens a
local max, ``exp`` once into a logits-shaped buffer that backward turns into the gradient in place,
local sums; then one MAX and one SUM all-reduce over the TP group for all tokens at once, however
many chunks. Backward needs no collective.

What a caller must know:
* memory: one logits shard plus ``[chunk, V_shard]`` work buffers; ``inplace=True`` uses the logits'
  own storage (as megatron's cross entropy always does), by default the input is left intact.
  Backward runs once per forward (``retain_graph`` double backward raises).
* padded columns (>= ``vocab_size``) get probability exactly 0 and gradient 0, never NaN.
* ``kept_ids`` (truncated sampling): the engine's kept set per token, global ids, never re-derived
  here; the op returns ``log q(target)`` and ``H(q)`` of the renormalised distribution over it. A
  row of all -1 is not truncated. Costs one masked copy of the shard.
* ``kernel``: chunked torch ops (every device; the tests' reference) or the fused Triton kernels of
  ``ops.triton_logprobs``, same per-token statistics, shared combine; ``"auto"`` picks Triton for
  CUDA logits when triton is installed.
* float32 arithmetic on the logits, float64 per-token statistics.
* preconditions, not checked (that would sync the device): ``0 <= targets < vocab_size``, and the
  target is in its kept set when one is given.

Derivation, exp floor, measured precision and speed: docs/vocab_parallel.md.
"""

from __future__ import annotations

import importlib.util
from typing import Literal, Optional

import torch
import torch.distributed as dist

# Work-buffer budget per chunk, in float32 elements, when chunk_size is None. On CPU a
# [chunk, V_shard] buffer that stays in the last-level cache makes the several passes over
# a chunk cheap (only the first read and the final write reach DRAM); on GPU a larger chunk
# keeps kernels big while the buffer stays a small fraction of a logits shard.
_AUTO_CHUNK_ELEMENTS = {"cpu": 1 << 19, "cuda": 1 << 22}
_DEFAULT_CHUNK_ELEMENTS = 1 << 22

# exp() of float32 below about -87 underflows to subnormals/0, which the vectorised CPU exp
# handles on a slow path (measured 5-20x slower). Shifted logits are floored here first:
# exp(-80) = 1.8e-35 contributes nothing measurable to S, D or any gradient.
_EXP_FLOOR = -80.0

# Which implementation of the per-rank passes runs (``kernel`` argument, model.logprob_kernel).
Kernel = Literal["auto", "torch", "triton"]
KERNELS = ("auto", "torch", "triton")


def triton_importable() -> bool:
    """Whether the optional ``triton`` package is installed (CUDA builds of torch bring it)."""
    return importlib.util.find_spec("triton") is not None


def _triton_kernels(kernel: Kernel, device: torch.device):
    """The ``ops.triton_logprobs`` module when ``kernel`` selects it for logits on ``device``,
    else None (the torch path)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if kernel == "torch" or (kernel == "auto" and not (device.type == "cuda" and triton_importable())):
        return None
    if not triton_importable():
        raise ValueError("kernel='triton' needs the triton package (pip install triton), which is not installed")
    # Imported here, not at the top: triton is optional (a CPU install runs without it).
    from megatron_grpo.ops import triton_logprobs

    if device.type != "cuda" and not triton_logprobs.INTERPRETED:
        raise ValueError(f"kernel='triton' needs CUDA logits, got logits on {device.type} (use 'auto' or "
                         "'torch'; triton's CPU interpreter, TRITON_INTERPRET=1, is for tests)")
    return triton_logprobs


def resolve_tp_group(tp_group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """The tensor-parallel group to reduce over: ``tp_group`` if given; else megatron's TP
    group when model parallelism is initialised; else None (a single, local rank)."""
    if tp_group is not None:
        return tp_group
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return None


def auto_chunk_size(num_cols: int, num_tokens: int, device: torch.device) -> int:
    """Tokens per chunk: a ``[chunk, num_cols]`` float32 buffer within the device's budget,
    and at most 1/16 of the tokens, so the work buffers (~12 bytes per chunk element) stay
    small next to a small logits shard too."""
    budget = _AUTO_CHUNK_ELEMENTS.get(device.type, _DEFAULT_CHUNK_ELEMENTS)
    return max(1, min(budget // max(1, num_cols), -(-num_tokens // 16)))


def kept_column_mask(kept_NK: torch.Tensor, vocab_start: int, shard: int) -> torch.Tensor:
    """Which of this rank's columns each token keeps: kept_NK long [N, K] global ids (-1 pads;
    a row of -1 only = no truncation, every column kept) -> bool [N, shard] over the columns
    ``[vocab_start, vocab_start + shard)``."""
    num_tokens = kept_NK.shape[0]
    local = kept_NK - vocab_start
    inside = (kept_NK >= 0) & (local >= 0) & (local < shard)
    keep = torch.zeros(num_tokens, shard + 1, dtype=torch.bool, device=kept_NK.device)
    keep.scatter_(1, torch.where(inside, local, shard), True)  # column ``shard``: the discard slot
    keep = keep[:, :shard]
    keep[(kept_NK < 0).all(dim=-1)] = True
    return keep


def _group_size_and_rank(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _local_stats(
    logits_2d: torch.Tensor,
    local_targets: torch.Tensor,
    owned: torch.Tensor,
    exps: torch.Tensor,
    inv_temperature: float,
    chunk_size: int,
    with_entropy: bool,
) -> torch.Tensor:
    """This rank's per-token softmax statistics relative to its own max; fills ``exps``.

    logits_2d: [N, V_shard] (any float dtype); local_targets: [N] int64 column on this rank
    (0 where not owned); owned: [N] bool; exps: [N, V_valid] output view (logits dtype)
    receiving e = exp(z) with z = (logits - m_r) / T. Returns float64 stats [4, N]: the local
    max logit m_r (raw logit units), S_r = sum e, D_r = sum e * z (0 without entropy) and
    t_r = z_target (0 if not owned).

    Precision: subtracting the max before scaling keeps z's rounding relative to z itself;
    S is accumulated in float64 so that log S stays accurate when S is close to 1 (a peaked
    distribution, small entropy: float32 would leave an absolute error of one ulp of 1).
    """
    num_tokens, num_valid = exps.shape
    device = logits_2d.device
    stats = torch.zeros(4, num_tokens, dtype=torch.float64, device=device)
    if num_valid == 0:  # a rank holding only vocabulary padding contributes nothing
        stats[0].fill_(float("-inf"))
        return stats
    local_max = torch.empty(num_tokens, dtype=torch.float32, device=device)
    dots = torch.zeros(num_tokens, dtype=torch.float32, device=device)
    rows = min(chunk_size, num_tokens)
    # One reused work buffer: a fresh large allocation per chunk costs page faults on CPU.
    shifted = torch.empty(rows, num_valid, dtype=torch.float32, device=device)
    exps_are_float32 = exps.dtype == torch.float32
    exps_work = None if exps_are_float32 else torch.empty_like(shifted)
    # float64 copy for the sum; preallocated (sum(dtype=float64) would allocate per chunk).
    exps_f64 = torch.empty(rows, num_valid, dtype=torch.float64, device=device)
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        z, x = shifted[: end - start], logits_2d[start:end, :num_valid]
        m = local_max[start:end]
        m.copy_(torch.amax(x, dim=-1))  # exact in any dtype: the max is one of the logits
        torch.sub(x, m.unsqueeze(-1), out=z)  # float32 result whatever the logits' dtype
        if inv_temperature != 1.0:
            z.mul_(inv_temperature)
        stats[3, start:end] = z.gather(-1, local_targets[start:end].unsqueeze(-1)).squeeze(-1)
        z.clamp_min_(_EXP_FLOOR)
        # float32 logits: exp straight into the saved buffer; else in float32, then cast.
        e = exps[start:end] if exps_are_float32 else exps_work[: end - start]
        torch.exp(z, out=e)
        torch.sum(exps_f64[: end - start].copy_(e), dim=-1, out=stats[1, start:end])
        if not exps_are_float32:
            exps[start:end].copy_(e)
        if with_entropy:  # z is not needed after this: the product goes into it
            torch.sum(z.mul_(e), dim=-1, out=dots[start:end])
    stats[0] = local_max
    stats[2] = dots
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
    # D_r relative to M: sum e_r * exp(delta) * (z_r + delta). where() keeps a padding-only
    # rank (S_r = 0, delta = -inf) from producing 0 * inf = NaN.
    stats[2] = torch.where(stats[1] > 0, scale * (stats[2] + delta * stats[1]), 0.0)
    stats[1].mul_(scale)
    stats[3] = torch.where(owned, stats[3] + delta, 0.0)
    dist.all_reduce(stats[1:], op=dist.ReduceOp.SUM, group=group)
    return stats


def _global_scores(stats: torch.Tensor, owned: torch.Tensor, inv_temperature: float, group, tp: int,
                   with_entropy: bool):
    """Both forwards' end: this rank's float64 [4, N] statistics combined over the TP group
    (``_combine_over_ranks``) -> (global max M [N], log S [N], log p_target float32 [N],
    entropy float32 [N] or [0] without entropy, S [N])."""
    global_max, sum_exp, dot, target_z = _combine_over_ranks(stats, owned, inv_temperature, group, tp)
    log_sum = torch.log(sum_exp)
    log_probs = (target_z - log_sum).float()
    # H = log S - D / S adds two non-negative terms (D <= 0): no cancellation.
    entropy = (log_sum - dot / sum_exp).float() if with_entropy else log_sum.new_empty(0).float()
    return global_max, log_sum, log_probs, entropy, sum_exp


def _arm_once(ctx, entropy: torch.Tensor, with_entropy: bool) -> None:
    """End of both forwards: backward may run once (``_consume``), gets None for an output
    without gradient, and the entropy has none when it was not computed."""
    ctx.consumed = False
    ctx.set_materialize_grads(False)
    if not with_entropy:
        ctx.mark_non_differentiable(entropy)


def _consume(ctx) -> None:
    """Backward runs once per forward: the saved buffer (or the logits' storage) becomes the
    gradient in place, so a second backward would read garbage. RuntimeError on the second."""
    if ctx.consumed:
        raise RuntimeError(
            "vocab_parallel_log_probs: backward ran twice; its saved buffer becomes the "
            "gradient in place, so retain_graph/double backward is not supported"
        )
    ctx.consumed = True


class _VocabParallelLogProbs(torch.autograd.Function):
    """(logits shard [N, V_shard], targets [N]) -> (log p_target [N], entropy [N] or [0])."""

    @staticmethod
    def forward(
        ctx, logits_2d, targets, group, tp, rank, inv_temperature, num_valid, chunk_size,
        with_entropy, inplace,
    ):
        vocab_start = rank * logits_2d.shape[-1]
        owned = (targets >= vocab_start) & (targets < vocab_start + num_valid)
        local_targets = torch.where(owned, targets - vocab_start, 0)
        # exp(z) for every valid column; the padding columns hold 0 (their gradient). In
        # place, each chunk's logits are read into the work buffer before its exps land.
        exps = logits_2d if inplace else torch.empty_like(logits_2d, memory_format=torch.contiguous_format)
        exps[:, num_valid:] = 0.0
        stats = _local_stats(
            logits_2d, local_targets, owned, exps[:, :num_valid], inv_temperature, chunk_size,
            with_entropy,
        )
        local_max = stats[0].clone()
        global_max, log_sum, log_probs, entropy, sum_exp = _global_scores(
            stats, owned, inv_temperature, group, tp, with_entropy)
        # p = exps * prob_scale per token (0 on a padding-only rank, where exp(-inf) = 0).
        prob_scale = (torch.exp((local_max - global_max) * inv_temperature) / sum_exp).float()
        # M is a logit value, exact in float32; backward recomputes log p = (x - M) / T - log S
        # from the logits, or from log(exps) when they were overwritten.
        ctx.save_for_backward(
            exps, logits_2d if with_entropy and not inplace else None, local_targets, owned,
            prob_scale, global_max.float(), log_sum.float(), entropy,
        )
        ctx.inv_temperature, ctx.num_valid, ctx.chunk_size = inv_temperature, num_valid, chunk_size
        ctx.with_entropy = with_entropy
        _arm_once(ctx, entropy, with_entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        _consume(ctx)
        exps, logits_2d, local_targets, owned, prob_scale, max_logit, log_sum, entropy = ctx.saved_tensors
        if not ctx.with_entropy:  # entropy was not computed, so it has no gradient
            grad_entropy = None
        grad_logits = _logits_grad_in_place(
            exps, logits_2d, local_targets, owned, prob_scale, max_logit, log_sum, entropy,
            grad_log_probs, grad_entropy, ctx.inv_temperature, ctx.num_valid, ctx.chunk_size,
        )
        return grad_logits, None, None, None, None, None, None, None, None, None


class _TritonVocabParallelLogProbs(torch.autograd.Function):
    """The same op with the per-rank passes as Triton kernels (``ops.triton_logprobs``):
    forward reads the logits once and writes nothing logits-sized; backward reads them once
    more and writes the gradient (into the logits' storage with ``inplace``)."""

    @staticmethod
    def forward(
        ctx, logits_2d, targets, group, tp, rank, inv_temperature, num_valid, with_entropy,
        inplace, block_size, kernels,
    ):
        if logits_2d.stride(-1) != 1:
            logits_2d = logits_2d.contiguous()
        vocab_start = rank * logits_2d.shape[-1]
        owned = (targets >= vocab_start) & (targets < vocab_start + num_valid)
        local_targets = torch.where(owned, targets - vocab_start, -1)
        stats = kernels.local_stats(logits_2d, local_targets, num_valid, inv_temperature, with_entropy, block_size)
        global_max, log_sum, log_probs, entropy, _ = _global_scores(
            stats, owned, inv_temperature, group, tp, with_entropy)
        ctx.save_for_backward(logits_2d, local_targets, global_max.float(), log_sum.float(), entropy)
        ctx.inv_temperature, ctx.num_valid, ctx.with_entropy = inv_temperature, num_valid, with_entropy
        ctx.inplace, ctx.block_size, ctx.kernels = inplace, block_size, kernels
        _arm_once(ctx, entropy, with_entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        _consume(ctx)  # same contract as the torch path (in place, the logits are gone)
        logits_2d, local_targets, max_logit, log_sum, entropy = ctx.saved_tensors
        if not ctx.with_entropy:
            grad_entropy = None
        nones = (None,) * 10
        if grad_log_probs is None and grad_entropy is None:
            return (None, *nones)
        inv_t = ctx.inv_temperature
        coef_lp = None if grad_log_probs is None else (grad_log_probs.float() * inv_t).contiguous()
        coef_h = None if grad_entropy is None else (grad_entropy.float() * inv_t).contiguous()
        out = logits_2d if ctx.inplace else torch.empty_like(logits_2d)
        grad = ctx.kernels.logits_grad(
            logits_2d, out, local_targets, max_logit, log_sum, entropy, coef_lp, coef_h,
            ctx.num_valid, inv_t, ctx.block_size,
        )
        return (grad, *nones)


def _logits_grad_in_place(
    exps, logits_2d, local_targets, owned, prob_scale, max_logit, log_sum, entropy,
    grad_log_probs, grad_entropy, inv_temperature, num_valid, chunk_size,
):
    """Turn the saved exps [N, V_shard] into d(loss)/d(logits), in place, and return it.

    With z = (logits - M) / T, p = exps * prob_scale, log p = z - log S:
    d log p_t / dz = onehot(t) - p and dH / dz = -p (log p + H); both times 1/T. So
    grad = a * onehot - p * (a + b * (log p + H)) with a = g_lp / T, b = g_H / T, which per
    token is  exps * (alpha * u + beta) + a * onehot,  u = logits - M  (or u = log(exps)
    when ``logits_2d`` is None because the op ran in place; log p = log(exps * prob_scale)).
    """
    if grad_log_probs is None and grad_entropy is None:
        return exps.zero_()
    valid = exps[:, :num_valid]
    coef_lp = grad_log_probs.float() * inv_temperature if grad_log_probs is not None else None
    if grad_entropy is None:
        valid.mul_((-coef_lp * prob_scale).unsqueeze(-1))  # one in-place pass
    elif num_valid > 0:
        coef_h = grad_entropy.float() * inv_temperature
        coef_lp_or_0 = coef_lp if coef_lp is not None else 0.0
        if logits_2d is not None:  # log p = (x - M) / T - log S
            alpha = -prob_scale * coef_h * inv_temperature
            beta = -prob_scale * (coef_h * (entropy - log_sum) + coef_lp_or_0)
        else:  # log p = log(exps) + log(prob_scale)
            alpha = -prob_scale * coef_h
            beta = -prob_scale * (coef_h * (entropy + torch.log(prob_scale)) + coef_lp_or_0)
        alpha, beta = alpha.unsqueeze(-1), beta.unsqueeze(-1)
        num_tokens = exps.shape[0]
        rows = min(chunk_size, num_tokens)
        work = torch.empty(rows, num_valid, dtype=torch.float32, device=exps.device)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            factor = work[: end - start]
            if logits_2d is not None:
                torch.sub(logits_2d[start:end, :num_valid], max_logit[start:end].unsqueeze(-1), out=factor)
            else:  # exps >= exp(_EXP_FLOOR) > 0, except after an fp16 underflow: floor log(0)
                torch.log(valid[start:end], out=factor).clamp_min_(_EXP_FLOOR)
            factor.mul_(alpha[start:end]).add_(beta[start:end])
            valid[start:end].mul_(factor)
    if coef_lp is not None:
        hit = torch.where(owned, coef_lp, 0.0).to(exps.dtype)
        exps.scatter_add_(-1, local_targets.unsqueeze(-1), hit.unsqueeze(-1))
    return exps


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    *,
    with_entropy: bool = True,
    inplace: bool = False,
    kept_ids: Optional[torch.Tensor] = None,
    kernel: Kernel = "auto",
    block_size: Optional[int] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probability of ``targets`` and entropy under ``softmax(logits / temperature)``.

    logits: this rank's vocabulary shard ``[..., V_padded / tp]`` (float32/bf16/fp16; the math
        is float32). targets: ``[...]`` global token ids in ``[0, vocab_size)``.
    tp_group: the tensor-parallel group; None = megatron's TP group if model parallelism is
        initialised, else a single local rank.
    temperature: the rollout engine's sampling temperature (it samples from logits / T).
    vocab_size: the true vocabulary size; padded columns ``>= vocab_size`` get probability 0.
        None = every column is real.
    chunk_size: tokens processed at a time (forward and backward), bounding the work buffers
        to ``chunk_size * V_shard`` float32 + float64 elements (+ float32 for non-float32
        logits); None = automatic (a cache-sized budget, see ``auto_chunk_size``).
    with_entropy: False skips the entropy's work and returns None for it.
    inplace: overwrite ``logits`` with the op's saved state (as megatron's cross-entropy does)
        instead of allocating a logits-sized buffer: one shard less memory and, on CPU, no
        page faults to touch a fresh buffer. The caller must not read ``logits`` afterwards
        (fine when they come straight from the output layer, whose backward does not need
        them). The entropy gradient then uses log(exps): same float32 accuracy, but with
        bf16/fp16 logits it is only as exact as the stored exps.
    kept_ids: ``[..., K]`` long, each token's kept set (global ids, -1 padding; all -1: not
        truncated): the log-prob and entropy are those of softmax(logits / T) renormalised
        over the set (see the module docstring). None: the full distribution.
    kernel: "torch" (the chunked torch implementation), "triton" (``ops.triton_logprobs``:
        fused one-pass kernels; needs triton and CUDA logits, or triton's CPU interpreter as
        in the tests) or "auto" (triton for CUDA logits when triton imports, else torch).
        The default is auto, as ``model.logprob_kernel``'s (the kernels' GPU measurement: docs/gpu.md).
        Same values, gradients, collectives and contract (one backward) either way;
        ``chunk_size`` only applies to torch, ``block_size`` (columns per Triton block, a
        power of 2; None = automatic) only to triton.

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
        chunk_size = auto_chunk_size(shard, logits.numel() // max(1, shard), logits.device)
    kernels = _triton_kernels(kernel, logits.device)
    logits_2d = logits.reshape(-1, shard)
    if kept_ids is not None:
        if kept_ids.shape[:-1] != logits.shape[:-1]:
            raise ValueError(f"kept_ids shape {tuple(kept_ids.shape)} must be logits' leading shape "
                             f"{tuple(logits.shape[:-1])} + [K]")
        keep = kept_column_mask(kept_ids.reshape(-1, kept_ids.shape[-1]).long(), rank * shard, shard)
        # A fresh tensor (out of place: autograd gives the filled columns gradient 0), so the
        # op may overwrite it.
        logits_2d = logits_2d.masked_fill(~keep, torch.finfo(logits.dtype).min / 4)
        inplace = True
    if kernels is not None:
        log_probs, entropy = _TritonVocabParallelLogProbs.apply(
            logits_2d, targets.reshape(-1).long(), group, tp, rank, 1.0 / temperature,
            num_valid, with_entropy, inplace, block_size, kernels,
        )
    else:
        log_probs, entropy = _VocabParallelLogProbs.apply(
            logits_2d, targets.reshape(-1).long(), group, tp, rank, 1.0 / temperature,
            num_valid, chunk_size, with_entropy, inplace,
        )
    lead = logits.shape[:-1]
    return log_probs.view(lead), (entropy.view(lead) if with_entropy else None)
