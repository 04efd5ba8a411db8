"""``episodes.kind: agent``: episodes run by an agent the user wrote against the OpenAI SDK,
``async def run(client, row) -> float | dict`` (or a plain ``def``), or an environment of another
library through its connector (``verifiers:path/to/env.py:load_environment``); docs/agents.md.

For each prompt, ``n`` episodes run; each one is

    the front opens an episode id        (front.py: its own base URL on the run's loopback server)
    a worker process runs fn(client, row) with an openai client bound to that URL
                                         (worker.py: one agent per worker at a time, killed on hang)
    every call the agent makes           -> the run's engine, recorded as exact token ids
    fn returns the reward                -> the episode: the recorded calls as one Sample
                                            (trajectory.py; only the engine's tokens are trained)

An ``Episode`` comes back, as from the built-in loop (``environment/loop.py``), so rewards,
failures (``on_env_error``), metrics, the off-policy correction, sampling-mask replay and async
staleness apply unchanged; per-call seeds are the built-in loop's.

Failures do not stop the run: an agent that raises, hangs past its deadline (its worker and
what it started are killed), makes no call, or ``diverged`` (front.py) ends its episode, counted
and scored as ``on_env_error`` says, each site printed once; a step whose deadlines keep
expiring stops the run (``hang_guard.py``). An agent that returns something other than a
reward is a contract error: one line, the run stops. Workers are a pool of ``workers``
processes kept across rounds; episodes run at most ``workers`` at a time.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

from megatron_grpo.config.base import ConfigError, missing_file
from megatron_grpo.config.episodes import ENVIRONMENT_FILE_RE, episode_budget
from megatron_grpo.config.connectors import connectors_of
from megatron_grpo.rollout.episodes.agent.connectors import split_spec
from megatron_grpo.rollout.episodes.agent.front import AgentFront, EpisodeLog
from megatron_grpo.rollout.episodes.agent.trajectory import sample_from_calls
from megatron_grpo.rollout.episodes.environment.worker import STARTUP_TIMEOUT_S, fork_server, kill_worker
from megatron_grpo.rollout.episodes.hang_guard import HangGuard
from megatron_grpo.rollout.episodes.episode import Episode, episode_jobs, raise_failures, report_failure_once
from megatron_grpo.rollout.episodes.turns import TurnRenderer
from megatron_grpo.wire.samples import Sample, SamplingParams

KEY = "episodes.agent"  # the label of its runtime lines (config errors of the spec name episodes.source)
SEED_MODULUS = 2**31 - 1


class AgentContractError(ValueError):
    """The agent broke its contract (what it returns, its file): one line; the run stops."""


class AgentFailed(RuntimeError):
    """One episode's agent failed: ``kind`` ``error`` or ``timeout``; ``where`` is file:line."""

    def __init__(self, kind: str, message: str, where: str):
        self.kind, self.message, self.where = kind, message, where
        super().__init__(f"{where}: {message}")


def resolve_spec(spec: str) -> str:
    """``<absolute file>:<fn>`` of ``path/to/file.py:fn``, or ``<prefix>:<absolute file>:<attr>``
    of a connector's ``<prefix>:path/to/file.py:attr`` (``connectors/``); ConfigError otherwise."""
    prefix, file_spec = split_spec(spec)
    m = ENVIRONMENT_FILE_RE.match(file_spec)
    if m is None:
        raise ConfigError("episodes.source", f"{spec!r} is not a file path path/to/file.py:fn (or <connector>:path/to/file.py:attr, "
                               f"connectors: {', '.join(connectors_of('agent'))})")
    missing = missing_file(m["path"])
    if missing is not None:
        raise ConfigError("episodes.source", missing)
    return f"{prefix + ':' if prefix else ''}{Path(m['path']).expanduser().resolve()}:{m['attr']}"


