"""Build what a run needs from its config: the policy (Megatron chunks + DDP + optimizer),
the frozen reference (the distillation teacher: ``trainer/teacher.py``) and rank 0's rollout
side (sampling parameters, tokenizer, data, rewards); the rollout engine and its weight sync
come from ``sync.factory.build_engine``."""

from __future__ import annotations

from pathlib import Path

from dataclasses import dataclass
from typing import Any, Optional

import torch
from megatron.core import parallel_state

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.data import PromptSampler
from megatron_grpo.models import build_model, load_hf_config, load_hf_weights, load_megatron_checkpoint
from megatron_grpo.models.builder import (check_context_parallel, check_moe_training, check_packing,
                                         resolve_attention_backend)
from megatron_grpo.models.errors import ModelError
from megatron_grpo.models.lora import apply_lora, lora_problem, spec_from_config
from megatron_grpo.preflight.report import reward_build_deadline
from megatron_grpo.rewards import RewardScorer
from megatron_grpo.data.prompts import has_chat_template
from megatron_grpo.rollout.episodes.source import EpisodeSource, build_episode_source
from megatron_grpo.wire.samples import SamplingParams
from megatron_grpo.runtime.device import cuda_available, resolve_distributed_optimizer
from megatron_grpo.trainer.optim import build_optimizer, wrap_ddp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Policy:
    modules: list  # the GPTModel chunks (unwrapped): checkpointing, weight export
    chunks: list  # the same wrapped in megatron DDP: forward/backward
    optimizer: Any
    hf_config: Any


def build_and_load(cfg: ExperimentConfig, hf_config, hf_dir: Optional[str] = None,
                    megatron_ckpt: Optional[str] = None, **build_kwargs) -> list:
    """This rank's model chunks, initialised from ``megatron_ckpt`` or the HF weights of
    ``hf_dir`` (default: the policy's, ``model.megatron_ckpt`` / ``model.hf_dir``): the one
    build-and-load of the policy, the reference and the teacher."""
    if hf_dir is None:
        hf_dir, megatron_ckpt = cfg.model.hf_dir, cfg.model.megatron_ckpt
    modules = build_model(hf_config, dtype=DTYPES[cfg.model.dtype],
                          make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
                          attention_backend=cfg.model.attention_backend, init_weights=False, **build_kwargs)
    if megatron_ckpt:
        load_megatron_checkpoint(modules, megatron_ckpt)
    else:
        load_hf_weights(modules, hf_dir, hf_config)
    return modules


def build_policy(cfg: ExperimentConfig) -> Policy:
    """Policy chunks for this rank, initialised from ``model.megatron_ckpt`` or the HF weights."""
    hf_config = load_hf_config(cfg.model.hf_dir)
    check_moe_training(hf_config, parallel_state.get_tensor_model_parallel_world_size(),
                       cfg.parallel.sequence_parallel)
    if cfg.parallel.pack_sequences:
        check_packing(hf_config, cfg.model.attention_backend)
    check_context_parallel(hf_config, cfg.model.attention_backend, cfg.parallel.cp)
    modules = build_and_load(cfg, hf_config, recompute=cfg.model.recompute_activations,
                              sequence_parallel=cfg.parallel.sequence_parallel)
    if cfg.model.lora is not None:  # freeze the base before DDP: it and the optimizer see the adapters only
        spec = spec_from_config(cfg.model.lora)
        problem = lora_problem(spec, hf_config, tp=parallel_state.get_tensor_model_parallel_world_size(),
                               attention_backend=resolve_attention_backend(cfg.model.attention_backend),
                               sequence_parallel=cfg.parallel.sequence_parallel)
        if problem:
            raise ModelError(f"{problem[0]}: {problem[1]}")
        apply_lora(modules, spec, base=_absolute(hf_dir=cfg.model.hf_dir, megatron_ckpt=cfg.model.megatron_ckpt))
    use_dist_opt = resolve_distributed_optimizer(cfg.parallel.use_distributed_optimizer, cuda_available())
    chunks = wrap_ddp(modules, use_dist_opt)
    optimizer = build_optimizer(chunks, cfg.optimizer, DTYPES[cfg.model.dtype], use_dist_opt)
    return Policy(modules=modules, chunks=chunks, optimizer=optimizer, hf_config=hf_config)


def _absolute(**paths: Optional[str]) -> dict:
    """``paths`` made absolute (None kept): a LoRA checkpoint names its base from anywhere."""
    return {k: str(Path(v).resolve()) if v else None for k, v in paths.items()}


def build_reference(cfg: ExperimentConfig, hf_config) -> Optional[list]:
    """Frozen reference chunks (the initial weights) when the KL loss is on, else None."""
    if cfg.algorithm.kl_loss_coef <= 0:
        return None
    return frozen(build_and_load(cfg, hf_config))


def frozen(chunks: list) -> list:
    """``chunks`` in eval mode with no parameter requiring a gradient (a frozen model)."""
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    return chunks


@dataclass
class RolloutSide:
    """Rank 0's rollout machinery besides the engine."""

    sampling: SamplingParams
    tokenizer: Any  # a transformers tokenizer
    sampler: Optional[PromptSampler]  # None when evaluating a saved model
    scorer: RewardScorer
    episode_source: Optional[EpisodeSource] = None
    """What generates instead of the engine's generate (rollout/episodes/source.py: the
    environment loop, the agent runner or the user's rollout function); None: single-turn."""

    def close(self) -> None:
        self.scorer.close()
        if self.episode_source is not None:
            self.episode_source.close()  # its worker processes (and an agent's front)


def build_rollout_side(cfg: ExperimentConfig, tokenizer, sampler: Optional[PromptSampler], *,
                       vocab_size: Optional[int] = None) -> RolloutSide:
    """The sampling parameters (with the tokenizer's EOS as a stop id), the sampler, the
    reward scorer and, with ``episodes.kind: environment`` or ``episodes.kind: function``, the
    rollout function (built before the engine starts: a bad reward, environment or rollout
    function fails fast). ``vocab_size``: the model's, the bound of a rollout function's ids."""
    with reward_build_deadline(cfg.reward):
        scorer = RewardScorer(cfg.reward)
    episode_source = build_episode_source(
        cfg.episodes, tokenizer, max_inflight=cfg.engine.max_inflight_requests, vocab_size=vocab_size,
        use_template=cfg.data.apply_chat_template and has_chat_template(tokenizer),
        model_context=getattr(load_hf_config(cfg.model.hf_dir), "max_position_embeddings", None))
    sampling = SamplingParams.from_rollout_config(cfg.rollout)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in sampling.stop_token_ids:
        sampling.stop_token_ids = [*sampling.stop_token_ids, tokenizer.eos_token_id]
    return RolloutSide(sampling=sampling, tokenizer=tokenizer, sampler=sampler, scorer=scorer,
                       episode_source=episode_source)
