"""The worker process of ``episodes.kind: agent``: the user's agent function runs here, never in the
trainer's process, so a hung or crashing agent is killed alone (with whatever it started).

Forked by the environments' fork server (``rollout/episodes/environment/worker.py``, a ``run`` request
for the ``agent`` target), so it carries none of the trainer's torch, megatron or engine state.
It loads the file (a ``<prefix>:`` spec through its connector, ``connectors/``), says whether
the function can be called, then runs episodes one at a time:

    trainer -> worker   ("run", (base_url, api_key, row, timeout_s))
    worker  -> trainer  ("ok", {"reward": float, "metrics": {name: float}})
                      | ("error", {"message", "where"})        the agent raised: the episode ends
                      | ("contract", message)                  it returned something else: the run stops

``fn(client, row)``: ``client`` is an ``openai.AsyncOpenAI`` (for an ``async def``) or an
``openai.OpenAI`` bound to the episode's base URL, with the SDK's retries off (a failed call is
the agent's to see) and ``timeout_s`` per request. It returns the episode's reward, a number,
or a dict with ``"reward"`` and other numbers (logged as ``agent/<name>_mean``).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from typing import Any

from megatron_grpo.config.base import ConfigError
from megatron_grpo.rollout.episodes.agent.connectors import load_agent
from megatron_grpo.runtime.errors import one_line
from megatron_grpo.rollout.episodes.environment.worker import raise_site

KEY = "episodes.agent"


def agent_result(out: Any, where: str) -> dict:
    """``{"reward", "metrics"}`` of what an agent returned; ValueError (one line) otherwise."""
    if isinstance(out, numbers.Real) and not isinstance(out, bool):
        out = {"reward": out}
    if not isinstance(out, dict) or "reward" not in out:
        raise ValueError(f"{KEY} {where} returned {type(out).__name__}; expected a number (the reward) or a "
                         'dict with "reward"')
    values = {}
    for name, v in out.items():
        if not isinstance(name, str) or isinstance(v, bool) or not isinstance(v, numbers.Real) \
                or not math.isfinite(float(v)) or abs(float(v)) > 1e30:
            raise ValueError(f'{KEY} {where} returned {name!r}: {v!r}; every value must be a finite number')
        values[name] = float(v)
    reward = values.pop("reward")
    return {"reward": reward, "metrics": values}


def _sdk():
    """The ``openai`` module (the agents extra), imported where an agent runs."""
    import openai

    return openai


def _episode(fn, is_async: bool, loop, base_url: str, api_key: str, row: dict, timeout_s: float) -> Any:
    openai = _sdk()

    if is_async:
        async def go():
            async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                          timeout=timeout_s) as client:
                return await fn(client, row)
        return loop.run_until_complete(go())
    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s) as client:
        out = fn(client, row)
        if inspect.isawaitable(out):  # a sync def that returns a coroutine
            out = loop.run_until_complete(out)
        return out


def serve(conn, spec: str) -> None:
    """The worker (module docstring)."""
    try:
        fn, fn_file = load_agent(spec, KEY)  # the user's fn, or a connector's (connectors/)
    except ConfigError as e:
        conn.send(("contract", str(e)))
        return
    where = spec
    _sdk()  # imported once per worker, before the first episode's deadline runs

    conn.send(("loaded", None))
    is_async = inspect.iscoroutinefunction(fn)
    loop = asyncio.new_event_loop()
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            return
        if op == "close":
            return
        base_url, api_key, row, timeout_s = args
        try:
            out = _episode(fn, is_async, loop, base_url, api_key, row, timeout_s)
        except Exception as e:  # the user's agent: reported, the episode ends
            conn.send(("error", {"message": f"raised {one_line(e)}", "where": raise_site(e, fn_file)}))
            continue
        try:
            conn.send(("ok", agent_result(out, where)))
        except ValueError as e:
            conn.send(("contract", str(e)))
            return
