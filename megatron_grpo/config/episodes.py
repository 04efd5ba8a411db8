"""`episodes:` section: what generates a response besides one engine call (``kind``, with its
``source``): multi-turn episodes with an environment or an agent (their turn limits,
observation rendering and failures), or the user's own rollout function (docs/multi_turn.md,
docs/agents.md). One deadline (``timeout_s``) and one concurrency (``concurrency``), each
meaning what its kind needs, with a default by kind."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_grpo.config.base import check, missing_file
from megatron_grpo.config.connectors import AGENTS_EXTRA, connector_problem, connectors_of, split_connector_spec

BUILTIN_ENVIRONMENTS = ("calculator", "guess_number")
"""Names of the built-in environments (``rollout/episodes/environment/builtin.py``)."""

ENVIRONMENT_FILE_RE = re.compile(r"^(?P<path>.+\.py):(?P<attr>[A-Za-z_]\w*)$")
"""``path/to/env.py:ClassName``: an environment class loaded from a file (no PYTHONPATH)."""


def rollout_function_problem(spec: str) -> Optional[str]:
    """Why ``spec`` cannot name a rollout function (None if it can); checks the file exists, imports nothing."""
    m = ENVIRONMENT_FILE_RE.match(spec)
    if m is None:
        return f"{spec!r} is not a file path path/to/file.py:fn"
    return missing_file(m["path"], "rollout function")


def environment_problem(spec: str) -> Optional[str]:
    """Why ``spec`` cannot name an environment (None if it can); checks the file exists, imports nothing."""
    if spec in BUILTIN_ENVIRONMENTS:
        return None
    connector = split_connector_spec(spec)  # skyrl_gym:..., openenv:..., tools:... (config/connectors.py)
    if connector is not None:
        return connector_problem(*connector)
    m = ENVIRONMENT_FILE_RE.match(spec)
    if m is None:
        return (f"{spec!r} is neither a built-in environment ({', '.join(BUILTIN_ENVIRONMENTS)}), a file "
                "path path/to/env.py:ClassName nor a connector's <prefix>:<target>")
    return missing_file(m["path"], "environment")


TOOL_CALL_FORMATS = ("hermes", "compute")
"""``episodes.tool_call_format`` values (``chat/tool_calls.py``'s registry; a test keeps them equal)."""


def agent_problem(spec: str) -> Optional[str]:
    """Why ``spec`` cannot name an agent (None if it can): ``path/to/file.py:fn`` or
    ``<connector>:path/to/file.py:attr``, the file present and the libraries installed; imports nothing."""
    agents = connectors_of("agent")  # config/connectors.py
    prefix, sep, rest = spec.partition(":")
    connector = agents.get(prefix) if sep else None
    file_spec = rest if connector else spec
    m = ENVIRONMENT_FILE_RE.match(file_spec)
    if m is None:
        return (f"{spec!r} is not a file path path/to/file.py:fn (or <connector>:path/to/file.py:attr; connectors: "
                f"{', '.join(agents)})")
    missing = missing_file(m["path"], "agent")
    if missing is not None:
        return missing
    for library in ["openai"] + ([connector.library] if connector and connector.library else []):
        if importlib.util.find_spec(library) is None:
            return f"{spec!r} needs the {library} library, which is not installed: {AGENTS_EXTRA}"
    return None


EPISODE_KINDS = ("environment", "agent", "function")
"""``episodes.kind`` values: what runs a step's episodes (``rollout/episodes/source.py``)."""

DEFAULT_TIMEOUT_S = {"environment": 30.0, "agent": 300.0, "function": 300.0}
"""``episodes.timeout_s`` when null, by kind: an environment's call is short (a step of a game or
a tool), an agent's episode or a function's stretch of code may hold many model calls."""

DEFAULT_AGENT_CONCURRENCY = 8
"""``episodes.concurrency`` of an agent when null: its worker processes (each runs one episode)."""


def source_problem(kind: str, source: str) -> Optional[str]:
    """Why ``source`` cannot be run by ``kind`` (None if it can); imports nothing."""
    problem = {"environment": environment_problem, "agent": agent_problem,
               "function": rollout_function_problem}[kind]
    return problem(source)


@dataclass(kw_only=True)
class EpisodesConfig:
    """`episodes:` multi-turn episodes of an environment or an agent, or a custom rollout function
    (docs/multi_turn.md, docs/agents.md)."""

    kind: Optional[Literal["environment", "agent", "function"]] = None
    """What generates a step's responses besides one engine call: environment, multi-turn
    episodes with an environment (docs/multi_turn.md); agent, episodes run by an agent written
    against the OpenAI SDK (docs/agents.md); function, the user's rollout function
    (docs/multi_turn.md, "Custom rollout functions"). null: single-turn rollouts (the other keys
    of the section are then unused)."""

    source: Optional[str] = None
    """What runs, by kind (set with kind, null without). environment: a built-in (calculator,
    guess_number), `path/to/env.py:ClassName` (a class constructed with the dataset row whose
    `step(response) -> {"observation", "done", "reward"}` answers each model turn) or a
    connector's `<prefix>:<target>` (skyrl_gym, openenv, tools). agent: `path/to/file.py:fn` with
    `async def fn(client, row) -> float | dict` (or a plain def), or
    `verifiers:path/to/env.py:load_environment`; its client's calls go to the run's engine through
    an OpenAI-compatible server on loopback that records the exact token ids, max_turns caps its
    model calls, max_episode_tokens its tokens, on_env_error and env_reward treat its failures and
    reward as an environment's. function: `path/to/file.py:fn`, fn(engine, prompts, n, sampling,
    seed) -> n Samples per prompt, prompt-major (token ids, the engine's log-probs, output_mask),
    checked every call."""

    timeout_s: Optional[float] = None
    """The deadline, by kind. environment: one environment call (construction or step), past it
    the call is killed with its worker process and the episode ends as an environment error;
    agent: one episode, past it its worker and everything it started are killed and the episode
    ends as a timeout; function: loading its file, and each stretch in which it neither returns
    nor calls engine.generate (the engine's calls have engine.request_timeout_s), past it the
    worker is killed and the run stops with one line. null: 30 for an environment, 300 for an
    agent or a function."""

    concurrency: Optional[int] = None
    """Episodes run at once. environment: null is engine.max_inflight_requests (each episode has
    at most one engine request in flight); agent: its worker processes, kept across steps, null is
    8. Refused with kind function, which gets the whole step in one call and runs it as it likes."""

    observation_role: Literal["tool", "user"] = "tool"
    """Chat role of an observation turn, rendered by the tokenizer's chat template (not guessed
    from the template: a template that does not know the role renders it as something else)."""

    observation_formatter: Optional[str] = None
    """`path/to/file.py:fn` with fn(observation: str, tokenizer) -> list[int]: the token ids that
    follow a model turn, instead of the chat template's delta render (for templates that rewrite
    earlier turns). null: the template's delta render."""

    max_turns: int = 4
    """Model turns per episode; the episode ends after the environment's answer to the last one."""

    max_episode_tokens: Optional[int] = None
    """Token budget of an episode after the prompt (model and observation tokens): a model turn
    gets at most what is left (finish_reason length when cut), an observation that does not fit
    with at least one more model token ends the episode. null: what the model's context leaves
    after the episode's prompt (max_position_embeddings less its tokens), which always fits; a
    number must fit after the longest prompt (checked at pre-flight)."""

    max_timeout_fraction: Optional[float] = 0.5
    """When a step's deadline expiries (timeout_s of an environment call or an agent episode)
    reach this fraction of the episodes it started (and at least 2), the environment or agent is
    taken as hung: every worker is killed and the run stops with one line, after one wave of
    deadlines instead of one per episode. A rarer hang only ends its episode. null: never stop
    for timeouts."""

    on_env_error: Literal["zero_reward", "drop"] = "zero_reward"
    """An episode whose environment raised, timed out or sent an observation with unknown tokens:
    zero_reward: its reward is 0; drop: it trains nothing (loss mask 0) and its reward is its
    group's mean over the other episodes (so the group mean is unchanged)."""

    env_reward: Literal["add", "replace"] = "add"
    """How the environment's reward (the sum of its per-step rewards) combines with the reward
    functions' score: added to it, or replacing it."""

    tool_call_format: Literal["hermes", "compute"] = "hermes"
    """How an agent's `tools=` calls are found in the model's text (docs/agents.md): hermes,
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Qwen2.5/Qwen3/Hermes templates);
    compute, the CPU tool demo's `compute <expression>`."""

    def __post_init__(self):
        check(self.kind is None or self.kind in EPISODE_KINDS, "kind",
              f"must be one of {', '.join(EPISODE_KINDS)} or null, got {self.kind!r}")
        check((self.kind is None) == (self.source is None), "source" if self.kind else "kind",
              f"is needed with episodes.kind {self.kind}: what runs its episodes" if self.kind else
              f"is needed with episodes.source {self.source!r}: environment, agent or function")
        if self.kind is not None:
            problem = source_problem(self.kind, self.source)
            check(problem is None, "source", problem or "")
        check(self.timeout_s is None or self.timeout_s > 0, "timeout_s", f"must be > 0 or null, got {self.timeout_s}")
        check(self.concurrency is None or self.concurrency >= 1, "concurrency",
              f"must be >= 1 or null, got {self.concurrency}")
        check(self.concurrency is None or self.kind != "function", "concurrency",
              "is not used with episodes.kind function (the function gets the whole step in one call); set it to null")
        check(self.max_turns >= 1, "max_turns", f"must be >= 1, got {self.max_turns}")
        check(self.max_episode_tokens is None or self.max_episode_tokens >= 1, "max_episode_tokens",
              f"must be >= 1 or null, got {self.max_episode_tokens}")
        f = self.max_timeout_fraction
        check(f is None or 0 < f <= 1, "max_timeout_fraction", f"must be in (0, 1] or null, got {f}")
        f = self.observation_formatter
        check(f is None or ENVIRONMENT_FILE_RE.match(f) is not None, "observation_formatter",
              f"must be a file path path/to/file.py:fn or null, got {f!r}")

    @property
    def deadline_s(self) -> float:
        """``timeout_s``, its null resolved by kind (``DEFAULT_TIMEOUT_S``; an environment's
        without a kind, for a caller that checks an environment spec alone)."""
        return self.timeout_s if self.timeout_s is not None else DEFAULT_TIMEOUT_S[self.kind or "environment"]

    def episodes_at_once(self, max_inflight_requests: int) -> int:
        """``concurrency``, its null resolved by kind: ``max_inflight_requests`` (the engine's, the
        caller's) for an environment, ``DEFAULT_AGENT_CONCURRENCY`` worker processes for an agent."""
        if self.concurrency is not None:
            return self.concurrency
        return DEFAULT_AGENT_CONCURRENCY if self.kind == "agent" else max_inflight_requests

    # read-only views by kind, for the readers that ask "is there an environment?"
    @property
    def environment(self) -> Optional[str]:
        """``source`` when ``kind`` is environment, else None."""
        return self.source if self.kind == "environment" else None

    @property
    def agent(self) -> Optional[str]:
        """``source`` when ``kind`` is agent, else None."""
        return self.source if self.kind == "agent" else None

    @property
    def rollout_function(self) -> Optional[str]:
        """``source`` when ``kind`` is function, else None."""
        return self.source if self.kind == "function" else None

    @property
    def multi_turn(self) -> bool:
        """Episodes of an environment or an agent (turns, observations, an episode's reward)."""
        return self.kind in ("environment", "agent")


FALLBACK_EPISODE_TOKENS = 512
"""An episode's budget when ``max_episode_tokens`` is null and the model's config gives no
context length (no ``max_position_embeddings``)."""


def episode_budget(max_episode_tokens: Optional[int], model_context: Optional[int], prompt_tokens: int) -> int:
    """Tokens an episode may add after its prompt: ``max_episode_tokens`` when set; else what the
    model's context leaves after the prompt (at least 1: a prompt that fills the context is
    refused at pre-flight). The old fixed default, 512, was the demo model's whole context, so any
    environment on the demo was refused (issue 64)."""
    if max_episode_tokens is not None:
        return max_episode_tokens
    if model_context is None:
        return FALLBACK_EPISODE_TOKENS
    return max(1, model_context - prompt_tokens)
