"""Rank 0's half of a step: prompts -> rollout engine -> rewards -> advantages -> TrainBatch.

With DAPO's options (``rollout.dynamic_sampling``, ``rollout.overlong``) rewards get the
soft overlong penalty, zero-variance groups are replaced by extra generation rounds, and
truncated responses can be masked out of the loss (``rollout/dynamic_sampling.py``). With
``episodes.kind: environment`` each response is a multi-turn episode (``rollout/episodes/environment/loop.py``): its
observation tokens are masked out of the loss and the environment's reward joins the score.
With ``episodes.kind: function`` the user's function generates the samples
(``rollout/episodes/function/source.py``); the episode loop is the built-in one.

The trainer broadcasts the finished RolloutResult to the other ranks, so the rollout engine,
the tokenizer and the reward functions live in one process.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.losses import compute_advantages
from megatron_grpo.rewards.sample import reward_samples
from megatron_grpo.rollout.batch import (TrainBatch, build_train_batch, pad_kept_ids, pad_routed_experts,
                                         truncated_log_probs)
from megatron_grpo.rollout.dynamic_sampling import (choose_groups, informative_groups, overlong_penalty,
                                                     truncated_rewards)
from megatron_grpo.rollout.episodes.source import EpisodeSource
from megatron_grpo.rollout.episodes.episode import episode_rewards, episode_stats
from megatron_grpo.wire.samples import SamplingParams


@dataclass
class RolloutResult:
    batch: TrainBatch
    stats: dict[str, float]


@dataclass(frozen=True)
class GenerationContext:
    """Everything rank 0's generation of a step needs besides the step and its prompts, built
    once (``Trainer.build``) and passed whole instead of as loose parameters."""

    engine: Any
    """What generates: a ``generation.protocol.RolloutEngine`` (or anything with its ``generate``)."""
    sampling: SamplingParams
    scorer: Any
    """A ``rewards.RewardScorer`` (anything with its ``score_samples``)."""
    tokenizer: Any
    """The model's transformers tokenizer (its pad/EOS ids; decoding for the rewards)."""
    cfg: ExperimentConfig
    episode_source: Optional[EpisodeSource] = None
    """What generates instead of ``engine.generate`` (rollout/episodes/source.py: the environment
    loop, the agent runner or the user's rollout function); None: single-turn."""
    more_prompts: Optional[Callable[[], list]] = None
    """The next prompts, for DAPO dynamic sampling's extra rounds (``rollout.dynamic_sampling``)."""


SEED_SPACE = 2**31 - 1
"""Sampler seeds stay below this (every engine, SGLang included, takes a 31-bit seed)."""
SEEDS_PER_ROUND = 2**14
"""Seeds a generation round owns: its response k is seeded ``base + k`` (the engines' and the
HTTP client's convention), so rounds of up to this many responses never share a stream (a
multi-turn round's calls count: episode i's turn t is seeded ``base + i * max_turns + t``)."""
ROUNDS_PER_STEP = 8
"""Rounds of a step given consecutive slots of seeds; a later round (DAPO's extra rounds past
the eighth, an async group's ninth attempt) gets a hashed slot instead."""


def sampling_seed(seed: int, step: int, round_index: int = 0) -> int:
    """Base seed of a generation round: a resumed run redraws the same responses, and no two
    rounds draw from the same random streams.

    Round r of step s owns the seeds ``base .. base + SEEDS_PER_ROUND - 1``, one slot of
    ``SEEDS_PER_ROUND`` per (step, round): slot ``s * ROUNDS_PER_STEP + r``, past the run's
    own offset (from ``seed``). The slots wrap around the 31-bit space after 16,384 steps;
    nothing repeats before. Departure from the seeds before (``seed * 1_000_003 + step``):
    consecutive steps' bases were one apart, so step s+1's response k drew the stream of step
    s's response k+1 and a 40-step run of 32 responses a step used 71 streams instead of 1,280.
    Each response was still drawn from the policy, but the responses of nearby steps were
    correlated (the same uniforms fed the inverse-CDF draws of the same slots)."""
    if round_index < ROUNDS_PER_STEP:
        slot = step * ROUNDS_PER_STEP + round_index
    else:  # rare: a stable hash of the three, away from the consecutive slots' pattern
        slot = int.from_bytes(hashlib.blake2b(f"{seed}/{step}/{round_index}".encode(), digest_size=8).digest(),
                              "little")
    slots = SEED_SPACE // SEEDS_PER_ROUND
    offset = (seed * 1_000_003) % slots
    return ((offset + slot) % slots) * SEEDS_PER_ROUND


@dataclass
class Round:
    """One generation round: ``len(prompts) * n`` samples, grouped by prompt."""

    prompts: list
    samples: list
    rewards: torch.Tensor  # float[G * n], with the overlong penalty
    penalty: torch.Tensor  # float[G * n]
    per_function: dict[str, list[float]]
    stats: dict[str, float]
    gen_s: float
    reward_s: float
    episodes: Optional[list] = None  # multi-turn: the Episode of each sample (a rollout function's Episodes)
    dropped: Optional[torch.Tensor] = None  # multi-turn: bool[G * n], out of the loss (on_env_error: drop)


