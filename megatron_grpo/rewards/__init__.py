"""Reward functions (a registry of built-ins + user functions by dotted path) and the scorer.

    scorer = RewardScorer(config.reward)                 # ConfigError if a function cannot load
    batch = scorer.score(response_texts, answers)        # RewardError if a function misbehaves
    batch.rewards                                        # weighted sum per response
"""

from megatron_grpo.rewards.answers import answers_equal, extract_final_answer, parse_number
from megatron_grpo.rewards.builtin import format_reward, math_exact_match
from megatron_grpo.rewards.registry import BUILTIN_REWARDS, RewardFn, name_problem, resolve_reward
from megatron_grpo.rewards.scorer import RewardError, RewardScorer, ScoredBatch

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardFn",
    "RewardScorer",
    "ScoredBatch",
    "answers_equal",
    "extract_final_answer",
    "format_reward",
    "math_exact_match",
    "name_problem",
    "parse_number",
    "resolve_reward",
]
