"""Built-in rewards against hand-written expectations, incl. the tiny tokenizer's spaced decoding."""

import pytest

from megatron_grpo.rewards import extract_final_answer, format_reward, math_exact_match, parse_number
from megatron_grpo.rewards.answers import extract_boxed
from tools.tiny import build_tokenizer

EXACT_MATCH_CASES = [
    # (response, answer, use_last_number, expected reward)
    ("the answer is \\boxed{12}", "12", True, 1.0),
    ("the answer is \\boxed{12}", "13", True, 0.0),
    ("\\boxed{12.0}", "12", True, 1.0),
    ("\\boxed{1,000}", "1000", True, 1.0),
    ("\\boxed{\\$12}", "12", True, 1.0),
    ("so it costs $12.", "12", True, 1.0),
    ("first \\boxed{3} then \\boxed{12}", "12", True, 1.0),  # the last box counts
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, 1.0),  # nested braces, compared as text
    ("\\boxed{3/4}", "0.75", True, 1.0),
    ("\\ boxed { 12 }", "12", True, 1.0),  # tiny tokenizer spacing
    ("\\boxed { - 5 }", "-5", True, 1.0),
    ("step 1 ... #### 72", "72", True, 1.0),
    ("# # # # 72", "72", True, 1.0),  # tiny tokenizer spacing of ####
    ("12", "Natalia sold 48/2 = 24 clips ... #### 12", True, 1.0),  # GSM8K-style reference answer
    ("I think 5 plus 7 is 12", "12", True, 1.0),
    ("I think 5 plus 7 is 12", "12", False, 0.0),  # no box, no ####, last number disabled
    ("12 is wrong, \\boxed{13}", "12", True, 0.0),  # a box beats the last-number fallback
    ("\\boxed{12", "12", True, 1.0),  # unclosed box ignored; falls back to the last number
    ("\\boxed{12", "12", False, 0.0),
    ("no number here", "12", True, 0.0),
    ("", "12", True, 0.0),
    ("\\boxed{twelve}", "twelve", True, 1.0),
    ("1,2", "12", True, 0.0),  # not a thousands separator
]


@pytest.mark.parametrize("response, answer, use_last, expected", EXACT_MATCH_CASES)
def test_math_exact_match(response, answer, use_last, expected):
    assert math_exact_match(response, answer, use_last_number=use_last) == expected


def test_exact_match_on_tiny_tokenizer_round_trip():
    tok = build_tokenizer()
    for text, answer in [("the answer is \\boxed{12}", "12"), ("#### 7", "7"), ("15", "15")]:
        decoded = tok.decode(tok(text, add_special_tokens=False)["input_ids"])
        assert math_exact_match(decoded, answer) == 1.0, decoded
        assert math_exact_match(decoded, str(int(answer) + 1)) == 0.0


def test_extraction_helpers():
    assert extract_boxed("a \\boxed{x^{2}+{1}} b") == "x^{2}+{1}"
    assert extract_final_answer("\\boxed{} #### 4") == "4"  # an empty box is no answer
    assert parse_number("12") == parse_number("12.00") == parse_number("$12") == parse_number("12.") == 12
    assert parse_number("1,000,000") == 1_000_000 and parse_number("-0.5") == parse_number("-1/2")
    assert parse_number("1/0") is None and parse_number("12a") is None


@pytest.mark.parametrize("response, style, expected", [
    ("so \\boxed{7}", "boxed", 1.0),
    ("so \\boxed{ }", "boxed", 0.0),
    ("so 7", "boxed", 0.0),
    ("#### 7", "hash", 1.0),
    ("# # # # 7", "hash", 1.0),
    ("\\boxed{7}", "hash", 0.0),
    ("\\boxed{7}", "boxed_or_hash", 1.0),
    ("#### 7", "boxed_or_hash", 1.0),
    (" 12 ", "number", 1.0),
    ("12 apples", "number", 0.0),
])
def test_format_reward(response, style, expected):
    assert format_reward(response, "unused", style=style) == expected


HOSTILE_1MB = {  # what a long chain of thought can emit: 1 MB of openings that never close, and such
    "unclosed answer tags": "<answer>" * (1 << 17),
    "unclosed boxes": "\\boxed{" * (1 << 17),
    "hash marks": "# " * (1 << 19),
    "thousands": "1," * (1 << 19),
    "decimals": "1." * (1 << 19),
    "signs": "-" * (1 << 20),
    "braces": "\\boxed{" + "{" * (1 << 20),
}

_SCORE_HOSTILE = """
import sys, time
sys.path.insert(0, sys.argv[1])
from megatron_grpo.rewards.answers import ANSWER_EXTRACTORS, answers_equal, extract_final_answer, reference_answer
from megatron_grpo.rewards.builtin import FORMAT_STYLES, format_reward, math_exact_match
from tests.test_rewards_builtin import HOSTILE_1MB
for name, text in HOSTILE_1MB.items():
    start = time.perf_counter()
    for extract in ANSWER_EXTRACTORS.values():
        extract(text)
    extract_final_answer(text), reference_answer(text), answers_equal(text, "12"), math_exact_match(text, "12")
    for style in FORMAT_STYLES:
        format_reward(text, "12", style=style)
    print(f"{name}: {time.perf_counter() - start:.2f} s", flush=True)
"""


def test_every_extractor_is_linear_on_1mb_of_hostile_text(tmp_path):
    """Every parse of a response runs in the trainer, outside any deadline, so each must be linear:
    the regex ``<answer>(.*?)</answer>`` took minutes on 1 MB of unclosed tags (issue 64). In a
    child process, so a quadratic parse fails the test at its deadline instead of hanging it."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    try:
        done = subprocess.run([sys.executable, "-c", _SCORE_HOSTILE, str(root)], capture_output=True, text=True,
                              timeout=30, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the extractors took over 30 s on 1 MB; finished: {e.stdout!r}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(" s\n") == len(HOSTILE_1MB), done.stdout


@pytest.mark.parametrize("text", [
    "<answer>1</answer>", "<answer>1</answer> <answer>2</answer>", "<answer><answer>2</answer>",
    "<answer>1</answer><answer>", "</answer><answer>3</answer></answer>", "<answer>\n x \n</answer>", "no tag",
    "<answer>a</answer><answer>b", "<answer></answer>",
])
def test_answer_tag_reads_as_the_regex(text):
    """The linear scan finds the pair reasoning-gym's regex finds (its last match, stripped)."""
    import re

    from megatron_grpo.rewards.answers import extract_answer_tag

    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    assert extract_answer_tag(text) == (found[-1].strip() if found else None)
