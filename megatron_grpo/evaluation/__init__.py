"""Held-out evaluation: pass@k (``passk``), the engine-backed evaluator (``runner``) and the
``megatron-grpo eval`` command (``cli``)."""

from megatron_grpo.evaluation.passk import mean_pass_at_k, pass_at_k
from megatron_grpo.evaluation.runner import EvalRound, Evaluator, RoundResult, set_metrics

__all__ = ["EvalRound", "Evaluator", "RoundResult", "mean_pass_at_k", "pass_at_k", "set_metrics"]
