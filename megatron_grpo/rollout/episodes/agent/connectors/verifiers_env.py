"""The ``verifiers`` connector: an environment written with Prime Intellect's ``verifiers``
library (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, ..., scored by its ``Rubric``) run
as an agent (``episodes.source: verifiers:path/to/env.py:load_environment``; docs/agents.md).

``load_environment()`` returns the ``vf.Environment``, built once per agent worker process.
Each episode: our row becomes verifiers' rollout input (``rollout_input``), ``env.rollout``
runs verifiers' own turn loop with an OpenAI client bound to the front (every call recorded as
token ids), ``env.rubric.score_rollout`` scores it, and the reward and each rubric function's
score come back. Verifiers re-sends the conversation each turn as the previous prompt plus the
answer plus the new messages, so the front extends the episode's tokens without re-tokenizing.

Supported: verifiers >= 0.1.14, < 0.4 (the classic API; 0.3 keeps it under
``verifiers.legacy``). 0.4 has only ``verifiers.v1``: ``load_agent`` hands such an object to
``verifiers_v1.py``.

Departures from verifiers' own behaviour, each deliberate (docs/agents.md has the table):

* a reward function that raises, or a rollout ending with ``state["error"]``, fails the episode
  (counted, printed once, scored as ``on_env_error``); verifiers scores 0 and trains on the bug;
* an empty answer the engine sampled is the policy's answer, scored (verifiers raises
  ``EmptyModelResponseError``, meant for a failed API call);
* the front's empty ``finish_reason: "length"`` answer (max_turns or the token budget spent)
  ends the rollout as verifiers' ``prompt_too_long`` does, then it is scored;
* the rubric always scores, one episode at a time (a rubric with group reward functions is
  refused at load); the front samples at the run's temperature, top_p, top_k and min_p, and
  caps ``max_tokens`` by the run's.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any, Callable, Optional

from megatron_grpo.config.base import ConfigError
from megatron_grpo.rewards.registry import load_file
from megatron_grpo.rollout.episodes.agent.connectors import verifiers_v1
from megatron_grpo.rollout.episodes.agent.front import MODEL_NAME
from megatron_grpo.runtime.errors import one_line
from megatron_grpo.rollout.episodes.environment.worker import raise_site

SUPPORTED = ">=0.1.14,<0.4"
"""The verifiers versions whose classic API this module drives (module docstring); 0.4's
``verifiers.v1`` tasksets go to ``verifiers_v1.py``."""


class VerifiersEpisodeError(RuntimeError):
    """An episode the environment or its rubric failed (module docstring); its traceback is the
    failure's own, so the worker names the site in the user's file."""


def import_verifiers(key: str) -> tuple[Any, type]:
    """``(verifiers module, its OpenAI chat-completions client class)``; ConfigError when the
    library is missing or has not the classic API."""
    try:
        import verifiers as vf
    except ImportError as e:
        raise ConfigError(key, f"the verifiers connector needs the verifiers library {SUPPORTED} (pip install "
                               f"'megatron-grpo[agents]'): {one_line(e)}") from None
    try:
        vf.Environment, vf.MultiTurnEnv, vf.Rubric, vf.OverlongPromptError  # noqa: B018 (the API's presence)
        from verifiers.clients import OpenAIChatCompletionsClient
    except (AttributeError, ImportError):
        version = getattr(vf, "__version__", "?")
        raise ConfigError(key, f"verifiers {version} has not the classic environment API (vf.Environment, "
                               f"MultiTurnEnv, Rubric): return a verifiers.v1 Taskset, or install "
                               f"verifiers{SUPPORTED} for a classic environment") from None
    return vf, OpenAIChatCompletionsClient


# ---- the rubric ----------------------------------------------------------------------------

def leaf_rubrics(rubric) -> list:
    """The rubrics that hold reward functions: ``rubric`` itself, or a RubricGroup's members (nested)."""
    members = getattr(rubric, "rubrics", None)
    return [leaf for m in members for leaf in leaf_rubrics(m)] if members else [rubric]