class AgentProcess:
    """One worker process running the agent (``worker.py``); blocking calls with deadlines."""

    def __init__(self, spec: str):
        self.spec = spec
        self._conn, self.pid = fork_server().connect(("run", "agent", (spec,)))
        self.closed = False
        if not self._conn.poll(STARTUP_TIMEOUT_S):
            self.kill()
            raise AgentFailed("timeout", f"loading the file took longer than {STARTUP_TIMEOUT_S:g}s", spec)
        kind, payload = self._recv("loading the file")
        if kind == "contract":
            self.kill()
            raise AgentContractError(f"{KEY} {spec}: {payload}" if not payload.startswith(KEY) else payload)

    def _recv(self, what: str) -> tuple:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise AgentFailed("error", f"the worker process died during {what}", self.spec) from None

    def run(self, base_url: str, api_key: str, row: dict, timeout_s: float) -> dict:
        """The agent's ``{"reward", "metrics"}`` for one episode; AgentFailed or AgentContractError."""
        try:
            self._conn.send(("run", (base_url, api_key, row, timeout_s)))
        except (BrokenPipeError, OSError):
            self.kill()
            raise AgentFailed("error", "the worker process is gone", self.spec) from None
        if not self._conn.poll(timeout_s):
            self.kill()
            raise AgentFailed("timeout", f"the episode took longer than {timeout_s:g}s; its worker process was "
                                         "killed", self.spec)
        kind, payload = self._recv("an episode")
        if kind == "ok":
            return payload
        if kind == "contract":
            self.kill()
            raise AgentContractError(payload)
        raise AgentFailed("error", payload["message"], payload["where"])

    def kill(self) -> None:
        if not self.closed:
            self.closed = True
            kill_worker(self.pid)
            self._conn.close()

    def close(self) -> None:
        if not self.closed:
            try:
                self._conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
            self.kill()


def check_agent(spec: str) -> None:
    """Pre-flight: the agent's file loads in a worker process (a connector's environment is
    built there); ConfigError (one line naming ``episodes.kind: agent``) otherwise."""
    try:
        AgentProcess(resolve_spec(spec)).close()
    except (AgentFailed, AgentContractError) as e:
        raise ConfigError(KEY, str(e).removeprefix(f"{KEY} ")) from None


