"""`episodes:` section: what generates a response besides one engine call: multi-turn episodes
with an environment (its turn limits, observation rendering and failures), or the user's own
rollout function (docs/multi_turn.md)."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from megatron_grpo.config.base import check
from megatron_grpo.config.env_connectors import connector_problem, split_connector_spec

BUILTIN_ENVIRONMENTS = ("calculator", "guess_number")
"""Names of the built-in environments (``rollout/episodes/environment/builtin.py``)."""

ENVIRONMENT_FILE_RE = re.compile(r"^(?P<path>.+\.py):(?P<attr>[A-Za-z_]\w*)$")
"""``path/to/env.py:ClassName``: an environment class loaded from a file (no PYTHONPATH)."""


def rollout_function_problem(spec: str) -> Optional[str]:
    """Why ``spec`` cannot name a rollout function (None if it can); checks the file exists, imports nothing."""
    m = ENVIRONMENT_FILE_RE.match(spec)
    if m is None:
        return f"{spec!r} is not a file path path/to/file.py:fn"
    path = Path(m["path"]).expanduser().resolve()
    if not path.is_file():
        return f"rollout function file {path} not found (a relative path is resolved against the current directory)"
    return None


def environment_problem(spec: str) -> Optional[str]:
    """Why ``spec`` cannot name an environment (None if it can); checks the file exists, imports nothing."""
    if spec in BUILTIN_ENVIRONMENTS:
        return None
    connector = split_connector_spec(spec)  # skyrl_gym:..., openenv:..., tools:... (config/env_connectors.py)
    if connector is not None:
        return connector_problem(*connector)
    m = ENVIRONMENT_FILE_RE.match(spec)
    if m is None:
        return (f"{spec!r} is neither a built-in environment ({', '.join(BUILTIN_ENVIRONMENTS)}), a file "
                "path path/to/env.py:ClassName nor a connector's <prefix>:<target>")
    path = Path(m["path"]).expanduser().resolve()
    if not path.is_file():
        return f"environment file {path} not found (a relative path is resolved against the current directory)"
    return None


AGENT_CONNECTORS = {"verifiers": "verifiers"}
"""``episodes.agent`` prefix -> the library it needs (the connectors themselves are
``rollout/episodes/agent/connectors/``; a test keeps the two tables' prefixes equal)."""

TOOL_CALL_FORMATS = ("hermes", "compute")
"""``episodes.tool_call_format`` values (``chat/tool_calls.py``'s registry; a test keeps them equal)."""


def agent_problem(spec: str) -> Optional[str]:
    """Why ``spec`` cannot name an agent (None if it can): ``path/to/file.py:fn`` or
    ``<connector>:path/to/file.py:attr``, the file present and the libraries installed; imports nothing."""
    prefix, sep, rest = spec.partition(":")
    connector = prefix if sep and prefix in AGENT_CONNECTORS else None
    file_spec = rest if connector else spec
    m = ENVIRONMENT_FILE_RE.match(file_spec)
    if m is None:
        return (f"{spec!r} is not a file path path/to/file.py:fn (or <connector>:path/to/file.py:attr; connectors: "
                f"{', '.join(AGENT_CONNECTORS)})")
    path = Path(m["path"]).expanduser().resolve()
    if not path.is_file():
        return f"agent file {path} not found (a relative path is resolved against the current directory)"
    for library in ["openai"] + ([AGENT_CONNECTORS[connector]] if connector else []):
        if importlib.util.find_spec(library) is None:
            return f"{spec!r} needs the {library} library, which is not installed: pip install 'megatron-grpo[agents]'"
    return None


@dataclass(kw_only=True)
class EpisodesConfig:
    """`episodes:` multi-turn episodes of an environment or an agent, or a custom rollout function
    (docs/multi_turn.md, docs/agents.md)."""

    environment: Optional[str] = None
    """Multi-turn episodes with an environment (docs/multi_turn.md): a built-in (calculator,
    guess_number) or `path/to/env.py:ClassName`, a class constructed with the dataset row whose
    `step(response) -> {"observation", "done", "reward"}` answers each model turn. null:
    single-turn rollouts."""

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

    env_timeout_s: float = 30.0
    """Deadline of one environment call (construction or step); a call past it is killed with
    its worker process and the episode ends as an environment error (see max_timeout_fraction)."""

    max_timeout_fraction: Optional[float] = 0.5
    """When a step's deadline expiries (env_timeout_s, agent_timeout_s) reach this fraction of
    the episodes it started (and at least 2), the environment or agent is taken as hung: every
    worker is killed and the run stops with one line, after one wave of deadlines instead of
    one per episode. A rarer hang only ends its episode. null: never stop for timeouts."""

    on_env_error: Literal["zero_reward", "drop"] = "zero_reward"
    """An episode whose environment raised, timed out or sent an observation with unknown tokens:
    zero_reward: its reward is 0; drop: it trains nothing (loss mask 0) and its reward is its
    group's mean over the other episodes (so the group mean is unchanged)."""

    env_reward: Literal["add", "replace"] = "add"
    """How the environment's reward (the sum of its per-step rewards) combines with the reward
    functions' score: added to it, or replacing it."""

    rollout_function: Optional[str] = None
    """`path/to/file.py:fn`, a function that generates each step's samples instead of the
    built-in loop (docs/multi_turn.md, "Custom rollout functions"): fn(engine, prompts, n,
    sampling, seed) -> n Samples per prompt, prompt-major (token ids, the engine's log-probs,
    output_mask), checked every call. null: single-turn, or the `environment` episode loop."""

    rollout_function_timeout_s: float = 300.0
    """Deadline of rollout_function's own code: loading its file, and each stretch in which it
    neither returns nor calls engine.generate (the engine's calls have engine.request_timeout_s).
    The function runs in a worker process; past the deadline the worker is killed and the run
    stops with one line naming the file and the function."""

    agent: Optional[str] = None
    """Episodes run by an agent written against the OpenAI SDK (docs/agents.md):
    `path/to/file.py:fn` with `async def fn(client, row) -> float | dict` (or a plain def), or a
    connector's `verifiers:path/to/env.py:load_environment`. Its client's calls go to the run's
    engine through an OpenAI-compatible server on loopback that records the exact token ids;
    max_turns caps its model calls, max_episode_tokens its tokens, on_env_error and env_reward
    treat its failures and reward as an environment's. null: no agent."""

    agent_workers: int = 8
    """Worker processes running `agent` (kept across steps); at most this many episodes run at once."""

    agent_timeout_s: float = 300.0
    """Deadline of one agent episode; past it its worker and everything it started are killed and
    the episode ends as a timeout."""

    tool_call_format: Literal["hermes", "compute"] = "hermes"
    """How an agent's `tools=` calls are found in the model's text (docs/agents.md): hermes,
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Qwen2.5/Qwen3/Hermes templates);
    compute, the CPU tool demo's `compute <expression>`."""

    def __post_init__(self):
        check(self.agent_workers >= 1, "agent_workers", f"must be >= 1, got {self.agent_workers}")
        check(self.agent_timeout_s > 0, "agent_timeout_s", f"must be > 0, got {self.agent_timeout_s}")
        if self.agent is not None:
            problem = agent_problem(self.agent)
            check(problem is None, "agent", problem or "")
            check(self.environment is None and self.rollout_function is None, "agent",
                  "cannot be combined with episodes.environment or episodes.rollout_function (the agent runs the "
                  "episode); set the others to null")
        check(self.max_turns >= 1, "max_turns", f"must be >= 1, got {self.max_turns}")
        check(self.max_episode_tokens is None or self.max_episode_tokens >= 1, "max_episode_tokens",
              f"must be >= 1 or null, got {self.max_episode_tokens}")
        check(self.env_timeout_s > 0, "env_timeout_s", f"must be > 0, got {self.env_timeout_s}")
        f = self.max_timeout_fraction
        check(f is None or 0 < f <= 1, "max_timeout_fraction", f"must be in (0, 1] or null, got {f}")
        f = self.observation_formatter
        check(f is None or ENVIRONMENT_FILE_RE.match(f) is not None, "observation_formatter",
              f"must be a file path path/to/file.py:fn or null, got {f!r}")
        check(self.rollout_function_timeout_s > 0, "rollout_function_timeout_s", "must be > 0")
        if self.environment is not None:
            problem = environment_problem(self.environment)
            check(problem is None, "environment", problem or "")
        if self.rollout_function is not None:
            problem = rollout_function_problem(self.rollout_function)
            check(problem is None, "rollout_function", problem or "")
            check(self.environment is None, "rollout_function",
                  "cannot be combined with episodes.environment (the environment's episode loop is the built-in "
                  "rollout function); set one of them to null")


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
