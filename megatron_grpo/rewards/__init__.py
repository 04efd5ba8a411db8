"""Reward functions (built-ins, user functions by dotted or file path, a remote HTTP reward) and the scorer.

    scorer = RewardScorer(config.reward)                 # ConfigError if a function cannot load
    batch = scorer.score_samples(samples)                # list[RewardSample]; RewardError if a function misbehaves
    batch.rewards                                        # weighted sum per response

How a function is called (per sample or batch, sync or async, which fields it receives) is
decided from its parameter names in ``calling.py``; docs/rewards.md shows each form.

The ``reasoning_gym`` and ``math_verify`` built-ins grade in a worker process under a deadline
(``isolated.py``); their libraries (the ``reasoning`` extra) are imported there only.
"""

from megatron_grpo.rewards.answers import answers_equal, extract_final_answer, parse_number
from megatron_grpo.rewards.builtin import format_reward, math_exact_match
from megatron_grpo.rewards.calling import RewardCall, plan_call
from megatron_grpo.rewards.math_verify_reward import MathVerifyReward
from megatron_grpo.rewards.reasoning_gym_reward import ReasoningGymReward
from megatron_grpo.rewards.registry import BUILTIN_REWARDS, RewardFn, name_problem, resolve_reward
from megatron_grpo.rewards.remote import RemoteReward
from megatron_grpo.rewards.sample import SAMPLE_FIELDS, RewardSample
from megatron_grpo.rewards.scorer import RewardError, RewardScorer, ScoredBatch

__all__ = [
    "BUILTIN_REWARDS",
    "SAMPLE_FIELDS",
    "MathVerifyReward",
    "ReasoningGymReward",
    "RemoteReward",
    "RewardCall",
    "RewardError",
    "RewardFn",
    "RewardSample",
    "RewardScorer",
    "ScoredBatch",
    "answers_equal",
    "extract_final_answer",
    "format_reward",
    "math_exact_match",
    "name_problem",
    "parse_number",
    "plan_call",
    "resolve_reward",
]
