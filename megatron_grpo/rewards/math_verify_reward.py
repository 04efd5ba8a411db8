"""The ``math_verify`` built-in: 1.0 when math-verify finds the response's answer
mathematically equal to the reference answer, else 0.0.

    reward:
      functions:
        - name: math_verify
          kwargs: {extract: none, timeout_s: 5}

``math_verify.parse`` reads both sides (LaTeX, ``\\boxed{}``, plain numbers and expressions, with
sympy) and ``math_verify.verify(reference, response)`` compares them: ``\\boxed{1/2}`` equals
``0.5`` and ``$\\frac{1}{2}$``. With ``extract: none`` (the default) math-verify reads the whole
response itself (a ``\\boxed{}`` first, else the last expression it finds); ``answer_tag``,
``boxed`` or ``last_number`` first cut the answer out (``rewards/answers.py``) and give math-verify
only that. A GSM8K-style reference (``reasoning #### 72``) is cut to what follows ``####``; a
reference or an extracted answer that does not parse as it is is read again as LaTeX math
(``$...$``: ``\\sqrt{2}``, ``x^2+1``).

math-verify's own timeouts use SIGALRM, which fails outside the main thread; they are off, and
the parse and verify run in a worker process under ``timeout_s`` (``rewards/isolated.py``), so
``\\boxed{9^{9^{9^{9}}}}`` (a sympy power that never finishes) scores 0.0 after ``timeout_s``
and is counted as ``reward/<label>/timeouts``. A reference math-verify cannot read at all (an
empty one: read as ``$...$`` it takes nearly any text, ``yes`` as the product ``E*s*y``) scores
0.0, counted as ``reward/<label>/unparsed_references``: such a row can never be rewarded, and
the counter says so.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from megatron_grpo.rewards.answers import ANSWER_EXTRACTORS, ExtractName, reference_answer
from megatron_grpo.rewards.isolated import CallTimeout, IsolatedFunction


class MathVerifyReward:
    """Per-sample reward ``(response, answer) -> float`` (see the module docstring); one instance
    per configured function, holding its worker and counters."""

    requires = {"math_verify": "math-verify"}
    """Import name -> package of what the worker imports (checked when the reward loads)."""

    def __init__(self, *, extract: ExtractName = "none", timeout_s: float = 5.0):
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.extract = ANSWER_EXTRACTORS[extract]
        self.whole = extract == "none"
        self.timeout_s = float(timeout_s)
        self.timeouts = 0
        self.unparsed_references = 0
        self._worker = IsolatedFunction(f"{__name__}:verify_in_worker", "math_verify", setup=f"{__name__}:warm_up")
        self.__name__ = "math_verify"

    def __call__(self, response: str, answer: str) -> float:
        predicted = self.extract(response)
        if predicted is None:
            return 0.0  # nothing to read: no need to ask the worker
        try:
            value = self._worker(predicted, reference_answer(answer), not self.whole, timeout_s=self.timeout_s)
        except CallTimeout:
            self.timeouts += 1
            return 0.0
        if value is None:
            self.unparsed_references += 1
            return 0.0
        return value

    def pop_stats(self) -> dict[str, float]:
        """Counters since the last call (the scorer logs them as ``reward/<label>/<name>``)."""
        out = {"timeouts": float(self.timeouts), "unparsed_references": float(self.unparsed_references)}
        self.timeouts = self.unparsed_references = 0
        return out

    async def aclose(self) -> None:
        self._worker.close()


# ---- in the worker process ----------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _math_verify():
    """The math_verify module, its SIGALRM-timeout warnings silenced (the worker's deadline
    replaces those timeouts)."""
    # in the worker only: math-verify is optional and imports sympy (~0.5 s)
    import math_verify
    import math_verify.grader
    import math_verify.parser

    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    return math_verify


def _parse(text: str, as_math: bool) -> list:
    """math-verify's reading of ``text``, read again as ``$text$`` when that finds nothing and
    ``as_math`` (a bare ``\\sqrt{2}`` parses only inside math delimiters)."""
    mv = _math_verify()
    parsed = mv.parse(text, parsing_timeout=None)
    if not parsed and as_math and "$" not in text:
        parsed = mv.parse(f"${text}$", parsing_timeout=None)
    return parsed


@functools.lru_cache(maxsize=1)
def warm_up() -> None:
    """Import math-verify and build sympy's LaTeX parser: ~0.1 s on an idle core, many times that
    on a busy one, outside a call's deadline (the worker's setup)."""
    verify_in_worker("\\frac{1}{2}", "0.5", True)


@functools.lru_cache(maxsize=4096)
def _parse_reference(reference: str) -> Any:
    return _parse(reference, as_math=True)


def verify_in_worker(predicted: str, reference: str, extracted: bool) -> float | None:
    """1.0 or 0.0; None when the reference does not parse. Runs in the worker."""
    gold = _parse_reference(reference)
    if not gold:
        return None
    target = _parse(predicted, as_math=extracted)
    if not target:
        return 0.0
    return 1.0 if _math_verify().verify(gold, target, timeout_seconds=None) else 0.0