def watched(func: Callable, failures: list) -> Callable:
    """``func`` (a reward function) as verifiers calls it, that also appends ``(name, exception)``
    to ``failures`` when it raises or returns no number; verifiers then still logs it and scores 0
    (the module docstring says why the episode fails). ``functools.wraps`` keeps its name and,
    through ``__wrapped__``, the signature verifiers reads to pick its arguments."""
    name = getattr(func, "__name__", repr(func))

    @functools.wraps(func)
    async def call(*args, **kwargs):
        try:
            out = func(*args, **kwargs)
            if inspect.isawaitable(out):
                out = await out
        except Exception as e:
            failures.append((name, e))
            raise
        try:
            float(out)
        except (TypeError, ValueError):
            failures.append((name, TypeError(f"returned {type(out).__name__}, not a number")))
        return out

    return call


def check_rubric(rubric, where: str, key: str) -> None:
    """ConfigError for a rubric that cannot score one episode alone (module docstring)."""
    if rubric.has_group_rewards:
        raise ConfigError(key, f"{where}: the rubric has group reward functions (scored across a prompt's "
                               "rollouts); episodes.kind agent scores each episode alone")
    for leaf in leaf_rubrics(rubric):
        if not leaf.funcs:
            raise ConfigError(key, f"{where}: the environment's {type(leaf).__name__} has no reward function")


# ---- an episode ----------------------------------------------------------------------------

class EnvRows:
    """The environment's own dataset rows by ``example_id`` (indexed on first use)."""

    def __init__(self, env):
        self.env = env
        self._index: Optional[dict] = None
        self._dataset = None

    def get(self, example_id: Any) -> Optional[dict]:
        """The row (a dict) whose ``example_id`` is this one; None if there is none."""
        if self._index is None:
            try:
                self._dataset = self.env.get_dataset()
            except ValueError:  # an environment with an eval dataset only
                self._dataset = None
            ids = [] if self._dataset is None else self._dataset["example_id"]
            self._index = {e: i for i, e in enumerate(ids)}
        i = self._index.get(example_id)
        return None if i is None else dict(self._dataset[i])


def question_messages(env, question: str) -> list[dict]:
    """The prompt verifiers builds from a dataset's ``question`` column: the env's system
    prompt, its few-shot messages, then the question as the user's turn."""
    messages = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
    return messages + list(env.few_shot or []) + [{"role": "user", "content": question}]


def rollout_input(env, rows: EnvRows, row: dict) -> dict:
    """Verifiers' rollout input for our ``row`` (``{**fields, "prompt", "answer"}``).

    Our ``prompt`` is the chat-template text the run rendered, not messages, so the prompt
    messages are those of the environment's own dataset row with the row's ``example_id`` (exactly
    what verifiers would send; taken only when that row has the same ``question``, if the run's row
    has one), else the row's ``question`` formatted as verifiers formats a question column, else
    the run's own prompt messages (``row["messages"]``: the dataset prompt, system prompt
    included, without the environment's system prompt or few-shot). The
    environment row's other columns and all of the run's fields go along (the run's win): verifiers
    hands a row's extra columns to reward functions by name. ValueError for a row with neither."""
    fields = {k: v for k, v in row.items() if k != "prompt"}
    question = row.get("question")
    base = rows.get(row.get("example_id")) if "example_id" in row else None
    if base is not None and (question is None or base.get("question") == question):
        prompt = base.pop("prompt")
        fields = {**base, **fields}
    elif isinstance(question, str):
        prompt = question_messages(env, question)
    elif row.get("messages"):  # the run's own prompt as chat messages (data.apply_chat_template)
        prompt = list(row["messages"])
    else:
        raise ValueError("the row has no 'question' field, no 'example_id' of the environment's dataset and no "
                         "chat messages (data.apply_chat_template is off), so its prompt messages are unknown")
    fields.pop("messages", None)
    fields.setdefault("example_id", 0)
    fields.setdefault("info", {})
    return {**fields, "prompt": prompt}


