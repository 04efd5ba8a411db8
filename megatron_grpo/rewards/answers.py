"""Final-answer extraction and number normalisation for math rewards.

Responses are decoded text, and decoders differ in spacing: a word-level tokenizer (the tiny
test tokenizer) decodes ``\\boxed{12}`` as ``\\ boxed { 12 }`` and ``#### 12`` as
``# # # # 12``. The markers are therefore matched with optional whitespace between their
characters, and whitespace is removed from an extracted answer before comparing.

Two answers are equal when both parse as numbers with the same value (``12`` = ``12.0`` =
``$12`` = ``12.`` and ``1,000`` = ``1000``; ``3/4`` = ``0.75``), else when their
whitespace-free text is identical.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Callable, Literal, Optional

BOXED_RE = re.compile(r"\\\s*boxed\s*\{")
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
HASH_RE = re.compile(r"#\s*#\s*#\s*#")  # GSM8K's "#### 72" marker, possibly decoded with spaces
LAST_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
DECIMAL_RE = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)$")
FRACTION_RE = re.compile(r"^[-+]?\d+/\d+$")


def extract_boxed(text: str) -> Optional[str]:
    """Content of the LAST ``\\boxed{...}`` (nested braces balanced), or None if absent/unclosed."""
    starts = [m.end() for m in BOXED_RE.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def extract_hash(text: str) -> Optional[str]:
    """Rest of the line after the LAST ``####`` marker, or None if absent or empty."""
    marks = list(HASH_RE.finditer(text))
    if not marks:
        return None
    rest = text[marks[-1].end():].split("\n", 1)[0].strip()
    return rest or None


def last_number(text: str) -> Optional[str]:
    """The last number in ``text`` (``-3``, ``1,000``, ``2.5``), or None."""
    found = LAST_NUMBER_RE.findall(text)
    return found[-1] if found else None


def extract_answer_tag(text: str) -> Optional[str]:
    """Content of the LAST complete ``<answer>...</answer>``, stripped (reasoning-gym's
    convention, as its ``extract_answer``), or None.

    The pairs are those of the regex ``<answer>(.*?)</answer>`` scanned left to right (the first
    opening tag after the previous pair, up to the next closing tag), found with ``str.find``:
    the regex tries every unclosed opening tag against the rest of the text, which is quadratic
    (1 MB of ``<answer>`` kept the trainer busy for minutes, outside any deadline); this is one
    pass (issue 64).
    """
    found, pos = None, 0
    while (start := text.find(ANSWER_OPEN, pos)) >= 0:
        end = text.find(ANSWER_CLOSE, start + len(ANSWER_OPEN))
        if end < 0:
            break  # no closing tag after this opening one, so none after any later one either
        found, pos = text[start + len(ANSWER_OPEN):end], end + len(ANSWER_CLOSE)
    return found.strip() if found is not None else None


def extract_boxed_answer(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{}``, stripped (None when absent or empty)."""
    found = extract_boxed(text)
    return None if found is None else found.strip() or None


def extract_whole(text: str) -> Optional[str]:
    """The whole response, stripped (None when that is empty)."""
    return text.strip() or None


ANSWER_EXTRACTORS: dict[str, Callable[[str], Optional[str]]] = {
    "answer_tag": extract_answer_tag,
    "boxed": extract_boxed_answer,
    "last_number": last_number,
    "none": extract_whole,
}
"""How a reward that takes ``extract`` reads the answer out of a response: the text inside the
last ``<answer></answer>``, the last ``\\boxed{}``, the last number, or the whole response;
None when there is none (the answer is then wrong)."""

ExtractName = Literal["answer_tag", "boxed", "last_number", "none"]
"""The names of ``ANSWER_EXTRACTORS``, as a type a reward's ``extract`` kwarg is checked against."""


def extract_final_answer(text: str, use_last_number: bool = True) -> Optional[str]:
    """Final answer of a response: ``\\boxed{}``, else ``####``, else (optionally) the last number."""
    for extract in (extract_boxed, extract_hash):
        found = extract(text)
        if found is not None and found.strip():
            return found
    return last_number(text) if use_last_number else None


def reference_answer(answer: str) -> str:
    """The comparable part of a dataset answer: GSM8K answers keep reasoning before ``####``."""
    found = extract_hash(answer)
    return found if found is not None else answer


def parse_number(text: str) -> Optional[Fraction]:
    """Exact value of a number written as ``12``, ``-12.50``, ``$1,000``, ``3/4``, ``12.``; else None."""
    s = "".join(text.split())
    s = s.replace("\\$", "").replace("$", "").rstrip(".")  # currency; a sentence's full stop
    if THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    try:
        if DECIMAL_RE.match(s):
            return Fraction(Decimal(s))
        if FRACTION_RE.match(s):
            num, den = s.split("/")
            return Fraction(int(num), int(den)) if int(den) != 0 else None
    except (InvalidOperation, ValueError):
        return None
    return None


def answers_equal(predicted: str, reference: str) -> bool:
    """Same numeric value if both are numbers, else the same text ignoring whitespace."""
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return a == b
    return "".join(predicted.split()) == "".join(reference.split())
