"""The ``verifiers`` connector for the library's current API, ``verifiers.v1`` (verifiers 0.4;
0.3 ships it beside the classic one): a ``vf.Taskset`` returned by the user's
``load_environment()`` (``episodes.source: verifiers:path/to/env.py:load_environment``;
docs/agents.md) run as an agent, each task answered in one chat turn and scored by the task's
own ``@vf.reward`` / ``@vf.metric`` methods.

    our row -> a task            the taskset's task whose ``idx`` is the row's ``example_id``,
                                 else one of the taskset's task type built from the row (its
                                 ``question``, else its chat messages, as the prompt; the row's
                                 fields that the task data declares, ``answer`` ...)
    one chat call                the task's system prompt and prompt, through the front
    task.score(trace)            verifiers' own scoring, on a ``vf.Trace`` of that exchange
    -> {"reward": trace.reward, <each reward's score>, <each metric>}

In verifiers 0.4 the turn loop is a *harness*: a program (a coding agent, or the ``null`` chat
loop) that verifiers installs with ``uv`` and launches in a runtime (a sandbox, docker, a
subprocess), behind an HTTP interception server. None of that runs here: installing the
program needs the network, and the run's front already is the model endpoint. The connector is
the ``null`` harness of a taskset without tools (one chat call; the reply ends the rollout),
and refuses at load, in one line, what that cannot run: an ``Env`` (a harness, or several
agents), a task with tool servers (``toolsets``), one that needs a container, or a reward or
metric that reads the runtime. Departures as in the classic connector (``verifiers_env.py``):
a reward that raises or returns no number fails the episode (verifiers records an error and no
score), and the run's sampling settings win.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from megatron_grpo.config.base import ConfigError
from megatron_grpo.rollout.episodes.agent.front import MODEL_NAME
from megatron_grpo.runtime.errors import one_line


class VerifiersTaskError(RuntimeError):
    """An episode whose task scoring failed; its traceback is the user's reward's own."""


def is_v1(obj: Any) -> bool:
    """Whether ``obj`` (what ``load_environment()`` returned) is a ``verifiers.v1`` object."""
    return type(obj).__module__.startswith("verifiers.v1") or any(
        k.__module__.startswith("verifiers.v1") for k in type(obj).__mro__[1:])


def needs_runtime(fn: Callable) -> bool:
    """Whether a scoring function takes verifiers' runtime without a default (it would be skipped)."""
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def check_taskset(v1, taskset, where: str, key: str) -> None:
    """ConfigError (one line) for what one chat turn cannot run (module docstring)."""
    if isinstance(taskset, v1.Env):
        raise ConfigError(key, f"{where} returned a verifiers.v1 Env ({type(taskset).__name__}): its harness and agents "
                               "are not run here; return its taskset (a vf.Taskset), answered in one chat turn per task")
    if not isinstance(taskset, v1.Taskset):
        raise ConfigError(key, f"{where} returned {type(taskset).__name__}, not a verifiers.v1 Taskset")
    task_cls = type(taskset).task_type()
    if task_cls.NEEDS_CONTAINER:
        raise ConfigError(key, f"{where}: its task {task_cls.__name__} needs a container, which the connector has not")
    if type(taskset).toolsets(taskset.config) or task_cls.toolsets(taskset.config.task):
        raise ConfigError(key, f"{where}: its tasks have tool servers (toolsets); the connector answers a task in one "
                               "chat turn without tools")
    probe = task_cls.__new__(task_cls)  # the hooks are bound methods: an instance without data
    probe.config = taskset.config.task
    rewards, metrics = probe.hooks("reward"), probe.hooks("metric")
    if not rewards and not taskset.config.task.judges:
        raise ConfigError(key, f"{where}: its task {task_cls.__name__} has no @vf.reward method")
    for fn in (*rewards, *metrics):
        if needs_runtime(fn):
            raise ConfigError(key, f"{where}: {task_cls.__name__}.{fn.__name__} reads the runtime (a sandbox), which "
                                   "the connector has not")