def truncated_mask(samples: list) -> torch.Tensor:
    """bool[N]: the samples the engine cut at ``max_new_tokens`` (finish reason ``length``)."""
    return torch.tensor([s.finish_reason == "length" for s in samples])


def generate_round(ctx: GenerationContext, step: int, round_index: int, prompts: list,
                   seed: Optional[int] = None) -> Round:
    """One round: ``num_generations`` responses for each of ``prompts`` (data.Prompt), scored.
    ``seed``: the sampler seed of the round's first response (default: the step's and round's
    ``sampling_seed``; async rollouts give each group its own)."""
    t0 = time.monotonic()
    cfg, engine, sampling, source = ctx.cfg, ctx.engine, ctx.sampling, ctx.episode_source
    n = cfg.rollout.num_generations
    seed = sampling_seed(cfg.trainer.seed, step, round_index) if seed is None else seed
    if source is None:
        episodes = None
        samples = engine.generate([p.prompt_ids for p in prompts], n, sampling, sampling_seed=seed,
                                  return_routed_experts=cfg.algorithm.router_replay)
    else:
        samples, episodes = source.episodes(engine, prompts, n, sampling, seed)
    gen_s = time.monotonic() - t0
    scored = ctx.scorer.score_samples(reward_samples(prompts, samples, ctx.tokenizer))
    reward_s = time.monotonic() - t0 - gen_s
    rewards = torch.tensor(scored.rewards, dtype=torch.float32)
    dropped = None
    if episodes is not None:
        rewards, dropped = episode_rewards(scored.rewards, episodes, n, cfg.episodes)
    penalty = torch.zeros_like(rewards)
    over = cfg.rollout.overlong
    if over.buffer_length is not None:
        lengths = torch.tensor([len(s.output_ids) for s in samples])
        penalty = overlong_penalty(lengths, cfg.rollout.max_new_tokens, over.buffer_length, over.penalty_factor)
    rewards = rewards + penalty
    if over.truncated_reward is not None:
        rewards = truncated_rewards(rewards, truncated_mask(samples), over.truncated_reward)
    return Round(prompts, samples, rewards, penalty, scored.per_function, scored.stats, gen_s, reward_s,
                  episodes, dropped)


def generate_and_score(ctx: GenerationContext, step: int, prompts: list) -> RolloutResult:
    """Generate ``num_generations`` responses per prompt (data.Prompt: ``prompt_ids``,
    ``answer``), score, normalise into advantages; with DAPO dynamic sampling (the config's
    ``rollout.dynamic_sampling``; the rules: ``rollout/dynamic_sampling.py``), extra rounds of
    ``ctx.more_prompts()`` replace groups without signal."""
    n, ds = ctx.cfg.rollout.num_generations, ctx.cfg.rollout.dynamic_sampling
    rounds = [generate_round(ctx, step, 0, prompts)]
    informative = [informative_groups(rounds[0].rewards, n)]
    if ds.enabled and ctx.more_prompts is not None:
        while sum(int(i.sum()) for i in informative) < len(prompts) and len(rounds) <= ds.max_extra_rounds:
            rounds.append(generate_round(ctx, step, len(rounds), ctx.more_prompts()))
            informative.append(informative_groups(rounds[-1].rewards, n))
    return result_from_rounds(ctx, rounds, informative, len(prompts))


def merge_rounds(rounds: list[Round]) -> Round:
    """One round holding the groups of ``rounds`` in order (async rollouts generate each
    group as its own round); times are summed."""
    def cat(values):
        return None if values[0] is None else torch.cat(values)

    return Round([p for r in rounds for p in r.prompts], [s for r in rounds for s in r.samples],
                  torch.cat([r.rewards for r in rounds]), torch.cat([r.penalty for r in rounds]),
                  {k: [v for r in rounds for v in r.per_function[k]] for k in rounds[0].per_function},
                  {k: sum(r.stats.get(k, 0.0) for r in rounds) for k in rounds[0].stats},
                  sum(r.gen_s for r in rounds), sum(r.reward_s for r in rounds),
                  None if rounds[0].episodes is None else [e for r in rounds for e in r.episodes],
                  cat([r.dropped for r in rounds]))


