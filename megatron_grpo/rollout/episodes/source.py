"""The one protocol of every producer of episodes, and the one place that picks the run's.

A step asks an ``EpisodeSource`` for ``n`` episodes of each prompt at the run's sampling
settings, and closes it when the run ends; it never asks which kind it holds. Three implement
it, one per ``episodes.kind`` (each runs ``episodes.source``):

* ``EpisodeRunner`` (``environment``, rollout/episodes/environment/loop.py): the built-in loop, an
  environment in its own worker process per episode;
* ``AgentRunner`` (``agent``, rollout/episodes/agent/runner.py): the user's agent against an
  OpenAI-compatible front on loopback, trained on the exact tokens of its calls;
* ``RolloutFunction`` (``function``, rollout/episodes/function/source.py): the user's
  function in its worker process, its output checked on every call.

Without a kind a step's responses are the engine's own ``generate`` (single-turn).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from megatron_grpo.config.episodes import EpisodesConfig
from megatron_grpo.rollout.episodes.agent.runner import AgentRunner
from megatron_grpo.rollout.episodes.environment.loop import EpisodeRunner
from megatron_grpo.rollout.episodes.episode import Episode
from megatron_grpo.rollout.episodes.function.source import RolloutFunction
from megatron_grpo.wire.samples import Sample, SamplingParams

EpisodeOutput = tuple[list[Sample], Optional[list[Episode]]]
"""``n`` samples per prompt, prompt-major (what is scored and trained), and the episodes they
close when the source runs multi-turn episodes (their turns, tool calls and failures; None for a
rollout function that returns bare samples)."""


@runtime_checkable
class EpisodeSource(Protocol):
    """What a step asks of any producer of episodes (rank 0's; the engine is the run's)."""

    def episodes(self, engine: Any, prompts: Sequence, n: int, sampling: SamplingParams,
                 sampling_seed: Optional[int] = None) -> EpisodeOutput:
        """``n`` episodes of each prompt (data.Prompt) on ``engine`` at ``sampling``; the sampler
        seeds start at ``sampling_seed`` (a resumed run replays the same)."""

    def close(self) -> None:
        """Release what the source holds between steps (worker processes, a server); idempotent."""


def build_episode_source(episodes_cfg: EpisodesConfig, tokenizer, *, max_inflight: int, use_template: bool,
                         vocab_size: Optional[int] = None, model_context: Optional[int] = None
                         ) -> Optional[EpisodeSource]:
    """The run's source, by ``episodes.kind``; None: single-turn.
    Built before the engine starts, so a bad environment, agent or function fails fast with one
    line. ``max_inflight``: the engine's requests in flight (an environment's episodes at once
unless ``episodes.concurrency``); ``use_template``: render turns with the
    tokenizer's chat template; ``vocab_size``: the bound of a rollout function's token ids;
    ``model_context``: the model's context length (an episode's budget when
    ``episodes.max_episode_tokens`` is null)."""
    if episodes_cfg.kind == "environment":
        return EpisodeRunner.build(episodes_cfg, tokenizer, max_inflight=episodes_cfg.episodes_at_once(max_inflight),
                                   use_template=use_template, model_context=model_context)
    if episodes_cfg.kind == "agent":
        return AgentRunner.build(episodes_cfg, tokenizer, max_inflight=max_inflight, use_template=use_template,
                                 model_context=model_context)
    if episodes_cfg.kind == "function":
        return RolloutFunction.load(episodes_cfg.source, tokenizer, vocab_size=vocab_size,
                                    timeout_s=episodes_cfg.deadline_s)
    return None
