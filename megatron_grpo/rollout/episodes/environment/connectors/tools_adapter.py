"""TRL's ``environment_factory`` style in the episode loop: ``tools:path/to/env.py:Class``, a class
whose public methods are the model's tools, as TRL's ``GRPOTrainer(environment_factory=Class)``
takes it (docs/multi_turn.md has the mapping table):

* one instance per episode, constructed with no argument; ``reset(**row)`` with the dataset
  row's fields but ``prompt``; its tools: every public bound method but ``reset`` and
  ``get_reward``;
* each model turn's text is parsed for tool calls in the model's own format
  (``chat/tool_calls.py``, ``episodes.tool_call_format``); each call is made with its arguments
  and the observation is one text per call, in order, joined by newlines: ``str(result)`` or
  TRL's error forms (``{'error': 'Tool <name> not found.'}``, the exception's message); a
  malformed call is one more error text;
* a turn without a call ends the episode; the reward is ``get_reward()`` of the state the
  episode ended in (each step reports the change since the last), 0 without the method;
* each step's ``counts``: ``tool_calls``, ``tool_failures`` (TRL's tool metrics, as counts) and
  ``tool_call_errors`` (calls that did not parse).

Departures, because this loop's prompt is rendered before the episode and the environment
speaks text: a ``reset`` that returns a prompt stops the run with one line; ``get_reward`` is
called after every step (it must read the state, not change it); several results are one
observation turn, not one ``tool`` message each; the tools' schemas are not rendered into the
prompt (describe the tools in the dataset's prompt); reward functions get no
``environments`` argument.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any, Callable, Optional

from megatron_grpo.chat.tool_calls import TOOL_CALL_FORMATS, parse_tool_calls
from megatron_grpo.rollout.episodes.environment.loading import ContractViolation, describe, load_file_attribute

RESERVED = ("reset", "get_reward")
"""Methods of the class that are not tools (TRL's reserved names)."""


def environment_class(target: str) -> type:
    """The adapter class for ``target`` (``path.py:Class``: a class constructed with no argument,
    with a ``reset``); ValueError (one line) otherwise."""
    where = f"tools:{describe(target)}"
    cls = load_file_attribute(target, "episodes.environment", prefix="tools:")
    if not inspect.isclass(cls):
        raise ValueError(f"episodes.environment {where}: is a {type(cls).__name__}, not a class")
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(f"episodes.environment {where}: the class has no reset(self, **kwargs) (TRL's "
                         "environment_factory requires one)")
    try:
        inspect.signature(cls).bind()
    except TypeError as e:
        raise ValueError(f"episodes.environment {where}: the class must be constructed with no argument (TRL's "
                         f"environment_factory): {e}") from None
    except ValueError:
        pass  # no signature (a C type): checked at the first episode
    if not class_tools(cls):  # every call would fail at run time ("Tool compute not found"), each episode
        raise ValueError(f"episodes.environment {where}: the class has no tool: a tool is a public method other "
                         f"than {' and '.join(RESERVED)} (TRL's environment_factory)")
    return type("ToolEnvironment", (ToolsAdapter,), {"env_class": cls, "where": where})


def class_tools(cls: type) -> list[str]:
    """The names ``tools_of`` will find on an instance of ``cls``, read from the class: its public
    functions and class methods but ``RESERVED`` (a static method is no bound method, so no tool)."""
    names = []
    for name in dir(cls):
        if name.startswith("_") or name in RESERVED:
            continue
        attr = inspect.getattr_static(cls, name, None)
        if isinstance(attr, classmethod) or (inspect.isfunction(attr) and not isinstance(attr, staticmethod)):
            names.append(name)
    return names


def tools_of(instance: Any) -> dict[str, Callable]:
    """The instance's tools: its public bound methods but ``RESERVED`` (TRL's rule)."""
    return {name: method for name, method in inspect.getmembers(instance, predicate=inspect.ismethod)
            if not name.startswith("_") and name not in RESERVED}


def error_text(message: str) -> str:
    """A failed call's observation text, TRL's: ``str({"error": message})``."""
    return str({"error": message})


def reset_kwargs(row: dict) -> dict:
    """``reset``'s keyword arguments: the row's fields but ``prompt`` (TRL's convention)."""
    return {k: v for k, v in row.items() if k != "prompt"}


class ToolsAdapter:
    """One instance of a TRL-style environment class for one episode (the class
    ``environment_class`` returns binds ``env_class`` and ``where``). ``tool_call_format``: the
    model's (``episodes.tool_call_format``, ``chat.tool_calls.TOOL_CALL_FORMATS``), handed over
    by the episode loop as the worker's construction option."""

    env_class: type
    where: str

    def __init__(self, row: dict, tool_call_format: str = "hermes"):
        if tool_call_format not in TOOL_CALL_FORMATS:
            raise ContractViolation(f"unknown tool-call format {tool_call_format!r} (known: "
                                    f"{', '.join(TOOL_CALL_FORMATS)})")
        self.fmt = tool_call_format
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.env = self.env_class()
        self.tools = tools_of(self.env)
        prompt = self._resolve(self.env.reset(**reset_kwargs(row)))
        if prompt is not None and prompt != "":
            raise ContractViolation(
                f"reset returned a prompt ({str(prompt)[:60]!r}); TRL appends it to the last user message, but here "
                "the prompt is the dataset row's, rendered before the episode starts: return None from reset and put "
                "the task in the dataset's prompt")
        self._reported = 0.0  # the rewards reported so far: each step reports get_reward()'s change

    def _resolve(self, value: Any) -> Any:
        """``value``, awaited on this adapter's own event loop if it is awaitable (an ``async def``)."""
        if inspect.isawaitable(value):
            self._loop = self._loop or asyncio.new_event_loop()
            return self._loop.run_until_complete(value)
        return value

    def _reward(self) -> float:
        """``get_reward()`` now, less what earlier steps reported (0 for a class without it)."""
        get_reward = getattr(self.env, "get_reward", None)
        if get_reward is None:
            return 0.0
        total = self._resolve(get_reward())
        try:
            total = float(total)
        except (TypeError, ValueError):
            raise ContractViolation(f"get_reward returned {str(total)[:40]!r}; expected a number") from None
        step, self._reported = total - self._reported, total
        return step

    def call(self, name: str, arguments: str) -> tuple[str, bool]:
        """(observation text, failed) of one parsed call (``arguments``: its JSON object string)."""
        tool = self.tools.get(name)
        if tool is None:
            return error_text(f"Tool {name} not found."), True
        try:
            result = self._resolve(tool(**json.loads(arguments)))
        except Exception as e:  # noqa: BLE001 (a raising tool, or arguments it does not take: the model sees it)
            return error_text(str(e)), True
        return str(result), False

    def step(self, response: str) -> dict:
        parsed = parse_tool_calls(response, self.fmt)
        counts = {"tool_calls": len(parsed.tool_calls), "tool_failures": 0, "tool_call_errors": len(parsed.errors)}
        if not parsed.tool_calls and not parsed.errors:  # no call: the model's final answer
            return {"observation": None, "done": True, "reward": self._reward(), "counts": counts}
        texts = []
        for c in parsed.tool_calls:
            text, failed = self.call(c["function"]["name"], c["function"]["arguments"])
            texts.append(text)
            counts["tool_failures"] += failed
        texts += [error_text(e) for e in parsed.errors]
        return {"observation": "\n".join(texts), "done": False, "reward": self._reward(), "counts": counts}
