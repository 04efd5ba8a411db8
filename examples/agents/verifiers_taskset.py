"""A verifiers 0.4 taskset (``verifiers.v1``) for the CPU demo's arithmetic task (docs/agents.md,
"verifiers environments"):

    episodes:
      kind: agent
      source: verifiers:examples/agents/verifiers_taskset.py:load_environment

Each task is answered in one chat turn through the run's engine and scored by the task's own
``@vf.reward``; the run's data rows name a task by ``example_id`` or carry their own ``question``
and ``answer``. The classic API (verifiers < 0.4): ``verifiers_calculator.py``.
"""

import verifiers.v1 as vf

QUESTIONS = [(f"what is {a} plus {b}", str(a + b)) for a, b in [(3, 4), (9, 9), (2, 6), (10, 5), (40, 2)]]


class Sum(vf.TaskData):
    answer: str


class SumTask(vf.Task[Sum]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        """1.0 when the reply's last word is the reference answer."""
        words = trace.last_reply.split()
        return float(bool(words) and words[-1] == task.answer)


class Sums(vf.Taskset[SumTask]):
    def load(self):
        for question, answer in QUESTIONS:
            yield SumTask(Sum(prompt=question, answer=answer), self.config.task)


def load_environment():
    return Sums(vf.TasksetConfig())
