"""Synthetic single-token arithmetic problems for the CPU demo.

Each line is ``{"prompt": "what is 7 + 5 ?", "answer": "12"}``. Operands are drawn from
``0..max_operand`` (subtraction only when the result is >= 0), so every answer is an integer
in 0..MAX_NUMBER = 199: ONE token of the tiny tokenizer (``tools/tiny.py``
takes its numbers from ``MAX_NUMBER`` here) and the task is solved by emitting one right token.
``chance_reward`` is the best reward a policy ignoring the question can reach (always answering
the most frequent answer); the generator refuses a task where it exceeds 0.2, so a demo that
reaches 0.9 has learned arithmetic.

    python -m megatron_grpo.data.synthetic --out data/arith.jsonl --num 2000 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter
from pathlib import Path

MAX_NUMBER = 199
"""Largest answer of the task; the tiny tokenizer has one token for each of 0..MAX_NUMBER."""

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
"""Operator symbol -> result; each symbol is one token of the tiny tokenizer."""

MAX_CHANCE_REWARD = 0.2


def all_problems(max_operand: int, ops: list[str]) -> list[tuple[str, int]]:
    """Every (prompt, answer) of the task, in a fixed order; answers are in 0..MAX_NUMBER."""
    problems = []
    for op in ops:
        for a in range(max_operand + 1):
            for b in range(max_operand + 1):
                result = OPS[op](a, b)
                if 0 <= result <= MAX_NUMBER:
                    problems.append((f"what is {a} {op} {b} ?", result))
    return problems


def chance_reward(answers: list) -> float:
    """Reward of the best question-blind policy: the frequency of the most common answer."""
    return Counter(answers).most_common(1)[0][1] / len(answers)


def generate(num: int, seed: int, max_operand: int = 9, ops: tuple[str, ...] = ("+",),
             exclude: frozenset[str] = frozenset()) -> list[dict]:
    """``num`` problems drawn uniformly (with replacement) from the task, leaving out the
    prompts in ``exclude`` (a held-out set); seeded."""
    if num < 1:
        raise ValueError(f"--num must be >= 1, got {num}")
    if max_operand < 1:
        raise ValueError(f"--max-operand must be >= 1, got {max_operand}")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"--ops: unknown operator(s) {unknown}; choose from {' '.join(OPS)}")
    problems = all_problems(max_operand, list(ops))
    chance = chance_reward([answer for _, answer in problems])
    if chance > MAX_CHANCE_REWARD:
        raise ValueError(
            f"the task is too easy: always answering the most common answer scores {chance:.2f} > "
            f"{MAX_CHANCE_REWARD}; raise --max-operand or add operators"
        )
    pool = [(p, a) for p, a in problems if p not in exclude]
    if not pool:
        raise ValueError("every problem is held out")
    rng = random.Random(seed)
    return [{"prompt": p, "answer": str(a)} for p, a in (rng.choice(pool) for _ in range(num))]


def held_out_problems(max_operand: int, num: int, seed: int) -> list[tuple[str, int]]:
    """``num`` addition problems ``a + b`` with ``a > b`` to hold out of training, seeded. Their
    mirror ``b + a`` stays in training, so solving them needs more than a lookup table of
    the problems seen (commutativity), yet the task's answers all remain trained."""
    candidates = [(f"what is {a} + {b} ?", a + b) for a in range(max_operand + 1) for b in range(a)]
    if not 1 <= num <= len(candidates):
        raise ValueError(f"can hold out 1..{len(candidates)} problems, asked for {num}")
    return sorted(random.Random(seed).sample(candidates, num))


def write_jsonl(records: list[dict], out: str | Path) -> Path:
    """Write ``records`` one JSON object a line, atomically (temp file + rename)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_grpo.data.synthetic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output .jsonl file")
    parser.add_argument("--num", type=int, default=2000, help="number of problems (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--max-operand", type=int, default=9, help="operands are drawn from 0..N (default 9)")
    parser.add_argument("--ops", default="+", help="operators, e.g. '+' or '+,-,*' (default '+')")
    args = parser.parse_args(argv)
    try:
        records = generate(args.num, args.seed, args.max_operand, tuple(o for o in args.ops.split(",") if o))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_jsonl(records, args.out)
    ops = [o for o in args.ops.split(",") if o]
    task = all_problems(args.max_operand, ops)
    chance = chance_reward([answer for _, answer in task])
    print(f"wrote {len(records)} problems to {args.out} ({len({r['prompt'] for r in records})} distinct of "
          f"{len(task)}; best question-blind reward {chance:.3f}, uniform guess {1 / (MAX_NUMBER + 1):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
