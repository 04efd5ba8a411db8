"""The ``reasoning_gym`` built-in: a response scored by its reasoning-gym task's own grader.

    reward:
      functions:
        - name: reasoning_gym
          kwargs: {extract: answer_tag, timeout_s: 5}

The data comes from ``tools/make_reasoning_gym_data.py``: each row carries the reasoning-gym
``entry`` (question, answer, metadata) and the ``task_config`` it was made with
(``data/reasoning_gym_source.py``). For each response the answer is taken out by ``extract``
(``rewards/answers.py``: ``answer_tag``, the default and reasoning-gym's own convention,
``boxed``, ``last_number``, ``none``), then scored by ``score_answer(answer, entry)`` of the task
named in ``entry["metadata"]["source_dataset"]``, made with the row's settings (a few graders
read them: arc_agi's board format). Graders give partial credit (the default one gives
``len(reference) / len(answer)`` when the answer contains the reference); a response with no
answer to extract is scored as reasoning-gym scores ``None`` (0.0).

Several graders parse the answer with sympy, which evaluates ``9**9**9**9`` for ever, so the
grading runs in a worker process under ``timeout_s`` (``rewards/isolated.py``): a timeout
scores 0.0 and is counted as ``reward/<label>/timeouts``. Some graders raise on an answer they
cannot parse (prime_factorization on ``xyz``): that is a wrong answer, 0.0, counted as
``reward/<label>/grader_errors`` (the first message of each task is logged once). A row
without ``entry``, an entry reasoning-gym cannot read, or settings its task refuses stops the
run with one line: the data, not the model, is wrong.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from typing import Any, Optional

from megatron_grpo.data.reasoning_gym_source import entry_from_json
from megatron_grpo.rewards.answers import ANSWER_EXTRACTORS, ExtractName
from megatron_grpo.rewards.isolated import CallTimeout, IsolatedFunction
from megatron_grpo.runtime.errors import one_line

log = logging.getLogger(__name__)

TOOL = "tools/make_reasoning_gym_data.py"


def task_of(row: dict) -> tuple[str, str]:
    """(task name, settings as JSON text) of a row the tool wrote; ValueError saying what is
    missing (the data is wrong, not the response)."""
    if "entry" not in row:
        raise ValueError(f"the row has no 'entry' field: reasoning_gym scores rows made by {TOOL} "
                         f"(fields here: {', '.join(sorted(row)) or 'none'})")
    metadata = row["entry"].get("metadata") if isinstance(row["entry"], dict) else None
    task = metadata.get("source_dataset") if isinstance(metadata, dict) else None
    if not isinstance(task, str):
        raise ValueError(f"the row's entry has no metadata.source_dataset: it must be a reasoning-gym entry, as "
                         f"{TOOL} writes it")
    return task, json.dumps(row.get("task_config") or {}, sort_keys=True)


class ReasoningGymReward:
    """Per-sample reward ``(response, row) -> float`` (see the module docstring); one instance
    per configured function, holding its worker and counters."""

    requires = {"reasoning_gym": "reasoning-gym"}
    """Import name -> package of what the worker imports (checked when the reward loads)."""

    def __init__(self, *, extract: ExtractName = "answer_tag", timeout_s: float = 5.0):
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.extract = ANSWER_EXTRACTORS[extract]
        self.timeout_s = float(timeout_s)
        self.timeouts = 0
        self.grader_errors = 0
        self._logged: set[str] = set()
        self._worker = IsolatedFunction(f"{__name__}:score_in_worker", "reasoning_gym",
                                        setup=f"{__name__}:prepare_in_worker")
        self.__name__ = "reasoning_gym"

    def __call__(self, response: str, row: dict) -> float:
        task, settings = task_of(row)
        try:
            score, error = self._worker(self.extract(response), row["entry"], settings, timeout_s=self.timeout_s,
                                        setup_args=(task, settings))
        except CallTimeout:
            self.timeouts += 1
            return 0.0
        if error is not None:
            self.grader_errors += 1
            if error[0] not in self._logged:  # once per task: a parse failure repeats with every bad answer
                self._logged.add(error[0])
                log.warning("reasoning_gym: the %s grader raised %s on an answer; scored 0.0, counted in "
                            "reward/<label>/grader_errors", *error)
        return score

    def pop_stats(self) -> dict[str, float]:
        """Counters since the last call (the scorer logs them as ``reward/<label>/<name>``)."""
        out = {"timeouts": float(self.timeouts), "grader_errors": float(self.grader_errors)}
        self.timeouts = self.grader_errors = 0
        return out

    async def aclose(self) -> None:
        self._worker.close()


# ---- in the worker process ----------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def prepare_in_worker(task: str, settings: str):
    """The ``score_answer`` of ``task`` made with ``settings`` (JSON text: a cache key). The
    worker's setup, outside a call's deadline: importing reasoning-gym and making a task (arc_agi
    reads its data files) take seconds."""
    # in the worker only: reasoning-gym is optional and takes ~1.8 s to import
    import reasoning_gym

    try:
        return reasoning_gym.create_dataset(task, size=1, seed=0, **json.loads(settings)).score_answer
    except Exception as e:  # an unknown task, or settings it refuses: the data is wrong
        raise ValueError(f"reasoning-gym cannot make task {task!r} with the row's task_config {settings}: "
                         f"{one_line(e, None)}") from None


def score_in_worker(answer: Optional[str], entry_json: dict, settings: str) -> tuple[Any, Optional[tuple[str, str]]]:
    """(score, None), or (0.0, (task, error)) when the grader raised on the answer. Runs in the
    worker, after ``prepare_in_worker`` (cached) made the grader."""
    entry = entry_from_json(entry_json)
    task = entry["metadata"]["source_dataset"]
    score_answer = prepare_in_worker(task, settings)
    try:
        return score_answer(answer, entry), None
    except Exception as e:
        return 0.0, (task, one_line(e, 200))
