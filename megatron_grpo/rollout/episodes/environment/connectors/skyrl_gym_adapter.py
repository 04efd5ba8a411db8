"""skyrl-gym's text environments in the episode loop: ``skyrl_gym:<env id>`` (registered with
``skyrl_gym.register``: ``gsm8k``, ``gsm8k_multi_turn``, ``aime``, ...) or
``skyrl_gym:path/to/env.py:Class`` (a ``BaseTextEnv`` subclass of your own); docs/multi_turn.md
has the mapping table against skyrl-train's ``SkyRLGymGenerator.agent_loop``.

The environment is made as SkyRL makes it (``skyrl_gym.make(id, env_config=..., extras=...)``),
``extras`` the row's fields but ``prompt`` (``row_extras``); ``init(prompt)`` once, with the
prompt as one user message; ``step(response)`` per model turn, its ``observations`` the
observation text and its ``reward`` and ``done`` ours (``step_answer``). The episode's reward is
the sum of the step rewards, as SkyRL's GRPO sums the rewards it places at each turn's end. A
row without ``reward_spec`` gets ``{"method": "rule", "ground_truth": <answer>}``.

Departures from SkyRL's loop, each because this loop is token-in/token-out on a prompt rendered
before the episode starts:

* an ``init`` that returns a different prompt stops the run with one line (``ContractViolation``)
  instead of being silently ignored;
* a step's observation messages are ONE observation turn (joined by newlines) in
  ``episodes.observation_role``; the messages of the step that ends the episode are dropped;
* ``postprocessed_action`` (it re-tokenizes), ``metadata`` and ``get_metrics()`` are not used;
* ``env_config`` is an empty ``DictConfig`` and ``max_turns`` is not written into ``extras``
  unless the adapter is constructed with them (constructor arguments; no config key yet).
"""

from __future__ import annotations

import copy
import importlib
from typing import Any, Callable, Optional

from megatron_grpo.config.connectors import AGENTS_EXTRA, FILE_TARGET_RE
from megatron_grpo.rollout.episodes.environment.loading import ContractViolation, describe, load_file_attribute
from megatron_grpo.runtime.errors import one_line


def prepare(target: str, workdir: str) -> None:
    """Import skyrl_gym in the fork server, so that every worker it forks has it (~1 s each
    otherwise). A failure is left to ``environment_class`` to report."""
    try:
        importlib.import_module("skyrl_gym")
    except Exception:  # noqa: BLE001 (environment_class reports it, in the worker, in one line)
        pass


def _library(where: str):
    try:
        import skyrl_gym
        from skyrl_gym.envs.base_text_env import BaseTextEnv
    except ImportError as e:
        raise ValueError(f"episodes.environment {where}: needs the skyrl-gym library ({one_line(e)}): "
                         f"{AGENTS_EXTRA}") from None
    return skyrl_gym, BaseTextEnv


def environment_class(target: str) -> type:
    """The adapter class for ``target`` (a registered env id, or ``path.py:Class`` naming a
    ``BaseTextEnv`` subclass); ValueError (one line) for an unknown id or a wrong class."""
    where = f"skyrl_gym:{describe(target)}"
    skyrl_gym, base = _library(where)
    if FILE_TARGET_RE.match(target):
        cls = load_file_attribute(target, "episodes.environment", prefix="skyrl_gym:")
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ValueError(f"episodes.environment {where}: is not a subclass of skyrl_gym's BaseTextEnv")

        def make(env_config, extras):
            return cls(env_config=env_config, extras=extras)
    else:
        registered = sorted(skyrl_gym.registry)
        if target not in registered:
            raise ValueError(f"episodes.environment {where}: no skyrl-gym environment {target!r} is registered "
                             f"(registered: {', '.join(registered)})")

        def make(env_config, extras):
            return skyrl_gym.make(target, env_config=env_config, extras=extras)
    return type("SkyRLGymEnvironment", (SkyRLGymAdapter,), {"make_env": staticmethod(make), "where": where})


def row_extras(row: dict, max_turns: Optional[int] = None) -> dict:
    """SkyRL's ``extras`` for a dataset row: a copy of its fields but ``prompt`` and
    ``env_class``; ``reward_spec`` from ``answer`` when the row has none; ``max_turns`` when given."""
    extras = {k: copy.deepcopy(v) for k, v in row.items() if k not in ("prompt", "env_class")}
    if "reward_spec" not in extras and row.get("answer") is not None:
        extras["reward_spec"] = {"method": "rule", "ground_truth": str(row["answer"])}
    if max_turns is not None:
        extras["max_turns"] = max_turns
    return extras


def prompt_messages(row: dict) -> list[dict]:
    """The conversation ``init`` gets: the row's prompt (as the model saw it) as one user message."""
    return [{"role": "user", "content": str(row.get("prompt", ""))}]


def observation_text(observations: Any) -> str:
    """One observation text from a step's ``observations`` (a list of ``{"role", "content"}``
    messages): their contents joined by newlines; ContractViolation for another shape."""
    if not isinstance(observations, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in observations):
        raise ContractViolation(f"step returned observations={str(observations)[:80]!r}; expected a list of "
                                'chat messages {"role": ..., "content": str}')
    return "\n".join(m["content"] for m in observations)


def step_answer(out: Any) -> dict:
    """A ``BaseTextEnvStepOutput`` (``{"observations", "reward", "done", "metadata", ...}``) as the
    loop's ``{"observation": str | None, "done": bool, "reward": float}`` (module docstring)."""
    if not isinstance(out, dict) or not {"observations", "reward", "done"} <= set(out):
        raise ContractViolation(f"step returned {str(out)[:80]!r}; expected a BaseTextEnvStepOutput "
                                "(observations, reward, done, metadata)")
    if out["done"] not in (True, False):  # numpy's bool too
        raise ContractViolation(f"step returned done={out['done']!r}; expected True or False")
    done = bool(out["done"])
    text = observation_text(out["observations"])
    reward = out["reward"]
    try:
        reward = 0.0 if reward is None else float(reward)
    except (TypeError, ValueError):
        raise ContractViolation(f"step returned reward={str(reward)[:40]!r}; expected a number") from None
    return {"observation": None if done else text, "done": done, "reward": reward}


class SkyRLGymAdapter:
    """One skyrl-gym environment for one episode (the class ``environment_class`` returns binds
    ``make_env`` and ``where``)."""

    make_env: Callable[[Any, dict], Any]
    where: str

    def __init__(self, row: dict, env_config: Optional[dict] = None, max_turns: Optional[int] = None):
        from omegaconf import DictConfig  # skyrl-gym's own dependency; its environments read attributes

        self.env = self.make_env(DictConfig(env_config or {}), row_extras(row, max_turns))
        prompt = prompt_messages(row)
        out = self.env.init(copy.deepcopy(prompt))
        returned = out[0] if isinstance(out, tuple) and len(out) == 2 else out
        if returned != prompt:
            raise ContractViolation(
                f"init(prompt) returned a different prompt ({str(returned)[:80]!r}); the prompt here is the dataset "
                "row's, rendered before the episode starts, so an environment that rewrites it cannot run unchanged "
                "(put that text in the dataset's prompt instead)")

    def step(self, response: str) -> dict:
        return step_answer(self.env.step(response))