class TaskRows:
    """The taskset's tasks by ``idx`` (indexed on first use; a taskset without end: none)."""

    def __init__(self, taskset):
        self.taskset = taskset
        self._index: Optional[dict] = None

    def get(self, idx: Any):
        if self._index is None:
            self._index = {t.data.idx: t for t in self.taskset} if self.taskset.bounded else {}
        return self._index.get(idx)


def row_task(taskset, rows: TaskRows, row: dict):
    """The task for our ``row`` (module docstring); ValueError for a row without a prompt."""
    if "example_id" in row and (task := rows.get(row["example_id"])) is not None:
        return task
    task_cls = type(taskset).task_type()
    data_cls = task_cls.data_type()
    if isinstance(row.get("question"), str):
        prompt = row["question"]
    elif row.get("messages"):
        prompt = list(row["messages"])
    else:
        raise ValueError("the row has no 'question' field, no 'example_id' of the taskset's tasks and no chat "
                         "messages (data.apply_chat_template is off), so its prompt is unknown")
    fields = {k: row[k] for k in data_cls.model_fields if k in row and k not in ("prompt", "idx", "system_prompt")}
    data = data_cls.model_validate({**fields, "prompt": prompt, "system_prompt": taskset.system_prompt})
    return task_cls(data, taskset.config.task)


def prompt_messages(data) -> list[dict]:
    """The chat messages of a task: its system prompt, then its prompt (text: the user's turn)."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return messages + [{"role": "user", "content": data.prompt}]
    return messages + [m.model_dump(exclude_none=True) for m in data.prompt or []]


def exchange_trace(v1, task, messages: list[dict], reply: str, finish_reason: Optional[str]):
    """A ``vf.Trace`` of one exchange: the prompt's messages, then the model's reply (sampled)."""
    wire = [*messages, {"role": "assistant", "content": reply}]
    nodes = [v1.MessageNode(parent=i - 1 if i else None, message=m, sampled=i == len(wire) - 1)
             for i, m in enumerate(wire)]
    return v1.Trace(task=v1.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                    agent=v1.AgentInfo(config=v1.AgentConfig(runtime=v1.SubprocessConfig())), nodes=nodes,
                    calls=[v1.ModelCall(node=len(wire) - 1, model=MODEL_NAME, finish_reason=finish_reason)],
                    is_completed=True)


def failure(message: str, cause: BaseException) -> VerifiersTaskError:
    """A VerifiersTaskError carrying the traceback of ``cause``'s root cause (the user's code)."""
    root = cause
    while root.__cause__ is not None:
        root = root.__cause__
    return VerifiersTaskError(message).with_traceback(root.__traceback__)


def episode_result(trace) -> dict:
    """``{"reward", <reward name>: score, <metric name>: value}`` (a reward named ``reward``
    is logged as ``task_reward``); ValueError naming a reward or metric left unscored."""
    out = {"reward": float(trace.reward)}
    for name, r in trace.rewards.items():
        if r is None:
            raise ValueError(f"reward {name} was not scored")
        out["task_reward" if name == "reward" else name] = float(r.score)
    for name, value in trace.metrics.items():
        if value is None:
            raise ValueError(f"metric {name} was not scored")
        out[name] = float(value)
    return out


def agent_function(v1, taskset) -> Callable:
    """The agent function ``async (client, row) -> dict`` of a checked taskset (module docstring)."""
    rows = TaskRows(taskset)

    async def run(client, row: dict) -> dict:
        task = row_task(taskset, rows, row)
        messages = prompt_messages(task.data)
        response = await client.chat.completions.create(model=MODEL_NAME, messages=messages)
        choice = response.choices[0]
        trace = exchange_trace(v1, task, messages, choice.message.content or "", choice.finish_reason)
        try:
            await task.score(trace)
            return episode_result(trace)
        except Exception as e:  # the task's own code: its site, one line
            raise failure(f"the task's scoring raised {one_line(e.__cause__ or e)}", e) from None

    return run


def load_agent(returned: Any, where: str, key: str) -> Callable:
    """The agent function of what ``load_environment()`` returned (a ``verifiers.v1`` object)."""
    import verifiers.v1 as v1  # noqa: PLC0415 (present: ``returned`` is one of its objects)

    check_taskset(v1, returned, where, key)
    return agent_function(v1, returned)
