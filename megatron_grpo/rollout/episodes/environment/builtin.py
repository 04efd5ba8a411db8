"""Built-in environments: ``calculator`` (a tool call and its result) and ``guess_number``
(a game with feedback). Both are constructed with the dataset row and answer ``step`` with
plain text observations; see docs/multi_turn.md for the interface."""

from __future__ import annotations

import ast
import operator
import re

_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
_CALL_RE = re.compile(r"\bcompute\b(?P<expr>[^\n]*)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_EXPRESSION_CHARS = 200
_MAX_MAGNITUDE = 1e12


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression of numbers, + - * / and parentheses (nothing else
    is evaluated); ValueError on anything else, a division by zero or a huge value."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError("expression too long")

    def value(node) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            out = _OPS[type(node.op)](left, right)
            if abs(out) > _MAX_MAGNITUDE:
                raise ValueError("value too large")
            return out
        raise ValueError(f"not arithmetic: {type(node).__name__}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an expression") from None
    return value(tree.body)


def format_number(x: float) -> str:
    """``7`` for 7.0, ``2.5`` for 2.5 (at most 6 decimals)."""
    return str(int(x)) if float(x).is_integer() else f"{x:.6f}".rstrip("0")


def _same_number(text: str, answer: str) -> bool:
    try:
        return abs(float(text) - float(answer)) < 1e-6
    except ValueError:
        return text.strip() == answer.strip()


class Calculator:
    """A calculator tool. A response containing ``compute <expression>`` (numbers, + - * / and
    parentheses) is a tool call: the observation is ``result <value>`` (``result ?`` when the
    expression is not arithmetic). Any other response is the final answer: the episode ends with
    reward 1.0 when its last number equals the row's ``answer``, else 0.0."""

    def __init__(self, row: dict):
        self.answer = str(row.get("answer", "")).strip()

    def step(self, response: str) -> dict:
        call = _CALL_RE.search(response)
        if call is not None:
            try:
                result = format_number(evaluate(call["expr"]))
            except ValueError:
                result = "?"
            return {"observation": f"result {result}", "done": False, "reward": 0.0}
        numbers = _NUMBER_RE.findall(response)
        hit = bool(numbers) and _same_number(numbers[-1], self.answer)
        return {"observation": None, "done": True, "reward": 1.0 if hit else 0.0}


class GuessNumber:
    """Guess the secret integer (the row's ``secret``, else its ``answer``). Each response's last
    integer is a guess: the observation is ``higher`` or ``lower``; a hit ends the episode with
    reward 1.0, a response without a number gets ``a number please``. The turn limit
    (episodes.max_turns) ends a game that was not won (reward 0.0)."""

    def __init__(self, row: dict):
        self.secret = int(row.get("secret", row.get("answer")))

    def step(self, response: str) -> dict:
        numbers = re.findall(r"-?\d+", response)
        if not numbers:
            return {"observation": "a number please", "done": False, "reward": 0.0}
        guess = int(numbers[-1])
        if guess == self.secret:
            return {"observation": None, "done": True, "reward": 1.0}
        return {"observation": "higher" if guess < self.secret else "lower", "done": False, "reward": 0.0}


BUILTINS: dict[str, type] = {"calculator": Calculator, "guess_number": GuessNumber}
"""Built-in environment name -> class (the names ``config.episodes.BUILTIN_ENVIRONMENTS`` accepts)."""
