"""DAPO's batch shaping (Yu et al. 2025, "DAPO: an open-source LLM RL system at scale"):
dynamic sampling (section 3.2), soft overlong punishment and overlong filtering (3.4).

Pure functions over the rewards and lengths of generated groups; ``rollout.generate``
runs the generation rounds. Groups are contiguous blocks of ``num_generations`` responses.

Departures from the paper:
* A group is "zero variance" when its reward std (unbiased) is <= 1e-6, the tolerance the
  advantages use (so exactly the groups whose advantages are all 0 are dropped); the paper
  tests accuracy equal to 0 or 1.
* When ``max_extra_rounds`` runs out with too few informative groups, the batch is filled
  with dropped groups (zero advantage, no gradient) instead of failing, so every step keeps
  its shape; ``dynamic_sampling/num_groups_short`` counts them.
* ``overlong.truncated_reward`` is not in the paper: it replaces a truncated response's
  reward (score and soft punishment together) by a constant, a harder form of the soft
  punishment's last step that also removes whatever the grader credited in the cut text.
* The soft punishment uses L_max = ``rollout.max_new_tokens`` (the engine cannot produce a
  longer response, so the paper's "L > L_max: -1" case never arises: L = L_max gives -1).
"""

from __future__ import annotations

import torch

from megatron_grpo.losses.advantages import ZERO_STD_TOL


def overlong_penalty(lengths_N: torch.Tensor, max_new_tokens: int, buffer_length: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, float[N] (<= 0), for response lengths ``lengths_N``:
    0 when L <= L_max - L_cache; factor * ((L_max - L_cache) - L) / L_cache up to L_max; -factor
    beyond. E.g. L_max 10, L_cache 4: L = 6 -> 0, 8 -> -0.5, 10 -> -1."""
    lengths = lengths_N.double()
    expected = max_new_tokens - buffer_length
    ramp = (expected - lengths) / buffer_length
    out = torch.where(lengths <= expected, torch.zeros_like(lengths), ramp.clamp(min=-1.0))
    return (out * factor).float()


def truncated_rewards(rewards_N: torch.Tensor, truncated_N: torch.Tensor, value: float) -> torch.Tensor:
    """float[N]: ``rewards_N`` with every truncated response's reward (bool ``truncated_N``)
    replaced by ``value``. E.g. [1, 0.5, 1], [F, T, T], 0 -> [1, 0, 0]."""
    return torch.where(truncated_N, torch.full_like(rewards_N, value), rewards_N)


def informative_groups(rewards_N: torch.Tensor, num_generations: int) -> torch.Tensor:
    """bool[G]: groups whose rewards do not all agree (std > 1e-6). rewards_N: float[G * n]."""
    std_G = rewards_N.double().view(-1, num_generations).std(dim=1, unbiased=True)
    return std_G > ZERO_STD_TOL


def choose_groups(informative_per_round: list[torch.Tensor], num_groups: int) -> list[tuple[int, int]]:
    """The (round, group) pairs of the step: informative groups in generation order, first
    ``num_groups`` of them; if fewer, filled with the first dropped ones.
    E.g. ([T, F], [F, T, T]), 3 -> [(0, 0), (1, 1), (1, 2)]."""
    keep = [(r, g) for r, inf in enumerate(informative_per_round) for g in range(len(inf)) if inf[g]]
    fill = [(r, g) for r, inf in enumerate(informative_per_round) for g in range(len(inf)) if not inf[g]]
    return (keep + fill)[:num_groups]
