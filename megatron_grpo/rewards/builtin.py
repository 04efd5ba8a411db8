"""Built-in reward functions: ``fn(response: str, answer: str, **kwargs) -> float``.

Each is registered by name in ``megatron_grpo.rewards.registry.BUILTIN_REWARDS``; keyword
arguments come from ``reward.functions[i].kwargs`` in the config.
"""

from __future__ import annotations

from typing import Literal

from megatron_grpo.rewards.answers import (
    answers_equal,
    extract_boxed,
    extract_final_answer,
    extract_hash,
    parse_number,
    reference_answer,
)

FORMAT_STYLES = ("boxed", "hash", "boxed_or_hash", "number")


def math_exact_match(response: str, answer: str, *, use_last_number: bool = True) -> float:
    """1.0 if the response's final answer equals the reference answer, else 0.0.

    The final answer is the last ``\\boxed{...}``, else the text after the last ``####``, else
    (when ``use_last_number``) the last number of the response. The reference is the dataset
    answer (or its part after ``####`` for GSM8K-style answers). Numbers compare by value.
    """
    predicted = extract_final_answer(response, use_last_number=use_last_number)
    if predicted is None:
        return 0.0
    return 1.0 if answers_equal(predicted, reference_answer(answer)) else 0.0


def format_reward(
    response: str, answer: str, *, style: Literal["boxed", "hash", "boxed_or_hash", "number"] = "boxed"
) -> float:
    """1.0 if the response presents its answer in the expected format (right or wrong), else 0.0.

    ``boxed``: a non-empty ``\\boxed{...}``; ``hash``: a ``#### X`` line; ``boxed_or_hash``:
    either; ``number``: the whole response is a single number.
    """
    if style == "boxed":
        found = extract_boxed(response)
        ok = found is not None and bool(found.strip())
    elif style == "hash":
        ok = extract_hash(response) is not None
    elif style == "boxed_or_hash":
        return max(format_reward(response, answer, style="boxed"), format_reward(response, answer, style="hash"))
    elif style == "number":
        ok = parse_number(response) is not None
    else:
        raise ValueError(f"style must be one of {', '.join(FORMAT_STYLES)}, got {style!r}")
    return 1.0 if ok else 0.0