def result_from_rounds(ctx: GenerationContext, rounds: list[Round], informative: list[torch.Tensor],
                       num_prompts: int) -> RolloutResult:
    """The TrainBatch and stats of ``num_prompts`` groups chosen from generated rounds (all of
    round 0's without dynamic sampling); ``informative``: per round, bool [G] (non-zero reward
    variance)."""
    cfg, sampling, tokenizer = ctx.cfg, ctx.sampling, ctx.tokenizer
    n, ds = cfg.rollout.num_generations, cfg.rollout.dynamic_sampling
    picks = choose_groups(informative, num_prompts) if ds.enabled else [(0, g) for g in range(num_prompts)]
    rows = [(r, g * n + j) for r, g in picks for j in range(n)]
    samples = [rounds[r].samples[i] for r, i in rows]
    rewards = torch.stack([rounds[r].rewards[i] for r, i in rows])
    advantages = compute_advantages(rewards, n, cfg.algorithm)
    replay = sampling.sampling_mask_max_kept > 0  # the engine reported its kept sets
    batch = build_train_batch(
        [s.prompt_ids for s in samples], [s.output_ids for s in samples],
        [truncated_log_probs(s.output_logprobs, s.kept_ids, s.log_kept_mass) if replay else s.output_logprobs
         for s in samples],
        advantages, pad_id=_pad_id(tokenizer), output_masks=[s.output_mask for s in samples],
    )
    if replay:  # the trainer scores the same truncated distribution (rollout.batch, ops.vocab_parallel)
        batch.kept_ids = pad_kept_ids([len(s.prompt_ids) for s in samples], [s.kept_ids for s in samples],
                                      batch.seq_length)
    if cfg.algorithm.router_replay:  # the engine's routing, replayed by the trainer (trainer.router_replay)
        batch.routed_experts = pad_routed_experts([s.routed_experts for s in samples], batch.seq_length)
    truncated = truncated_mask(samples)
    if cfg.rollout.overlong.filter:
        batch.loss_mask[truncated] = 0.0  # out of the loss and of its token count
    stats = _stats(samples, rewards, truncated, rounds, n)
    if replay:
        stats.update(_mask_stats(samples))
    if rounds[0].episodes is not None:
        batch.loss_mask[torch.stack([rounds[r].dropped[i] for r, i in rows])] = 0.0
        stats.update(episode_stats([rounds[r].episodes[i] for r, i in rows]))
    for label in rounds[0].per_function:
        stats[f"reward/{label}"] = float(np.mean([rounds[r].per_function[label][i] for r, i in rows]))
    for key in rounds[0].stats:
        stats[f"reward/{key}"] = float(sum(rd.stats.get(key, 0.0) for rd in rounds))
    if ds.enabled:
        kept_informative = sum(bool(informative[r][g]) for r, g in picks)
        stats["dynamic_sampling/num_groups_dropped"] = float(sum(int((~i).sum()) for i in informative))
        stats["dynamic_sampling/num_extra_rounds"] = float(len(rounds) - 1)
        stats["dynamic_sampling/num_groups_short"] = float(len(picks) - kept_informative)
    if cfg.rollout.overlong.buffer_length is not None:
        stats["overlong/penalty_mean"] = float(torch.stack([rounds[r].penalty[i] for r, i in rows]).mean())
    if cfg.rollout.overlong.filter:
        stats["overlong/num_filtered"] = float(truncated.sum())
    return RolloutResult(batch=batch, stats=stats)


def _stats(samples, rewards: torch.Tensor, truncated: torch.Tensor, rounds: list[Round], n: int) -> dict:
    """The step's rollout metrics over the kept samples (throughput over every round)."""
    lengths = np.array([len(s.output_ids) for s in samples], dtype=np.float64)
    group_std = rewards.view(-1, n).std(dim=1, unbiased=True) if n > 1 else torch.zeros(1)
    gen_s = sum(rd.gen_s for rd in rounds)
    generated = sum(len(s.output_ids) for rd in rounds for s in rd.samples)
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "frac_groups_zero_std": float((group_std <= 1e-6).float().mean()),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "truncated_ratio": float(truncated.float().mean()),
        "rollout_tokens_per_s": float(generated / max(gen_s, 1e-9)),
        "rollout/generate_s": gen_s,
        "rollout/reward_s": sum(rd.reward_s for rd in rounds),
        "rollout/weight_version": engine_weight_version([s for rd in rounds for s in rd.samples]),
        # every prompt drawn for this step, extra dynamic-sampling rounds included
        "rollout/prompt_indices": ",".join(str(p.index) for rd in rounds for p in rd.prompts),
    }


def _mask_stats(samples) -> dict[str, float]:
    """Sampling-mask replay over every model token: the mean log kept mass (0 when nothing
    is cut; how far the sampled distribution is from the full one) and the fraction of tokens
    whose set was over the budget (scored on the full distribution)."""
    def model_tokens(s, values):  # multi-turn: observation tokens are context, not draws
        return values if s.output_mask is None else [v for v, m in zip(values, s.output_mask) if m]

    masses = [m for s in samples for m in model_tokens(s, s.log_kept_mass)]
    unsent = sum(ids is None for s in samples for ids in model_tokens(s, s.kept_ids))
    return {"rollout/log_kept_mass_mean": float(np.mean(masses)) if masses else 0.0,
            "rollout/sampling_mask_unsent_frac": unsent / max(len(masses), 1)}


def engine_weight_version(samples) -> int | None:
    """The oldest weight version (the trainer step the engine's weights come from, set by each
    sync) that sampled any of ``samples``, as the engine reported it; None if not a step."""
    versions = [s.weight_version for s in samples]
    return min(int(v) for v in versions) if all(str(v).isdigit() for v in versions) else None


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)
