"""``HttpEngine``: the ``RolloutEngine`` of engines behind SGLang's HTTP API (the embedded
engine and SGLang), one or several servers.

Rank 0 holds the server manager (launch, health, restart) and the client (generation, the
adapter's memory routes); every rank holds the weight receiver (the collective weight sync,
given by the caller so that this layer does not depend on ``sync/``). URLs, launch commands
and routes stay in here and in the engine's adapter (``generation/adapters``).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any, Optional, Sequence

from megatron_grpo.config.engine import EngineConfig
from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.generation.client import RolloutClient
from megatron_grpo.generation.manager import RolloutServerManager
from megatron_grpo.generation.protocol import WeightReceiver
from megatron_grpo.runtime.collectives import broadcast
from megatron_grpo.wire.samples import RolloutError, Sample, SamplingParams


def run_api_key(engine_cfg: EngineConfig) -> Optional[str]:
    """The key the run's rollout servers enforce: ``engine.api_key`` when set; else, for
    servers this run launches, a fresh random one, so no other local user or process can drive
    them (generate, load weights, join the weight-update group); None for external servers
    (``engine.urls``) that were given none."""
    if engine_cfg.api_key or engine_cfg.urls:
        return engine_cfg.api_key
    # hex, 256 bits: SGLang turns its --config file into arguments, and a key starting with "-"
    # (1 in 64 of token_urlsafe's) is read as an option, failing the launch ("--api-key:
    # expected one argument"; seen in CI)
    return secrets.token_hex(32)


def with_api_key(cfg: ExperimentConfig, api_key: Optional[str]) -> ExperimentConfig:
    """``cfg`` with ``engine.api_key`` set to ``api_key`` (the run's key, ``run_api_key``)."""
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, api_key=api_key))


def start_servers(cfg: ExperimentConfig, *, model_dir: str, run_dir: str,
                  spawned: Optional[RolloutServerManager] = None) -> tuple[RolloutServerManager, RolloutClient]:
    """Launch the servers of ``cfg.engine``, or wait for the external ones in ``engine.urls``,
    until healthy; returns their manager and a client of them. Launched servers without a
    configured key get a per-run one (``run_api_key``). ``spawned``: the servers
    ``HttpEngine.spawn`` already started (their key is the one ``cfg.engine`` must carry)."""
    if spawned is None:
        spawned = RolloutServerManager(with_api_key(cfg, run_api_key(cfg.engine)), model_dir=model_dir,
                                       run_dir=run_dir)
    elif spawned.engine_cfg.api_key != cfg.engine.api_key:
        raise ValueError("start_servers: cfg.engine must carry the spawned servers' API key")
    urls = spawned.start()
    per_request = spawned.adapter.sequences_per_request(spawned.engine_cfg)
    return spawned, RolloutClient.from_config(
        spawned.engine_cfg, urls, sequences_per_request=per_request,
        mask_budget_per_request=spawned.adapter.sampling_mask_budget_per_request)


class HttpEngine:
    """A ``RolloutEngine`` over HTTP servers. ``manager`` and ``client``: rank 0's (None
    elsewhere); ``receiver``: every rank's weight sync into those servers (None: the engine
    serves fixed weights, e.g. when evaluating a saved model); ``urls`` and ``api_key``: the
    servers' and the run's key, on every rank (what the weight sync needs)."""

    def __init__(self, manager: Optional[RolloutServerManager], client: Optional[RolloutClient],
                 receiver: Optional[WeightReceiver], *, urls: Sequence[str] = (), api_key: Optional[str] = None):
        self.manager = manager
        self.client = client
        self.receiver = receiver
        self.urls = list(urls)
        self.api_key = api_key

    @classmethod
    def spawn(cls, cfg: ExperimentConfig) -> Optional[RolloutServerManager]:
        """Start the processes of the servers a run launches (with their per-run key) without
        waiting for them; None when there is nothing to start early: external servers,
        colocated engines (they must start after the trainer took its share of the GPU), or a
        spawn that failed (``start`` then tries again where the run reports its errors).
        Measured on the CPU demo (TP2, 2 cores): the embedded server takes 8-11 s to become
        healthy (torch and transformers' imports), which otherwise follows the ranks' imports
        and model build instead of overlapping them."""
        engine_cfg = cfg.engine
        if engine_cfg.urls or engine_cfg.colocate:
            return None
        manager = RolloutServerManager(with_api_key(cfg, run_api_key(engine_cfg)), model_dir=cfg.model.hf_dir,
                                       run_dir=cfg.trainer.run_dir)
        try:
            manager.spawn()
        except RolloutError:
            return None
        return manager

    @classmethod
    def start(cls, cfg: ExperimentConfig, *, owner: bool = True,
              spawned: Optional[RolloutServerManager] = None) -> "HttpEngine":
        """Collective: rank 0 (``owner``) starts (or connects to) the servers of ``cfg.engine``
        and every rank learns their URLs and the run's key; no weight sync yet (``receiver``).
        ``spawned``: rank 0's servers already started (``spawn``)."""
        # the per-run key of launched servers (run_api_key) lives only in the engine and its
        # sync, never in the trainer's cfg, so neither the saved nor the logged config holds it
        key = (spawned.engine_cfg.api_key if spawned is not None else run_api_key(cfg.engine)) if owner else None
        keyed = with_api_key(cfg, broadcast(key))
        manager = client = None
        if owner:
            manager, client = start_servers(keyed, model_dir=cfg.model.hf_dir, run_dir=cfg.trainer.run_dir,
                                            spawned=spawned)
        urls = broadcast(manager.urls if owner else None)
        return cls(manager, client, None, urls=urls, api_key=keyed.engine.api_key)

    @property
    def restarts_itself(self) -> bool:
        return self.manager is not None and self.manager.launched

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams, *,
                 sampling_seed: Optional[int] = None, return_routed_experts: bool = False) -> list[Sample]:
        return self.client.generate(prompts, n, sampling, sampling_seed=sampling_seed,
                                    return_routed_experts=return_routed_experts)

    def receive_weights(self, model_chunks: list, step: int) -> Any:
        return self.receiver.sync(model_chunks, step)

    def forget_weights(self) -> None:
        self.receiver.reset()

    def release_memory(self) -> None:
        for url in self.manager.urls:
            self.manager.adapter.release_memory(self.client, url)

    def resume_memory(self, tags: Optional[list[str]] = None) -> None:
        for url in self.manager.urls:
            self.manager.adapter.resume_memory(self.client, url, tags)

    def abort_generation(self) -> None:
        """Rank 0: end every request in flight (answered with finish_reason abort); the engine
        then takes requests again. Used to stop async rollouts at the end of a run."""
        for url in self.manager.urls:
            self.client.pause_generation(url, mode="abort")
            self.client.continue_generation(url)

    def restart_if_dead(self) -> bool:
        return self.manager.ensure_alive()

    def close(self) -> None:
        """The receiver first (it may hold a group with the servers), then rank 0's client and servers."""
        if self.receiver is not None:
            self.receiver.close()
        if self.client is not None:
            self.client.close()
        if self.manager is not None:
            self.manager.stop()
