"""Multi-digit addition with a written-out chain of thought: the CPU reasoning workload.

A problem adds two numbers of 1..``max_digits`` digits. Numbers are written digit by digit
(each digit one word of a word-level tokenizer); the response works the columns from the
right, one clause per column, then gives the answer after ``####``::

    prompt:    what is 4 5 7 + 6 8 ?
    response:  7 + 8 + 0 = 15 write 5 carry 1 , 5 + 6 + 1 = 12 write 2 carry 1 ,
               4 + 0 + 1 = 5 write 5 carry 0 , #### 5 2 5
    answer:    525

The longer operand's digit count follows a geometric tail, ``P(n) ~ tail ** (n - 2)``, so most
responses are tens of tokens and a few are long. The final answer is scored by
``math_exact_match`` with ``use_last_number: false``: the chain is not graded.

Held-out problems: an operand pair is held out when a hash of the *unordered* pair falls in the
held-out bucket (``is_held_out``), so no held-out operand combination, in either order, is in
warm-up or training data. ``WORDS`` are the words a tokenizer must have as single tokens beyond
digits, small numbers and ``+ = , ? #`` (``tools/make_reasoning_model.py`` adds them).

    python -m megatron_grpo.data.reasoning --out data/add_train.jsonl --num 4000 --seed 0

Lengths measured, the model and the run: docs/reasoning.md#the-task-and-its-format.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from dataclasses import dataclass

from megatron_grpo.data.synthetic import write_jsonl

WORDS = ("what", "is", "write", "carry")
"""Words of the prompt and chain besides numbers and symbols."""

HELD_OUT_BUCKETS = 20
"""An operand pair is held out when its hash modulo this is 0 (5% of all pairs)."""


@dataclass(frozen=True, kw_only=True)
class AdditionTask:
    """The distribution problems are drawn from."""

    max_digits: int = 12
    """Digits of the longer operand are drawn from 2..max_digits."""

    tail: float = 0.6
    """P(n digits) is proportional to tail ** (n - 2): the smaller, the shorter the chains."""

    def __post_init__(self):
        if not 2 <= self.max_digits <= 40:
            raise ValueError(f"max_digits must be in 2..40, got {self.max_digits}")
        if not 0.0 < self.tail <= 1.0:
            raise ValueError(f"tail must be in (0, 1], got {self.tail}")

    def digit_weights(self) -> list[float]:
        """P(longer operand has n digits) for n = 2..max_digits."""
        w = [self.tail ** (n - 2) for n in range(2, self.max_digits + 1)]
        return [x / sum(w) for x in w]


def spaced(n: int) -> str:
    """``457`` -> ``"4 5 7"``: one token per digit."""
    return " ".join(str(n))


def prompt_of(a: int, b: int) -> str:
    return f"what is {spaced(a)} + {spaced(b)} ?"


def chain_of(a: int, b: int) -> str:
    """The worked response for ``a + b``: one clause per column, then ``#### answer``."""
    da, db = str(a)[::-1], str(b)[::-1]
    clauses, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        s = x + y + carry
        clauses.append(f"{x} + {y} + {carry} = {s} write {s % 10} carry {s // 10} ,")
        carry = s // 10
    return " ".join(clauses) + f" #### {spaced(a + b)}"


def is_held_out(a: int, b: int) -> bool:
    """Whether the unordered operand pair {a, b} belongs to the held-out split."""
    lo, hi = min(a, b), max(a, b)
    return int(hashlib.sha1(f"{lo}+{hi}".encode()).hexdigest(), 16) % HELD_OUT_BUCKETS == 0


def draw_pair(rng: random.Random, task: AdditionTask) -> tuple[int, int]:
    """Operands: the longer has n digits (geometric tail), the other 1..n; order random."""
    n = rng.choices(range(2, task.max_digits + 1), weights=task.digit_weights())[0]
    m = rng.randint(1, n)
    a = rng.randint(10 ** (n - 1), 10 ** n - 1)
    b = rng.randint(0 if m == 1 else 10 ** (m - 1), 10 ** m - 1)
    return (a, b) if rng.random() < 0.5 else (b, a)


def generate(num: int, seed: int, task: AdditionTask = AdditionTask(), *, held_out: bool = False) -> list[dict]:
    """``num`` distinct problems of the training split (or, ``held_out=True``, of the held-out
    split), seeded. Rows: ``{"prompt", "answer", "chain", "digits"}``: ``chain`` is the worked
    response (the warm-up's target; GRPO never reads it), ``digits`` the longer operand's."""
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < num:
        a, b = draw_pair(rng, task)
        if is_held_out(a, b) != held_out or (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({"prompt": prompt_of(a, b), "answer": str(a + b), "chain": chain_of(a, b),
                     "digits": max(len(str(a)), len(str(b)))})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_grpo.data.reasoning",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output .jsonl file")
    parser.add_argument("--num", type=int, default=4000, help="number of problems (default 4000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--max-digits", type=int, default=AdditionTask.max_digits,
                        help=f"longest operand, in digits (default {AdditionTask.max_digits})")
    parser.add_argument("--tail", type=float, default=AdditionTask.tail,
                        help=f"geometric tail of the digit count (default {AdditionTask.tail})")
    parser.add_argument("--held-out", action="store_true", help="draw from the held-out split instead")
    args = parser.parse_args(argv)
    try:
        rows = generate(args.num, args.seed, AdditionTask(max_digits=args.max_digits, tail=args.tail),
                        held_out=args.held_out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} {'held-out' if args.held_out else 'training'} problems to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
