"""The rollout engine as the trainer sees it: one protocol, whatever the engine.

The trainer (``rollout/supervisor.py``, ``trainer/trainer.py``) talks only to a
``RolloutEngine``: it never reads server URLs, launch commands or HTTP routes, and never asks
which engine it has. Every trainer rank holds one, because receiving weights is collective
over all of them; the other verbs are rank 0's (the rank that owns generation):

    generate(prompts, n, sampling, ...)   token ids in, tokens + the engine's log-probs out
    receive_weights(modules, step)        the weight sync, its transport and verification inside
    forget_weights()                      after a restart: the engine serves its initial weights
    release_memory() / resume_memory()    give the accelerator back while the trainer trains
    abort_generation()                    end the requests in flight (async rollouts' end)
    restart_if_dead()                     health: restart what died (when this run launched it)
    close()

``generation/http_engine.py`` is the implementation for engines behind SGLang's HTTP API (the
embedded engine and SGLang itself). An engine that is not one HTTP call per batch (in-process,
multi-turn, asynchronous) implements the same verbs.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from megatron_grpo.wire.samples import Sample, SamplingParams


class WeightReceiver(Protocol):
    """The collective weight sync into the engines (``sync.driver.WeightSync``)."""

    def sync(self, model_chunks: list, step: int) -> Any:
        """Make the engines serve ``model_chunks``' weights as version ``step``; returns its
        SyncStats. Collective over every trainer rank."""

    def reset(self) -> None:
        """Forget what the engines held (they restarted)."""

    def close(self) -> None: ...


class RolloutEngine(Protocol):
    """See the module docstring. Methods marked rank 0 raise elsewhere."""

    @property
    def restarts_itself(self) -> bool:
        """True when this run launched the engine and can restart it; False for an external
        engine (recovery then waits for it)."""

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams, *,
                 sampling_seed: Optional[int] = None, return_routed_experts: bool = False) -> list[Sample]:
        """Rank 0: ``n`` samples per prompt (token ids), prompt-major."""

    def receive_weights(self, model_chunks: list, step: int) -> Any:
        """Collective: serve ``model_chunks``' weights as version ``step`` (SyncStats)."""

    def forget_weights(self) -> None:
        """Collective: the engine restarted; the next ``receive_weights`` starts afresh."""

    def release_memory(self) -> None:
        """Rank 0: free the engine's accelerator memory (weights and KV cache)."""

    def resume_memory(self, tags: Optional[list[str]] = None) -> None:
        """Rank 0: take the memory back (``tags``: only these kinds, e.g. ["weights"])."""

    def abort_generation(self) -> None:
        """Rank 0: end the requests in flight (finish_reason abort); new ones are accepted."""

    def restart_if_dead(self) -> bool:
        """Rank 0: restart a dead engine this run launched; True if one was restarted."""

    def close(self) -> None:
        """Stop what this run started (every rank)."""
