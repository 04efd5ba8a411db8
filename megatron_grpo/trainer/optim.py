"""megatron-core optimizer, DDP wrapping and the learning-rate schedule."""

from __future__ import annotations

import math

import torch

from megatron_grpo.config.sections import OptimizerConfig
from megatron_grpo.runtime.cpu_shim import tensor_type_names_cuda


def wrap_ddp(model_chunks, use_distributed_optimizer: bool):
    """Wrap chunks in megatron-core's DistributedDataParallel (fp32 gradient buffers, the
    dp all-reduce in ``finalize_model_grads``)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    wrapped = [DistributedDataParallel(config=c.config, ddp_config=ddp_cfg, module=c) for c in model_chunks]
    for c in wrapped:
        c.config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def build_optimizer(model_chunks, optimizer_cfg: OptimizerConfig, dtype: torch.dtype,
                    use_distributed_optimizer: bool):
    """megatron-core optimizer over DDP-wrapped chunks.

    For bf16/fp16 parameters this is megatron-core's mixed-precision optimizer
    (``Float16OptimizerWithFloat16Params``): it keeps an fp32 *main* copy of every parameter,
    the Adam state is fp32 and steps the main copy, and the bf16 model parameters are
    overwritten by the rounded main copy after each step. Gradients accumulate and are
    reduced over dp in the fp32 buffers of ``wrap_ddp`` (``grad_reduce_in_fp32``); the
    optimizer copies them into the main parameters' ``.grad``.

    The DistributedOptimizer needs CUDA (its parameter type checks name CUDA tensors); on
    CPU the caller must pass ``use_distributed_optimizer=False``.
    """
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer

    o = optimizer_cfg
    mcfg = McoreOptimizerConfig(
        optimizer=o.name, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        params_dtype=dtype, use_distributed_optimizer=use_distributed_optimizer,
    )
    with tensor_type_names_cuda():  # CPU: the constructor sorts parameters by CUDA type names
        return get_megatron_optimizer(mcfg, model_chunks)


def lr_at(step: int, optimizer_cfg: OptimizerConfig, total_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of ``total_steps``: linear warm-up
    from lr/warmup to lr over ``lr_warmup_steps``, then constant, linear or cosine decay to
    ``min_lr`` at the last step."""
    if optimizer_cfg.lr_warmup_steps > 0 and step < optimizer_cfg.lr_warmup_steps:
        return optimizer_cfg.lr * (step + 1) / optimizer_cfg.lr_warmup_steps
    if optimizer_cfg.lr_decay_style == "constant":
        return optimizer_cfg.lr
    span = max(total_steps - optimizer_cfg.lr_warmup_steps - 1, 1)
    progress = min(max(step - optimizer_cfg.lr_warmup_steps, 0) / span, 1.0)
    if optimizer_cfg.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:  # cosine
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return optimizer_cfg.min_lr + (optimizer_cfg.lr - optimizer_cfg.min_lr) * factor


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
