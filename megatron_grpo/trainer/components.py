"""Build what a run needs from its config: the policy (Megatron chunks + DDP + optimizer),
the frozen reference, and rank 0's rollout side (engine, client, tokenizer, data, rewards)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.runtime.device import cuda_available, resolve_distributed_optimizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Policy:
    modules: list  # the GPTModel chunks (unwrapped): checkpointing, weight export
    chunks: list  # the same wrapped in megatron DDP: forward/backward
    optimizer: Any
    hf_config: Any


def build_policy(cfg: ExperimentConfig) -> Policy:
    """Policy chunks for this rank, initialised from ``model.megatron_ckpt`` or the HF weights."""
    from megatron.core import parallel_state

    from megatron_grpo.models import build_model, load_hf_config, load_hf_weights, load_megatron_checkpoint
    from megatron_grpo.models.builder import check_moe_training
    from megatron_grpo.trainer.optim import build_optimizer, wrap_ddp

    hf_config = load_hf_config(cfg.model.hf_dir)
    check_moe_training(hf_config, parallel_state.get_tensor_model_parallel_world_size(),
                       cfg.parallel.sequence_parallel)
    modules = build_model(
        hf_config, dtype=DTYPES[cfg.model.dtype],
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
        recompute=cfg.model.recompute_activations, sequence_parallel=cfg.parallel.sequence_parallel,
        init_weights=False,
    )
    if cfg.model.megatron_ckpt:
        load_megatron_checkpoint(modules, cfg.model.megatron_ckpt)
    else:
        load_hf_weights(modules, cfg.model.hf_dir, hf_config)
    use_dist_opt = resolve_distributed_optimizer(cfg.parallel.use_distributed_optimizer, cuda_available())
    chunks = wrap_ddp(modules, use_dist_opt)
    optimizer = build_optimizer(chunks, cfg.optimizer, DTYPES[cfg.model.dtype], use_dist_opt)
    return Policy(modules=modules, chunks=chunks, optimizer=optimizer, hf_config=hf_config)


def build_reference(cfg: ExperimentConfig, hf_config) -> Optional[list]:
    """Frozen reference chunks (the initial weights) when the KL loss is on, else None."""
    if cfg.algorithm.kl_loss_coef <= 0:
        return None
    from megatron_grpo.models import build_model, load_hf_weights, load_megatron_checkpoint

    ref = build_model(
        hf_config, dtype=DTYPES[cfg.model.dtype],
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by, init_weights=False,
    )
    if cfg.model.megatron_ckpt:
        load_megatron_checkpoint(ref, cfg.model.megatron_ckpt)
    else:
        load_hf_weights(ref, cfg.model.hf_dir, hf_config)
    for chunk in ref:
        chunk.eval()
        chunk.requires_grad_(False)
    return ref


@dataclass
class RolloutSide:
    """Rank 0's rollout machinery."""

    manager: Any
    client: Any
    sampling: Any
    tokenizer: Any
    sampler: Any
    scorer: Any

    def close(self) -> None:
        self.client.close()
        self.manager.stop()
        self.scorer.close()


def build_rollout_side(cfg: ExperimentConfig, tokenizer, sampler) -> RolloutSide:
    """Start (or connect to) the rollout engine and build the client, sampler and scorer."""
    from megatron_grpo.rewards import RewardScorer
    from megatron_grpo.rollout.client import RolloutClient
    from megatron_grpo.rollout.manager import RolloutServerManager
    from megatron_grpo.rollout.types import SamplingParams

    scorer = RewardScorer(cfg.reward)  # before the engine starts: a bad reward fails fast
    manager = RolloutServerManager(cfg.rollout, model_dir=cfg.model.hf_dir, run_dir=cfg.trainer.run_dir)
    urls = manager.start()
    client = RolloutClient.from_config(cfg.rollout, urls)
    sampling = SamplingParams.from_rollout_config(cfg.rollout)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in sampling.stop_token_ids:
        sampling.stop_token_ids = [*sampling.stop_token_ids, tokenizer.eos_token_id]
    return RolloutSide(manager=manager, client=client, sampling=sampling, tokenizer=tokenizer,
                       sampler=sampler, scorer=scorer)
