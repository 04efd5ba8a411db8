"""A verifiers ToolEnv for the CPU tool demo's task (docs/agents.md, "verifiers environments"):

    episodes:
      kind: agent
      source: verifiers:examples/agents/verifiers_calculator.py:load_environment
      tool_call_format: compute          # the demo vocabulary's call syntax; hermes for Qwen-style models

The environment is verifiers' own (its turn loop, its tool handling, its rubric); the run's data
rows name its questions by a ``question`` field (or its dataset rows by ``example_id``).
"""

import verifiers as vf
from datasets import Dataset

from megatron_grpo.rollout.episodes.environment.builtin import evaluate, format_number

QUESTIONS = [(f"what is {a} plus {b}", str(a + b)) for a, b in [(3, 4), (9, 9), (2, 6), (10, 5), (40, 2)]]


def compute(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

    Args:
        expression: the expression, e.g. 12 + 30
    """
    try:
        return f"result {format_number(evaluate(expression))}"
    except ValueError:
        return "result ?"


def correct(parser, completion, answer) -> float:
    """1.0 when the final answer's last word is the reference answer."""
    words = (parser.parse_answer(completion) or "").split()
    return float(bool(words) and words[-1] == answer)


def load_environment():
    dataset = Dataset.from_list([{"question": q, "answer": a} for q, a in QUESTIONS])
    return vf.ToolEnv(dataset=dataset, tools=[compute], rubric=vf.Rubric(funcs=[correct]), max_turns=2)
