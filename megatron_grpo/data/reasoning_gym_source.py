"""Prompt rows from a reasoning-gym task, each carrying the entry its own grader scores.

    python -m tools.make_reasoning_gym_data --task chain_sum --size 2000 --heldout 200 --seed 0 --out data/chain_sum

One row per reasoning-gym entry::

    {"prompt": "<the question, wrapped by the prompt template>",
     "answer": "<the entry's answer as a string; '' when the task has no single answer>",
     "entry": {"question": ..., "answer": ..., "metadata": {...}},   # the whole entry, JSON-safe
     "task_config": {...}}                                            # the settings of --task-config

The ``reasoning_gym`` reward (``rewards/reasoning_gym_reward.py``) grades with the task's own
``score_answer(answer, entry_from_json(entry))`` on a task instance made with ``task_config``.

* ``entry_to_json`` / ``entry_from_json`` round-trip exactly: a tuple is ``{"__tuple__": [...]}``,
  a dict with a non-string key ``{"__items__": [[key, value], ...]}``; anything else JSON cannot
  hold exactly (a set, NaN, an object) is a ``ValueError`` naming its path in the entry.
* The held-out split is disjoint from training by question (whitespace collapsed): the distinct
  questions drawn are dealt by a seeded permutation (not "first N train, next M held out"), or,
  with ``--split natural`` (``make_natural_split``), a seeded hash of each question picks its
  split and repeats are kept, in the task's own mix.
* reasoning-gym is optional (``pip install 'megatron-grpo[reasoning]'``, ~1.8 s to import): only
  ``check_task`` and ``create_task`` import it, when entries are drawn.

Why, and measured mixes of difficulty: docs/data.md#prompt-datasets-data ("reasoning-gym tasks").
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import numbers
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from megatron_grpo.runtime.files import write_text_atomic

INSTALL_HINT = "pip install 'megatron-grpo[reasoning]'"

TUPLE_KEY = "__tuple__"
ITEMS_KEY = "__items__"
"""Single-key objects that stand for a tuple and for a dict with a non-string key."""

TEMPLATES: dict[str, str] = {
    "plain": "{question}",
    "answer_tag": "{question}\n\nThink step by step, then give only the final answer between <answer> and </answer> tags.",
    "boxed": "{question}\n\nThink step by step, then put only the final answer in \\boxed{}.",
    "final_answer": "{question}\n\nGive only the final answer, with no explanation.",
    "chain_of_thought": "{question}\n\nThink step by step. End with the sentence \"The answer is N.\", where N is the "
                        "final answer.",
}
"""Named prompt templates; ``{question}`` is replaced by the entry's question. Each pairs with
an ``extract`` of the ``reasoning_gym`` reward: answer_tag - answer_tag, boxed - boxed,
final_answer - none (or last_number), chain_of_thought - last_number (or the built-in
``math_exact_match``, which reads the last number), plain - whatever the question itself asks for."""

DEFAULT_TEMPLATE = "answer_tag"
"""reasoning-gym's own convention (its prompts ask for <answer></answer>), and the reward's default extract."""

MAX_DRAW_FACTOR = 8
"""Entries drawn at most per row asked for, before a task whose questions repeat is refused."""

REFUSED_TASKS = {"composite": "it mixes tasks; make one file per task (the trainer reads one data.train_file, "
                              "eval.sets hold one file each)"}


class TaskError(ValueError):
    """A task or its settings that reasoning-gym refuses; ``flag`` is the command-line flag
    (``--task``, ``--task-config``, ``--size``), ``str(e)`` one line."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag}: {message}")


def reasoning_gym_missing() -> str:
    """The one line that says reasoning-gym is not installed."""
    return f"reasoning-gym is not installed ({INSTALL_HINT})"


# ---- the entry as JSON --------------------------------------------------------------------------


