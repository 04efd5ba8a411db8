"""`rollout.dynamic_sampling:` and `rollout.overlong:`: DAPO's batch shaping (Yu et al. 2025,
"DAPO", sections 3.2 and 3.4). The mechanics are ``rollout.dynamic_sampling``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_grpo.config.base import check


@dataclass(kw_only=True)
class DynamicSamplingConfig:
    """`rollout.dynamic_sampling:` drop prompt groups whose rewards all agree (zero advantage,
    no gradient) and sample more prompts until the step has prompts_per_step informative groups."""

    enabled: bool = False
    """Drop groups whose reward std is <= 1e-6 and draw replacement prompts."""

    max_extra_rounds: int = 4
    """Most extra generation rounds per step. When the cap is reached with too few
    informative groups, the step is filled with dropped groups (they carry no gradient)
    and `dynamic_sampling/num_groups_short` counts them."""

    def __post_init__(self):
        check(self.max_extra_rounds >= 0, "max_extra_rounds", f"must be >= 0, got {self.max_extra_rounds}")


@dataclass(kw_only=True)
class OverlongConfig:
    """`rollout.overlong:` DAPO's soft overlong punishment and overlong filtering."""

    buffer_length: Optional[int] = None
    """L_cache of the soft punishment. null: no penalty. Set: a response of length L gets
    penalty_factor * ((L_max - L_cache) - L) / L_cache added to its reward when
    L_max - L_cache < L <= L_max (L_max = rollout.max_new_tokens), 0 below; must be in
    1..max_new_tokens."""

    penalty_factor: float = 1.0
    """Scale of the soft punishment (-penalty_factor at L = L_max)."""

    filter: bool = False
    """Mask responses the engine truncated (finish reason `length`) out of the loss: they keep
    their place in their group's reward statistics but contribute no tokens."""

    truncated_reward: Optional[float] = None
    """null: a response the engine truncated (finish reason `length`) is graded like any other.
    A number: it gets this reward in place of its score and of the soft punishment, so a
    response cut at max_new_tokens earns no credit for what its last words happen to say (a
    loop of digits that stops on the right number would otherwise be rewarded and grow). An
    episode (environment, agent) is truncated when it ended on a cut: its last model turn cut
    at max_new_tokens or by episodes.max_episode_tokens, or no room left for the next
    observation; a turn cut earlier that the episode went on from is not."""

    def __post_init__(self):
        check(self.truncated_reward is None or math.isfinite(self.truncated_reward), "truncated_reward",
              f"must be a finite number or null, got {self.truncated_reward}")
        check(self.buffer_length is None or self.buffer_length >= 1, "buffer_length",
              f"must be >= 1 or null, got {self.buffer_length}")
        check(self.penalty_factor >= 0, "penalty_factor", f"must be >= 0, got {self.penalty_factor}")