def front_client_class(vf, base: type) -> type:
    """Verifiers' chat-completions client (``base``), with two answers of the front read as
    the module docstring says (an engine-sampled empty answer; a refused call)."""

    class FrontClient(base):
        async def raise_from_native_response(self, response) -> None:
            choices = getattr(response, "choices", None) or []
            if len(choices) == 1:
                ids = getattr(choices[0], "token_ids", None)
                if ids == [] and choices[0].finish_reason == "length":
                    raise vf.OverlongPromptError("the episode's budget is spent (episodes.max_turns or max_episode_tokens)")
                if ids:
                    return  # sampled by the engine: even an empty text is the policy's answer
            await super().raise_from_native_response(response)

    return FrontClient


def failure(message: str, cause: BaseException) -> VerifiersEpisodeError:
    """A VerifiersEpisodeError carrying the traceback of ``cause``'s root cause."""
    root = cause
    while root.__cause__ is not None:
        root = root.__cause__
    return VerifiersEpisodeError(message).with_traceback(root.__traceback__)


def error_chain(e: BaseException) -> str:
    """``e`` and its causes (at most 4), one line: ``ToolCallError <- ZeroDivisionError: ...``."""
    parts = []
    while e is not None and len(parts) < 4:
        parts.append(one_line(e) if str(e).strip() else type(e).__name__)  # verifiers' wrappers carry no message
        e = e.__cause__
    return " <- ".join(parts)


def episode_result(state) -> dict:
    """``{"reward", <rubric function name>: score}`` of a scored state (a function named
    ``reward`` is logged as ``rubric_reward``)."""
    out = {"reward": float(state["reward"])}
    for name, value in (state.get("metrics") or {}).items():
        out["rubric_reward" if name == "reward" else name] = float(value)
    return out


def agent_function(env, client_class: type, failures: list) -> Callable:
    """The agent function ``async (client, row) -> dict`` of a loaded environment (module docstring)."""
    rows = EnvRows(env)

    async def run(client, row: dict) -> dict:
        failures.clear()
        state = await env.rollout(rollout_input(env, rows, row), client_class(client), MODEL_NAME,
                                  copy.deepcopy(dict(env.sampling_args or {})))
        try:
            if state.get("error") is not None:
                raise failure(f"the rollout ended in {error_chain(state['error'])}", state["error"])
            await env.rubric.score_rollout(state)
        finally:
            await env.rubric.cleanup(state)
        if failures:
            name, e = failures[0]
            raise failure(f"reward function {name} {'raised ' if e.__traceback__ else ''}{one_line(e)}", e)
        return episode_result(state)

    return run


def load_agent(file_spec: str, key: str) -> tuple[Callable, str]:
    """``(agent fn, the user's file)`` for ``<absolute path>:load_environment``; ConfigError when
    the library, the file or the environment it returns cannot be used. A ``verifiers.v1``
    taskset goes to ``verifiers_v1.py``; anything else must be a classic ``vf.Environment``."""
    try:
        import verifiers  # noqa: F401 (the library's presence, before the user's file imports it)
    except ImportError as e:
        raise ConfigError(key, f"the verifiers connector needs the verifiers library (pip install "
                               f"'megatron-grpo[agents]'): {one_line(e)}") from None
    make = load_file(file_spec, key)
    path = file_spec.rpartition(":")[0]
    try:
        env = make()
    except Exception as e:  # the user's code: one line with its site
        raise ConfigError(key, f"verifiers:{file_spec} raised {one_line(e)} at {raise_site(e, path)}") from None
    if verifiers_v1.is_v1(env):
        return verifiers_v1.load_agent(env, f"verifiers:{file_spec}", key), path
    vf, client_base = import_verifiers(key)
    if not isinstance(env, vf.Environment):
        raise ConfigError(key, f"verifiers:{file_spec} returned {type(env).__name__}, not a verifiers Environment "
                               "(classic API) nor a verifiers.v1 Taskset")
    check_rubric(env.rubric, f"verifiers:{file_spec}", key)
    failures: list = []
    for leaf in leaf_rubrics(env.rubric):
        leaf.funcs = [watched(f, failures) for f in leaf.funcs]
    return agent_function(env, front_client_class(vf, client_base), failures), path