def entry_to_json(value: Any, path: str = "entry") -> Any:
    """``value`` as plain JSON data that ``entry_from_json`` turns back into an equal value of
    the same types (tuples and non-string dict keys tagged, see the module docstring);
    ValueError naming ``path`` for what JSON cannot hold exactly."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):  # int, numpy integers
        return int(value)
    if isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise ValueError(f"{path} is {value!r}, which JSON cannot hold")
        return float(value)
    if isinstance(value, tuple):
        return {TUPLE_KEY: [entry_to_json(v, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [entry_to_json(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            if len(value) == 1 and next(iter(value)) in (TUPLE_KEY, ITEMS_KEY):
                raise ValueError(f"{path} is a dict whose only key is {next(iter(value))!r}, the tag of a tuple or "
                                 "of a dict with non-string keys")
            return {k: entry_to_json(v, f"{path}.{k}") for k, v in value.items()}
        return {ITEMS_KEY: [[entry_to_json(k, f"{path} key {k!r}"), entry_to_json(v, f"{path}[{k!r}]")]
                            for k, v in value.items()]}
    raise ValueError(f"{path} is a {type(value).__name__}, which JSON cannot hold")


def entry_from_json(value: Any) -> Any:
    """The entry ``entry_to_json`` wrote, with its tuples and non-string keys restored."""
    if isinstance(value, list):
        return [entry_from_json(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and TUPLE_KEY in value:
            return tuple(entry_from_json(v) for v in value[TUPLE_KEY])
        if len(value) == 1 and ITEMS_KEY in value:
            return {entry_from_json(k): entry_from_json(v) for k, v in value[ITEMS_KEY]}
        return {k: entry_from_json(v) for k, v in value.items()}
    return value


# ---- rows and the split -------------------------------------------------------------------------


def prompt_template(value: str) -> str:
    """The template named ``value`` (``TEMPLATES``), or ``value`` itself when it holds
    ``{question}``; ValueError otherwise."""
    if value in TEMPLATES:
        return TEMPLATES[value]
    if "{question}" in value:
        return value
    raise ValueError(f"expected one of {', '.join(TEMPLATES)} or a text holding {{question}}, got {value!r}")


def make_row(entry: dict, template: str, task_config: dict) -> dict:
    """The dataset row of one reasoning-gym entry (the module docstring's format)."""
    question = entry["question"]
    answer = entry.get("answer")
    return {"prompt": template.replace("{question}", question),
            "answer": "" if answer is None else str(answer),
            "entry": entry_to_json(entry),
            "task_config": dict(task_config)}


def question_key(question: str) -> str:
    """What two questions must share to count as the same: their text, whitespace collapsed."""
    return " ".join(question.split())


@dataclass(frozen=True)
class Split:
    """Entries cut in two, no question on both sides."""

    train: list[dict]
    heldout: list[dict]
    num_drawn: int
    """Entries drawn to find them (repeats included)."""


def distinct_questions(entries: Iterable[dict], count: int) -> tuple[list[dict], int]:
    """The first ``count`` entries of ``entries`` whose questions differ (``question_key``), a
    repeat skipped, and how many entries were drawn; fewer when ``entries`` runs out first.
    ``entries`` is consumed only as far as needed."""
    seen: set[str] = set()
    kept: list[dict] = []
    drawn = 0
    if count <= 0:
        return kept, drawn
    for entry in entries:
        drawn += 1
        key = question_key(entry["question"])
        if key not in seen:
            seen.add(key)
            kept.append(entry)
            if len(kept) == count:
                break
    return kept, drawn


# ---- reasoning-gym ------------------------------------------------------------------------------


def _registry() -> dict:
    """reasoning-gym's task name -> (dataset class, config class)."""
    # optional, and ~1.8 s to import: only the commands that draw entries pay for it
    from reasoning_gym.factory import DATASETS

    return DATASETS


def check_task(task: str, task_config: dict) -> None:
    """TaskError naming ``--task`` or ``--task-config`` unless reasoning-gym has ``task`` and
    accepts ``task_config`` as its settings."""
    registry = _registry()
    if task in REFUSED_TASKS:
        raise TaskError("--task", f"{task} is not supported: {REFUSED_TASKS[task]}")
    if task not in registry:
        close = difflib.get_close_matches(task, list(registry), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        names = ", ".join(sorted(n for n in registry if n not in REFUSED_TASKS))
        raise TaskError("--task", f"unknown reasoning-gym task {task!r}; {hint}tasks: {names}")
    settings = [f for f in registry[task][1].__dataclass_fields__ if f not in ("seed", "size")]
    for key in task_config:
        if key in ("seed", "size"):
            raise TaskError("--task-config", f"'{key}' is set by --{key}, not in --task-config")
        if key not in settings:
            raise TaskError("--task-config", f"{task} has no setting {key!r}; its settings: {', '.join(settings)}")
    try:
        create_task(task, task_config, seed=0, size=1)
    except Exception as e:  # the task's own validation: asserts, TypeErrors on a wrong type, ...
        message = " ".join(str(e).split()) or type(e).__name__
        raise TaskError("--task-config", f"{task} refuses these settings: {message}") from None


def create_task(task: str, task_config: dict, seed: int, size: int):
    """reasoning-gym's dataset object of ``task`` (``reasoning_gym.create_dataset``)."""
    # optional, and ~1.8 s to import: see _registry
    import reasoning_gym

    return reasoning_gym.create_dataset(task, seed=seed, size=size, **task_config)


def draw_entries(task: str, task_config: dict, seed: int, size: int) -> Iterator[dict]:
    """Entries ``0 .. size-1`` of the task's dataset, generated one at a time."""
    dataset = create_task(task, task_config, seed=seed, size=size)
    for i in range(size):
        yield dataset[i]


def make_split(task: str, task_config: dict, seed: int, num_train: int, num_heldout: int) -> Split:
    """``num_train`` (training) and ``num_heldout`` (held out) distinct questions of the task's
    entries, dealt at random (seeded) from the first ``num_train + num_heldout`` distinct ones
    (the module docstring says why), drawing at most ``MAX_DRAW_FACTOR`` times the rows asked
    for; TaskError naming ``--size`` when the task has fewer distinct questions."""
    wanted = num_train + num_heldout
    limit = MAX_DRAW_FACTOR * wanted
    kept, drawn = distinct_questions(draw_entries(task, task_config, seed, limit), wanted)
    if len(kept) < wanted:
        raise TaskError("--size", f"{task} gave {len(kept)} distinct questions in {drawn} draws, fewer than "
                                  f"--size + --heldout = {wanted}; ask for fewer or widen the task (--task-config)")
    order = random.Random(seed).sample(range(wanted), wanted)  # the splits share one difficulty mix
    dealt = [kept[i] for i in order]
    return Split(dealt[:num_train], dealt[num_train:], drawn)


SPLITS = ("distinct", "natural")
"""``--split``: ``make_split`` (distinct questions, dealt) or ``make_natural_split`` (the task's mix)."""


def heldout_question(key: str, seed: int, fraction: float) -> bool:
    """Whether the question ``key`` (``question_key``) belongs to the held-out split: a seeded
    hash of it, uniform in [0, 1), below ``fraction``. The same for every draw of the question."""
    digest = hashlib.sha256(f"{seed}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_by_question(entries: Iterable[dict], seed: int, num_train: int,
                      num_heldout: int) -> tuple[list[dict], list[dict], int]:
    """``num_train`` training and ``num_heldout`` held-out entries of ``entries`` in order, each
    question's split fixed by ``heldout_question`` (repeats kept, so each split has the task's
    mix), and the entries drawn; shorter lists when ``entries`` runs out first."""
    fraction = num_heldout / (num_train + num_heldout)
    train: list[dict] = []
    heldout: list[dict] = []
    drawn = 0
    for entry in entries:
        if len(train) == num_train and len(heldout) == num_heldout:
            break
        drawn += 1
        side = heldout if heldout_question(question_key(entry["question"]), seed, fraction) else train
        if len(side) < (num_heldout if side is heldout else num_train):
            side.append(entry)
    return train, heldout, drawn


def make_natural_split(task: str, task_config: dict, seed: int, num_train: int, num_heldout: int) -> Split:
    """The ``--split natural`` split (``split_by_question``), drawing at most ``MAX_DRAW_FACTOR``
    times the rows asked for; TaskError naming ``--heldout`` when a side cannot be filled (too
    few distinct questions for the held-out share to land any)."""
    wanted = num_train + num_heldout
    train, heldout, drawn = split_by_question(draw_entries(task, task_config, seed, MAX_DRAW_FACTOR * wanted),
                                              seed, num_train, num_heldout)
    if len(train) < num_train or len(heldout) < num_heldout:
        raise TaskError("--heldout", f"{task} gave {len(train)} training and {len(heldout)} held-out rows in {drawn} "
                                     f"draws (questions split by hash, --split natural), fewer than asked; widen the "
                                     f"task (--task-config) or use --split distinct")
    return Split(train, heldout, drawn)


def write_rows(rows: list[dict], path: str | Path) -> Path:
    """``rows`` one JSON object a line, written atomically (a temp file renamed over ``path``)."""
    text = "".join(json.dumps(row, allow_nan=False) + "\n" for row in rows)
    write_text_atomic(path, text)
    os.chmod(path, 0o644)  # the temp file was private (mkstemp); a dataset is for anyone to read
    return Path(path)