class AgentRunner:
    """Rank 0's agent episodes (module docstring): a rollout function,
    ``runner(engine, prompts, n, sampling, seed) -> n Episodes per prompt``, prompt-major."""

    def __init__(self, spec: str, tokenizer, renderer: TurnRenderer, *, max_turns: int,
                 max_episode_tokens: Optional[int], timeout_s: float, workers: int, tool_call_format: str = "hermes",
                 max_inflight: int = 64, on_env_error: str = "zero_reward", model_context: Optional[int] = None,
                 max_timeout_fraction: Optional[float] = 0.5):
        self.spec = resolve_spec(spec)
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.model_context = model_context  # an episode's budget when max_episode_tokens is null
        self.timeout_s = timeout_s
        self.workers = workers
        self.on_env_error = on_env_error
        self.max_timeout_fraction = max_timeout_fraction  # the step's HangGuard (rollout/episodes/hang_guard.py)
        self.front = AgentFront(tokenizer, renderer, tool_call_format=tool_call_format,
                                max_inflight=max_inflight).start()
        self._idle: list[AgentProcess] = []
        self._idle_lock = threading.Lock()
        self._reported: set[tuple[str, str]] = set()
        try:
            self._release(AgentProcess(self.spec))  # pre-flight: the file loads in a worker
        except (AgentFailed, AgentContractError) as e:
            self.close()
            raise ConfigError(KEY, str(e).removeprefix(f"{KEY} ")) from None

    @classmethod
    def build(cls, episodes_cfg, tokenizer, *, max_inflight: int, use_template: bool,
              model_context: Optional[int] = None) -> "AgentRunner":
        """The run's runner from its ``episodes:`` section (``EpisodesConfig``): the chat template
        must render tool/user turns after an assistant turn prefix-stably (``TurnRenderer``'s
        pre-flight), the agent's file loads in a worker; ConfigError (one line) otherwise."""
        renderer = TurnRenderer(tokenizer, episodes_cfg.observation_role, use_template=use_template)
        return cls(episodes_cfg.source, tokenizer, renderer, max_turns=episodes_cfg.max_turns,
                   max_episode_tokens=episodes_cfg.max_episode_tokens, timeout_s=episodes_cfg.deadline_s,
                   workers=episodes_cfg.episodes_at_once(max_inflight), tool_call_format=episodes_cfg.tool_call_format,
                   max_inflight=max_inflight, on_env_error=episodes_cfg.on_env_error, model_context=model_context,
                   max_timeout_fraction=episodes_cfg.max_timeout_fraction)

    # ---- workers -------------------------------------------------------------------------

    def _acquire(self) -> AgentProcess:
        with self._idle_lock:
            if self._idle:
                return self._idle.pop()
        return AgentProcess(self.spec)

    def _release(self, proc: AgentProcess) -> None:
        if not proc.closed:
            with self._idle_lock:
                self._idle.append(proc)

    def close(self) -> None:
        """Stop the workers and the front."""
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for proc in idle:
            proc.close()
        self.front.close()

    # ---- episodes ------------------------------------------------------------------------

    def episodes(self, engine, prompts: Sequence, n: int, sampling: SamplingParams,
                 sampling_seed: Optional[int] = None) -> tuple[list[Sample], list[Episode]]:
        """``EpisodeSource`` (rollout/episodes/source.py): the episodes and their samples."""
        episodes = self(engine, prompts, n, sampling, sampling_seed)
        return [e.sample for e in episodes], episodes

    def __call__(self, engine, prompts: Sequence, n: int, sampling: SamplingParams,
                 sampling_seed: Optional[int] = None) -> list[Episode]:
        jobs = episode_jobs(prompts, n)
        guard = HangGuard(f"{KEY} {self.spec}", self.timeout_s, self.max_timeout_fraction)
        with ThreadPoolExecutor(max_workers=max(1, min(self.workers, len(jobs))),
                                thread_name_prefix="agent-episode") as pool:
            futures = [pool.submit(self._episode, engine, *job, sampling, sampling_seed, guard) for job in jobs]
            results = []
            for f in futures:
                try:
                    results.append(f.result())
                except BaseException as e:  # collected, raised once every episode has ended
                    results.append(e)
        guard.check()
        raise_failures(results, AgentContractError)
        return results

    def _episode(self, engine, index: int, prompt_index: int, sample_index: int, prompt, sampling: SamplingParams,
                 sampling_seed: Optional[int], guard: HangGuard) -> Episode:
        guard.begin()
        # the row an agent gets: the dataset row's fields, the rendered prompt's text, the
        # answer and the chat messages it renders (None without a template)
        row = {**prompt.fields, "prompt": prompt.text, "answer": prompt.answer, "messages": prompt.messages}
        seed = None if sampling_seed is None else (sampling_seed + index * self.max_turns) % SEED_MODULUS
        episode_id = uuid.uuid4().hex
        self.front.open_episode(episode_id, EpisodeLog(engine=engine, sampling=sampling, seed=seed,
                                                       max_calls=self.max_turns,
                                                       max_tokens=episode_budget(self.max_episode_tokens,
                                                                                 self.model_context,
                                                                                 len(prompt.prompt_ids))))
        reward, metrics, error = 0.0, {}, None
        t0 = time.monotonic()
        try:
            proc = self._acquire()
            guard.watch(proc.pid)
            try:
                result = proc.run(self.front.base_url(episode_id), self.front.api_key, row, self.timeout_s)
                reward, metrics = result["reward"], result["metrics"]
            finally:
                guard.forget(proc.pid)
                self._release(proc)
        except AgentFailed as e:
            error = e.kind
            guard.failed(e.kind)
            self._report(e.kind, e.where, e.message)
        finally:
            log = self.front.close_episode(episode_id)
        wall = time.monotonic() - t0
        if error is None and log.error is not None:
            error = log.error
            self._report(log.error, self.spec, log.error_message)
        if error is None and not log.calls:
            error = "error"
            self._report("error", self.spec, "the agent returned without calling the model")
        with_kept = sampling.sampling_mask_max_kept > 0
        # as the built-in loop: an episode that failed keeps the turns it had, scored as
        # on_env_error says (the front records no call that does not continue the episode, so
        # a diverged or refused-observation episode's recorded calls are one consistent trajectory)
        if log.calls:
            sample = sample_from_calls([(c.prompt_ids, c.sample) for c in log.calls], prompt_index=prompt_index,
                                       sample_index=sample_index, with_kept=with_kept)
        else:  # no call: nothing trainable, the episode's error scores it
            sample = Sample(prompt_index=prompt_index, sample_index=sample_index,
                            prompt_ids=list(prompt.prompt_ids), output_ids=[], output_logprobs=[],
                            finish_reason="abort", weight_version="", output_mask=[],
                            kept_ids=[] if with_kept else None, log_kept_mass=[] if with_kept else None)
        generate_s = sum(c.generate_s for c in log.calls)
        return Episode(sample=sample, num_turns=len(log.calls), env_reward=float(reward), error=error,
                       env_s=max(0.0, wall - generate_s), generate_s=generate_s, tool_call_errors=log.tool_call_errors,
                       metrics=metrics)

    def _report(self, kind: str, where: str, message: str) -> None:
        report_failure_once(self._reported, KEY, kind, where, message, self.on_env_error)
