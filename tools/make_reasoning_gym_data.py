"""Write a reasoning-gym task as prompt data: a training file and a held-out file whose
questions never appear in training.

    python -m tools.make_reasoning_gym_data --task chain_sum --size 2000 --heldout 200 --seed 0 --out data/chain_sum

writes ``OUT/train.jsonl`` (``--size`` rows) and ``OUT/heldout.jsonl`` (``--heldout`` rows), each
file atomically. A row is ``{"prompt", "answer", "entry",
"task_config"}``: the question wrapped by ``--prompt-template``, the answer as a string, the
whole reasoning-gym entry (JSON-safe) and the task settings, so the ``reasoning_gym`` reward
can score a response with the task's own grader (docs/data.md, docs/rewards.md). The format
and the split: ``megatron_grpo/data/reasoning_gym_source.py``.

A task reasoning-gym does not have, or settings it refuses, is one line naming the flag and
what is accepted, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megatron_grpo.data.reasoning_gym_source import (
    DEFAULT_TEMPLATE,
    SPLITS,
    TEMPLATES,
    TaskError,
    check_task,
    make_natural_split,
    make_row,
    make_split,
    prompt_template,
    question_key,
    reasoning_gym_missing,
    write_rows,
)
from megatron_grpo.runtime.errors import one_line
from megatron_grpo.runtime.files import check_writable


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.make_reasoning_gym_data",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", required=True, help="reasoning-gym task name, e.g. chain_sum")
    parser.add_argument("--size", type=int, required=True, help="training rows")
    parser.add_argument("--heldout", type=int, required=True, help="held-out rows")
    parser.add_argument("--seed", type=int, default=0, help="reasoning-gym's seed (default 0)")
    # also --config; the docs say --task-config: every other --config of this project is an experiment's YAML
    parser.add_argument("--task-config", "--config", dest="task_config", default="{}",
                        help="the task's settings as a JSON object, e.g. '{\"min_terms\": 2, \"max_terms\": 4}' "
                             "(default {})")
    parser.add_argument("--prompt-template", default=DEFAULT_TEMPLATE,
                        help=f"one of {', '.join(TEMPLATES)} (default {DEFAULT_TEMPLATE}: asks for the final answer "
                             "inside <answer></answer>), or a text holding {question}")
    parser.add_argument("--split", choices=SPLITS, default="distinct",
                        help="distinct (default): distinct questions in both files, dealt at random from one pool; "
                             "natural: the task's own mix, repeats included, each question in one file only "
                             "(chosen by a seeded hash of it)")
    parser.add_argument("--out", required=True, help="output directory")
    return parser.parse_args(argv)


def settings_of(text: str) -> dict:
    """The ``--task-config`` JSON object; TaskError otherwise."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise TaskError("--task-config", f"not JSON: {' '.join(str(e).split())}") from None
    if not isinstance(value, dict):
        raise TaskError("--task-config", f"expected a JSON object of the task's settings, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        if args.size < 1:
            raise TaskError("--size", f"must be >= 1, got {args.size}")
        if args.heldout < 1:
            raise TaskError("--heldout", f"must be >= 1, got {args.heldout}")
        try:
            template = prompt_template(args.prompt_template)
        except ValueError as e:
            raise TaskError("--prompt-template", str(e)) from None
        task_config = settings_of(args.task_config)
        check_task(args.task, task_config)
        try:  # before the work: a folder that cannot be written failed after it, with a traceback
            check_writable(args.out)
        except OSError as e:
            raise TaskError("--out", one_line(e)) from None
        split = (make_natural_split if args.split == "natural" else make_split)(
            args.task, task_config, args.seed, args.size, args.heldout)
        train = [make_row(e, template, task_config) for e in split.train]
        heldout = [make_row(e, template, task_config) for e in split.heldout]
    except TaskError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # an entry JSON cannot hold exactly (entry_to_json)
        print(f"error: {args.task}: {e}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "reasoning_gym":
            raise
        print(f"error: {reasoning_gym_missing()}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        write_rows(train, out / "train.jsonl")
        write_rows(heldout, out / "heldout.jsonl")
    except OSError as e:  # the folder changed since the check (a full disk): its one line
        print(f"error: --out: {one_line(e)}", file=sys.stderr)
        return 1
    print(f"wrote {len(train)} training and {len(heldout)} held-out rows of {args.task} to {out} "
          f"({len({question_key(e['question']) for e in split.train + split.heldout})} distinct questions in "
          f"{split.num_drawn} draws, "
          f"{time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
