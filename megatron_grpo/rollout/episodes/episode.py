"""One finished episode (``Episode``), whoever ran it, and what a step does with a batch of them:
the jobs of a step (``episode_jobs``), its failures (``raise_failures``, ``report_failure_once``),
its rewards (``episode_rewards``: the environment's reward added or replacing, failed episodes
scored as ``episodes.on_env_error`` says) and its ``multi_turn/*`` and ``agent/*`` metrics.
Shared by the three sources (``environment/``, ``agent/``, ``function/``)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_grpo.config.episodes import EpisodesConfig
from megatron_grpo.wire.samples import Sample

@dataclass
class Episode:
    """One finished episode: its sample (the whole token sequence) and what the loop saw."""

    sample: Sample
    num_turns: int
    """Model turns."""
    env_reward: float
    """Sum of the environment's per-step rewards."""
    error: Optional[str] = None
    """None, or why the episode ended early: ``error`` (the environment raised or died),
    ``timeout``, ``observation`` (an observation with unknown tokens) or, for agent episodes,
    ``diverged`` (a call's prompt did not continue the episode's tokens)."""
    observations_cut: int = 0
    """Observations longer than the episode's token budget allows in characters, cut before
    they were rendered (``TurnRenderer.observation_char_limit``)."""
    env_s: float = 0.0
    """Seconds in environment calls (construction and steps)."""
    generate_s: float = 0.0
    """Seconds in the engine's generate calls."""
    tool_call_errors: int = 0
    """Agent episodes (``rollout/episodes/agent``): malformed tool calls the model wrote (the agent saw them as text)."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """Agent episodes: the numbers the agent returned besides its reward."""
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    """The environment's named event counts, summed over its steps (a step's optional
    ``counts``: the tools connector's tool calls and failed ones, say); its
    ``tool_call_errors`` go to ``tool_call_errors`` instead, the agent episodes' count."""

    @property
    def num_model_tokens(self) -> int:
        mask = self.sample.output_mask
        return len(self.sample.output_ids) if mask is None else int(sum(mask))

    @property
    def num_observation_tokens(self) -> int:
        return len(self.sample.output_ids) - self.num_model_tokens


def episode_jobs(prompts: Sequence, n: int) -> list[tuple[int, int, int, object]]:
    """``(episode index, prompt index, sample index, prompt)`` of ``n`` episodes per prompt, prompt-major."""
    return [(i * n + j, i, j, p) for i, p in enumerate(prompts) for j in range(n)]


def raise_failures(results: Sequence, contract: type[BaseException]) -> None:
    """Raise the first exception among every episode's ``results`` (all episodes have ended),
    a ``contract`` error first: it is the user's bug, not a transient failure."""
    for r in results:
        if isinstance(r, contract):
            raise r
    for r in results:
        if isinstance(r, BaseException):
            raise r


def report_failure_once(reported: set, key: str, kind: str, where: str, message: str, on_env_error: str) -> None:
    """Print an episode's failure once per (kind, site) in ``reported`` (the caller's set);
    every occurrence is counted in the metrics. ``key``: the config key of what failed."""
    if (kind, where) in reported:
        return
    reported.add((kind, where))
    print(f"[megatron-grpo] {key} {kind} at {where}: {message} (the episode ends and is scored as "
          f"episodes.on_env_error={on_env_error!r}; further ones here are only counted)", file=sys.stderr, flush=True)


def episode_rewards(scored: Sequence[float], episodes: Sequence[Episode], n: int,
                    episodes_cfg: EpisodesConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards float[G * n], dropped bool[G * n]): the reward functions' ``scored`` combined
    with each episode's environment reward (``env_reward``: add or replace), failed episodes
    scored as ``on_env_error`` says (zero_reward: 0; drop: their group's mean over its
    other episodes, and dropped from the loss)."""
    env = torch.tensor([e.env_reward for e in episodes], dtype=torch.float32)
    rewards = env if episodes_cfg.env_reward == "replace" else torch.tensor(scored, dtype=torch.float32) + env
    failed = torch.tensor([e.error is not None for e in episodes])
    dropped = torch.zeros_like(failed)
    if episodes_cfg.on_env_error == "zero_reward":
        rewards = torch.where(failed, torch.zeros_like(rewards), rewards)
    else:
        dropped = failed
        groups_r, groups_f = rewards.view(-1, n), failed.view(-1, n)
        for g in range(groups_r.shape[0]):
            ok = ~groups_f[g]
            fill = groups_r[g][ok].mean() if ok.any() else torch.tensor(0.0)
            groups_r[g][groups_f[g]] = fill
        rewards = groups_r.reshape(-1)
    return rewards, dropped


def episode_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """The step's ``multi_turn/...`` metrics over ``episodes``; an environment's named counts
    (``Episode.counts``) summed as ``multi_turn/env/<name>``, for the names this step reported."""
    turns = np.array([e.num_turns for e in episodes], dtype=np.float64)
    stats = {
        "multi_turn/turns_mean": float(turns.mean()),
        "multi_turn/turns_max": float(turns.max()),
        "multi_turn/model_tokens_mean": float(np.mean([e.num_model_tokens for e in episodes])),
        "multi_turn/observation_tokens_mean": float(np.mean([e.num_observation_tokens for e in episodes])),
        "multi_turn/env_reward_mean": float(np.mean([e.env_reward for e in episodes])),
        "multi_turn/env_errors": float(sum(e.error == "error" for e in episodes)),
        "multi_turn/env_timeouts": float(sum(e.error == "timeout" for e in episodes)),
        "multi_turn/observations_refused": float(sum(e.error == "observation" for e in episodes)),
        "multi_turn/observations_cut": float(sum(e.observations_cut for e in episodes)),
        "multi_turn/diverged": float(sum(e.error == "diverged" for e in episodes)),
        "multi_turn/tool_call_errors": float(sum(e.tool_call_errors for e in episodes)),
        "multi_turn/env_s": float(sum(e.env_s for e in episodes)),
        "multi_turn/generate_s": float(sum(e.generate_s for e in episodes)),
        **agent_metrics(episodes),
    }
    for e in episodes:
        for name, n in e.counts.items():
            stats[f"multi_turn/env/{name}"] = stats.get(f"multi_turn/env/{name}", 0.0) + float(n)
    return stats


def agent_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """``agent/<name>_mean``: each number an agent returned besides its reward, averaged over
    the episodes that returned it."""
    names = sorted({k for e in episodes for k in e.metrics})
    return {f"agent/{k}_mean": float(np.mean([e.metrics[k] for e in episodes if k in e.metrics])) for k in names}
