"""Multi-turn episodes: the model and an environment (``episodes.kind: environment``) take turns.

For each prompt, ``n`` episodes run; each one is

    env = the environment, constructed with the dataset row        (its own worker process)
    loop:  model turn   = engine.generate(prompt + everything so far)   token ids in, ids + log-probs out
           answer       = env.step(the turn's text)                     observation, done, reward
           stop on done, no observation, episodes.max_turns or the token budget
           append the observation's ids (rollout/episodes/turns.py: the template's delta render;
           an observation is cut to what the budget left can hold before it is tokenized)

Token-in/token-out: every model turn is a ``generate`` on the exact token ids of the episode
so far, never re-tokenized text, and the episode's ``Sample`` keeps those ids: model tokens
with the engine's log-probs (``output_mask`` 1), observation tokens with log-prob 0
(``output_mask`` 0), so the trainer scores bit-for-bit what the engine saw.

Failures of the environment do not stop the run: an environment that raises, hangs past
``episodes.timeout_s`` (its worker is killed) or sends an observation with unknown tokens ends its
episode, which is then scored as ``on_env_error`` says; each failure site is printed once
(file:line) and counted in the step's metrics. A broken contract (``EnvContractError``: the
file, class or ``step`` answer's shape) stops the run with one line.

Episodes run concurrently (at most ``engine.max_inflight_requests`` at once) on an asyncio
loop of the calling thread; the blocking calls (the engine's ``generate``, a worker's pipe)
run on a thread pool of that size, and no user code runs in this process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from megatron_grpo.config.base import ConfigError
from megatron_grpo.config.connectors import split_connector_spec
from megatron_grpo.config.episodes import EpisodesConfig, episode_budget
from megatron_grpo.data.prompts import has_chat_template
from megatron_grpo.rewards.registry import load_file
from megatron_grpo.rollout.episodes.environment import EnvCallError, EnvContractError, EnvProcess, check_environment
from megatron_grpo.rollout.episodes.hang_guard import HangGuard
from megatron_grpo.rollout.episodes.episode import Episode, episode_jobs, raise_failures, report_failure_once
from megatron_grpo.rollout.episodes.turns import ObservationError, TurnRenderer
from megatron_grpo.wire.samples import Sample, SamplingParams

_SEED_MODULUS = 2**31 - 1


class EpisodeRunner:
    """Rank 0's multi-turn rollouts. ``EpisodeRunner.build(episodes_cfg, tokenizer,
    max_inflight=..., use_template=...)`` checks everything that can be checked before a rank trains (pre-flight);
    ``run(engine, prompts, n, sampling, sampling_seed)`` -> ``n`` Episodes per prompt, prompt-major."""

    def __init__(self, episodes_cfg: EpisodesConfig, renderer: TurnRenderer, *, max_inflight: int,
                 model_context: Optional[int] = None):
        """``max_inflight``: the most episodes at once (``engine.max_inflight_requests``: each
        has at most one engine request in flight); ``model_context``: the model's context length,
        an episode's budget when ``max_episode_tokens`` is null (``episode_budget``)."""
        self.spec = episodes_cfg.source
        self.cfg = episodes_cfg
        self.model_context = model_context
        self.max_inflight = max_inflight
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self._reported: set[tuple[str, str]] = set()
        # a connector that parses tool calls gets the run's format (its worker's construction option)
        connector = split_connector_spec(self.spec)
        self.env_options = ({"tool_call_format": episodes_cfg.tool_call_format}
                            if connector is not None and connector[0] == "tools" else None)

    @classmethod
    def build(cls, episodes_cfg: EpisodesConfig, tokenizer, *, max_inflight: int,
              use_template: bool, model_context: Optional[int] = None) -> "EpisodeRunner":
        """Pre-flight: the environment class loads (in a worker process), the formatter loads,
        the chat template renders observation turns prefix-stably. One-line errors."""
        try:
            check_environment(episodes_cfg.source, episodes_cfg.deadline_s, prepare=True)
        except EnvContractError as e:
            raise ConfigError("", str(e)) from None
        formatter = (load_file(episodes_cfg.observation_formatter, "episodes.observation_formatter")
                     if episodes_cfg.observation_formatter else None)
        renderer = TurnRenderer(tokenizer, episodes_cfg.observation_role, formatter=formatter,
                                use_template=use_template and has_chat_template(tokenizer))
        return cls(episodes_cfg, renderer, max_inflight=max_inflight, model_context=model_context)

    def __call__(self, engine, prompts: Sequence, n: int, sampling: SamplingParams,
                 sampling_seed: Optional[int] = None) -> list[Episode]:
        """The built-in rollout function (``rollout/episodes/function/source.py``): ``run``."""
        return self.run(engine, prompts, n, sampling, sampling_seed)

    def episodes(self, engine, prompts: Sequence, n: int, sampling: SamplingParams,
                 sampling_seed: Optional[int] = None) -> tuple[list[Sample], list[Episode]]:
        """``EpisodeSource`` (rollout/episodes/source.py): ``run``'s episodes and their samples."""
        episodes = self.run(engine, prompts, n, sampling, sampling_seed)
        return [e.sample for e in episodes], episodes

    def close(self) -> None:
        """``EpisodeSource``: nothing outlives a call (each episode's environment worker ends with
        its episode; the fork server is the process's)."""

    def run(self, engine, prompts: Sequence, n: int, sampling: SamplingParams,
            sampling_seed: Optional[int] = None) -> list[Episode]:
        """``n`` episodes per prompt (data.Prompt: ``prompt_ids``, ``text``, ``answer``, ``fields``)
        on ``engine`` (a RolloutEngine), prompt-major, like ``engine.generate``."""
        jobs = episode_jobs(prompts, n)
        guard = HangGuard(f"episodes.environment {self.spec}", self.cfg.deadline_s, self.cfg.max_timeout_fraction)
        with ThreadPoolExecutor(max_workers=min(self.max_inflight, len(jobs)) or 1,
                                thread_name_prefix="episode") as pool:
            results = asyncio.run(self._run_all(engine, jobs, sampling, sampling_seed, pool, guard))
        guard.check()
        raise_failures(results, EnvContractError)
        return results

    async def _run_all(self, engine, jobs, sampling, sampling_seed, pool, guard: HangGuard) -> list:
        limit = asyncio.Semaphore(self.max_inflight)

        async def bounded(job):
            async with limit:
                guard.begin()
                return await self._episode(engine, *job, sampling, sampling_seed, pool, guard)

        return await asyncio.gather(*(bounded(job) for job in jobs), return_exceptions=True)

    async def _episode(self, engine, index: int, prompt_index: int, sample_index: int, prompt, sampling: SamplingParams,
                       sampling_seed: Optional[int], pool, guard: HangGuard) -> Episode:
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        row = {**prompt.fields, "prompt": prompt.text, "answer": prompt.answer}
        context = list(prompt.prompt_ids)
        budget = episode_budget(cfg.max_episode_tokens, self.model_context, len(context))
        out_ids: list[int] = []
        out_lps: list[float] = []
        mask: list[int] = []
        kept: list[Optional[list[int]]] = []  # sampling-mask replay: the engine's kept sets
        masses: list[float] = []
        versions: list[str] = []
        token_versions: list[Optional[str]] = []  # per output token (None: observation, or not reported)
        server, finish, error, env_reward, turns, cut = "", "stop", None, 0.0, 0, 0
        counts: dict[str, int] = {}
        env_s = gen_s = 0.0
        env: Optional[EnvProcess] = None
        pids: list[int] = []  # the worker, once it exists (the guard may kill it while it starts)

        def started(pid: int) -> None:
            pids.append(pid)
            guard.watch(pid)

        t0 = time.monotonic()
        try:
            env = await loop.run_in_executor(pool, EnvProcess, self.spec, row, cfg.deadline_s, self.env_options,
                                             started)
            env_s += time.monotonic() - t0
            while True:
                guard.check()
                left = budget - len(out_ids)
                turn_sampling = dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, left))
                seed = None if sampling_seed is None else (sampling_seed + index * cfg.max_turns + turns) % _SEED_MODULUS
                t0 = time.monotonic()
                (s,) = await loop.run_in_executor(pool, lambda: engine.generate([list(context)], 1, turn_sampling,
                                                                                 sampling_seed=seed))
                gen_s += time.monotonic() - t0
                turns += 1
                out_ids += s.output_ids
                out_lps += s.output_logprobs
                mask += [1] * len(s.output_ids)
                token_versions += s.output_versions or [None] * len(s.output_ids)
                if s.kept_ids is not None:
                    kept += s.kept_ids
                    masses += s.log_kept_mass
                context += s.output_ids
                versions.append(s.weight_version)
                server, finish = s.server, s.finish_reason
                if finish == "abort":
                    break
                text = self.tokenizer.decode(s.output_ids, skip_special_tokens=True)
                # an observation may use what is left less one model token; a longer text cannot
                # fit, and is cut before the template and the tokenizer see it (bounded memory)
                limit = self.renderer.observation_char_limit(budget - len(out_ids) - 1)
                guard.check()
                t0 = time.monotonic()
                answer = await loop.run_in_executor(pool, env.step, text, limit)
                env_s += time.monotonic() - t0
                env_reward += answer["reward"]
                for name, n in answer.get("counts", {}).items():
                    counts[name] = counts.get(name, 0) + n
                if answer["done"] or answer["observation"] is None or turns >= cfg.max_turns:
                    break
                observation = answer["observation"]
                if len(observation) > limit:
                    observation, cut = observation[:limit], cut + 1
                obs = self.renderer.observation_ids(s.output_ids, observation)
                if len(out_ids) + len(obs) >= budget:  # no room for another model token
                    finish = "length"
                    break
                out_ids += obs
                out_lps += [0.0] * len(obs)
                mask += [0] * len(obs)
                token_versions += [None] * len(obs)
                kept += [None] * len(obs)  # context: no set, no mass
                masses += [0.0] * len(obs)
                context += obs
        except EnvCallError as e:
            env_s += time.monotonic() - t0
            error = e.kind
            guard.failed(e.kind)
            self._report(e.kind, e.where, e.message)
        except ObservationError as e:
            error = "observation"
            self._report("observation", self.spec, str(e))
        finally:
            for pid in pids:  # before the worker is reaped: the guard never kills a reused pid
                guard.forget(pid)
            if env is not None:
                await loop.run_in_executor(pool, env.close)
        sample = Sample(prompt_index=prompt_index, sample_index=sample_index,
                        prompt_ids=list(prompt.prompt_ids), output_ids=out_ids,
                        output_logprobs=out_lps, finish_reason=finish,
                        weight_version=_oldest(versions), server=server, output_mask=mask,
                        output_versions=token_versions if any(v is not None for v in token_versions) else None,
                        kept_ids=kept if sampling.sampling_mask_max_kept > 0 else None,
                        log_kept_mass=masses if sampling.sampling_mask_max_kept > 0 else None)
        return Episode(sample=sample, num_turns=turns, env_reward=env_reward, error=error, env_s=env_s,
                       generate_s=gen_s, observations_cut=cut, tool_call_errors=counts.pop("tool_call_errors", 0),
                       counts=counts)

    def _report(self, kind: str, where: str, message: str) -> None:
        report_failure_once(self._reported, "episodes.environment", kind, where, message, self.cfg.on_env_error)


def _oldest(versions: list[str]) -> str:
    """The oldest weight version that sampled any turn (as ``engine_weight_version`` reads them)."""
    if versions and all(str(v).isdigit() for v in versions):
        return str(min(int(v) for v in versions))
    return versions[0] if versions else ""
