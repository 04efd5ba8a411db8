"""Rank 0's half of a step: prompts -> rollout engine -> rewards -> advantages -> TrainBatch.

The driver broadcasts the finished RolloutResult to the other ranks, so the rollout engine,
the tokenizer and the reward functions live in one process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from megatron_grpo.losses import compute_advantages
from megatron_grpo.rewards.sample import RewardSample
from megatron_grpo.trainer.batch import TrainBatch, build_train_batch


@dataclass
class RolloutResult:
    batch: TrainBatch
    stats: dict[str, float]


def sampling_seed(seed: int, step: int) -> int:
    """Per-step seed of the engine's sampler: a resumed run redraws the same responses."""
    return (seed * 1_000_003 + step) % (2**31 - 1)


def generate_and_score(step: int, prompts, client, sampling, scorer, tokenizer, cfg) -> RolloutResult:
    """Generate ``num_generations`` responses per prompt, score, normalise into advantages.

    prompts: list of data.Prompt (``prompt_ids``, ``answer``); cfg: ExperimentConfig.
    """
    n = cfg.rollout.num_generations
    t0 = time.monotonic()
    samples = client.generate([p.prompt_ids for p in prompts], n, sampling,
                              sampling_seed=sampling_seed(cfg.trainer.seed, step))
    t_gen = time.monotonic() - t0
    scored = scorer.score_samples(reward_samples(prompts, samples, tokenizer))
    t_reward = time.monotonic() - t0 - t_gen
    rewards = torch.tensor(scored.rewards, dtype=torch.float32)
    advantages = compute_advantages(rewards, n, cfg.algorithm)
    batch = build_train_batch(
        [s.prompt_ids for s in samples], [s.output_ids for s in samples],
        [s.output_logprobs for s in samples], advantages, pad_id=_pad_id(tokenizer),
    )
    lengths = np.array([len(s.output_ids) for s in samples], dtype=np.float64)
    group_std = rewards.view(-1, n).std(dim=1, unbiased=True) if n > 1 else torch.zeros(1)
    stats = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "frac_groups_zero_std": float((group_std <= 1e-6).float().mean()),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "truncated_ratio": float(np.mean([s.finish_reason == "length" for s in samples])),
        "rollout_tokens_per_s": float(lengths.sum() / max(t_gen, 1e-9)),
        "rollout/generate_s": t_gen,
        "rollout/reward_s": t_reward,
        "rollout/weight_version": engine_weight_version(samples),
        "rollout/prompt_indices": ",".join(str(p.index) for p in prompts),
    }
    for label, values in scored.per_function.items():
        stats[f"reward/{label}"] = float(np.mean(values))
    stats.update({f"reward/{key}": value for key, value in scored.stats.items()})
    return RolloutResult(batch=batch, stats=stats)


def engine_weight_version(samples) -> int | None:
    """The oldest weight version (the trainer step the engine's weights come from, set by each
    sync) that sampled any of ``samples``, as the engine reported it; None if not a step."""
    versions = [s.weight_version for s in samples]
    return min(int(v) for v in versions) if all(str(v).isdigit() for v in versions) else None


def reward_samples(prompts, samples, tokenizer) -> list[RewardSample]:
    """What the reward functions see of each engine ``Sample`` of ``prompts`` (data.Prompt)."""
    out = []
    for s in samples:
        p = prompts[s.prompt_index]
        out.append(RewardSample(prompt=p.text, response=tokenizer.decode(s.output_ids, skip_special_tokens=True),
                                answer=p.answer, response_ids=list(s.output_ids), prompt_ids=list(s.prompt_ids),
                                finish_reason=s.finish_reason, row=p.fields))
    return out


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)
