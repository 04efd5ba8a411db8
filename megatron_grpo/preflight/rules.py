"""The config rules that need another package: what the engine kind can do (its adapter in
``generation/adapters``), colocation, where a remote engine connects back to, the reward
registry's names and MoE router replay. No machine facts here (see ``layout.py``)."""

from __future__ import annotations

from typing import Optional
from urllib.parse import urlsplit

from megatron_grpo.config.base import ConfigError
from megatron_grpo.config.engine import EngineConfig
from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.config.sections import RewardConfig
from megatron_grpo.config.sync import SyncConfig
from megatron_grpo.rewards.registry import name_problem
from megatron_grpo.generation.adapters import ENGINES, EngineAdapter
from megatron_grpo.runtime.placement import is_loopback


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def colocate_problem(cfg: ExperimentConfig, adapter: EngineAdapter,
                     cuda: Optional[bool] = None) -> Optional[tuple[str, str]]:
    """(dotted key, message) of the first ``engine.colocate`` rule the config breaks, or None.
    Every colocate rule is here: the transport, the mode, the engine's memory release and,
    when ``cuda`` is known (the run's pre-flight), the GPU."""
    if not cfg.engine.colocate:
        return None
    if cfg.sync.transport != "tensor":
        return ("engine.colocate", f"needs sync.transport: tensor (got {cfg.sync.transport!r}): "
                "a colocated engine receives CUDA IPC handles of the trainer's weights")
    if cfg.rollout.mode != "sync":
        return ("rollout.mode", f"{cfg.rollout.mode} needs the engine to generate while the trainer trains, so it "
                "cannot be combined with engine.colocate: true (the engine's GPU memory is released during "
                "training); set rollout.mode: sync or engine.colocate: false")
    if not adapter.supports_memory_release:
        return ("engine.colocate", f"engine.kind={adapter.name!r} cannot release its GPU memory between rollouts "
                "(use engine.kind: sglang)")
    if cuda is False:
        return "engine.colocate", "needs CUDA (the engine releases GPU memory); this machine has no usable GPU"
    return None


def remote_engine_problem(engine_cfg: EngineConfig, sync_cfg: SyncConfig) -> Optional[str]:
    """Why the engines in ``engine.urls`` cannot join the weight-update group, or None.

    With the distributed transport each engine connects to ``sync.master_address``; a
    loopback (or unset) address points an engine on another host at itself.
    """
    if sync_cfg.transport != "distributed" or not is_loopback(sync_cfg.master_address):
        return None
    for i, url in enumerate(engine_cfg.urls):
        if not is_loopback(urlsplit(url).hostname):
            return (f"is {sync_cfg.master_address or 'null (127.0.0.1)'} but engine.urls[{i}] = "
                    f"{url} is on another host, which would connect to itself; set it to an address of this "
                    "machine that the engine can reach")
    return None


def check_engine(cfg: ExperimentConfig) -> None:
    """The ``engine:`` and ``sync:`` sections and the sampling of ``rollout:`` against the engine
    kind's adapter (transports, process-group backends, memory release, kept sets) and the
    network; ConfigError naming the key."""
    engine_cfg, sync_cfg, rollout_cfg = cfg.engine, cfg.sync, cfg.rollout
    adapter = ENGINES[engine_cfg.kind]
    _check(not (adapter.in_process and engine_cfg.urls), "engine.urls",
           f"names servers, but engine.kind={adapter.name!r} runs inside the trainer (no server); "
           "set engine.urls: [] or name the servers' kind (embedded, sglang)")
    _check(not adapter.in_process or engine_cfg.num_servers == 1, "engine.num_servers",
           f"must be 1 with engine.kind={adapter.name!r} (one engine, in trainer rank 0's process); "
           f"got {engine_cfg.num_servers}: use engine.kind: embedded to scale out")
    colocate = colocate_problem(cfg, adapter)
    if colocate is not None:
        raise ConfigError(*colocate)
    problem = remote_engine_problem(engine_cfg, sync_cfg)
    _check(problem is None, "sync.master_address", problem or "")
    _check(sync_cfg.transport in adapter.transports, "sync.transport",
           f"{sync_cfg.transport!r} is not supported by engine.kind={adapter.name!r} "
           f"(supported: {', '.join(sorted(adapter.transports))})")
    _check(sync_cfg.backend in ("auto", *adapter.backends), "sync.backend",
           f"{sync_cfg.backend!r} is not accepted by engine.kind={adapter.name!r} "
           f"(accepted: auto, {', '.join(sorted(adapter.backends))})")
    _check(engine_cfg.quantization is None or engine_cfg.quantization in adapter.quantizations,
           "engine.quantization", f"{engine_cfg.quantization!r} is not served by engine.kind={adapter.name!r} "
           f"(supported: null, {', '.join(sorted(adapter.quantizations))})")
    _check(engine_cfg.quantization != "fp8" or engine_cfg.fp8_format in adapter.fp8_formats,
           "engine.fp8_format", f"{engine_cfg.fp8_format!r} is not served by engine.kind={adapter.name!r} "
           f"(supported: {', '.join(sorted(adapter.fp8_formats))})")
    # Without per-token versions a sequence that spans a sync would carry log-probs of two
    # policies under one label.
    _check(rollout_cfg.mode != "async" or adapter.reports_token_versions, "rollout.mode",
           f"async needs per-token weight versions, which engine.kind={adapter.name!r} does not report; "
           "use rollout.mode: one_step_off_policy, or engine.kind: embedded or sglang")
    # An engine without kept sets, trained with truncation and replay on, would score a
    # distribution it never sent.
    replay = rollout_cfg.truncates and rollout_cfg.sampling_mask_replay
    _check(not replay or adapter.reports_sampling_mask,
           "rollout.sampling_mask_replay",
           f"is on and rollout.top_p/top_k/min_p truncate sampling, but engine.kind={adapter.name!r} does not "
           "report the tokens each draw could pick; set rollout.sampling_mask_replay: false (both sides then score "
           "the full distribution, which the engine did not sample from), or use engine.kind: embedded")
    # SGLang reports a draw's support only when top_k bounds its size (it refuses the request otherwise).
    _check(not (replay and adapter.sampling_mask_needs_top_k)
           or 1 < rollout_cfg.top_k <= rollout_cfg.sampling_mask_max_kept, "rollout.top_k",
           f"is {rollout_cfg.top_k}, but engine.kind={adapter.name!r} replays the sampling mask only with "
           f"1 < top_k <= rollout.sampling_mask_max_kept ({rollout_cfg.sampling_mask_max_kept}): set top_k "
           "(a bound top_p rarely reaches, e.g. 50 or 100, leaving headroom for ties at the cut) or "
           "rollout.sampling_mask_replay: false")


def check_reward(reward_cfg: RewardConfig) -> None:
    """Every ``reward.functions[i].name`` is one the registry can resolve (by its shape: dotted
    and file paths are imported when the trainer builds its RewardScorer, before step 1)."""
    for i, fn_cfg in enumerate(reward_cfg.functions):
        problem = name_problem(fn_cfg.name)
        _check(problem is None, f"reward.functions[{i}].name", problem or "")


def check_request_bounds(cfg: ExperimentConfig) -> None:
    """A launched embedded engine accepts every /generate the run sends: one request per prompt
    with rollout.num_generations (or an eval set's n) sequences, each at most
    data.max_prompt_length + rollout.max_new_tokens tokens (engine.embedded.max_request_*)."""
    if cfg.engine.kind != "embedded" or cfg.engine.urls:
        return
    bounds = cfg.engine.embedded
    for key, n in [("rollout.num_generations", cfg.rollout.num_generations),
                   *((f"eval.sets[{i}].n", s.n) for i, s in enumerate(cfg.eval.sets))]:
        _check(n <= bounds.max_request_sequences, key,
               f"{n} exceeds engine.embedded.max_request_sequences = {bounds.max_request_sequences} (the most "
               "sequences the launched engine accepts in one request); raise that bound")
    tokens = cfg.rollout.num_generations * (cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
    _check(tokens <= bounds.max_request_tokens, "engine.embedded.max_request_tokens",
           f"{bounds.max_request_tokens} is below the {tokens} tokens one rollout request may hold "
           "(num_generations x (data.max_prompt_length + max_new_tokens)); raise it")


def check_experiment(cfg: ExperimentConfig) -> None:
    """Every rule above on a built experiment config, plus MoE router replay against the
    engine. SGLang's return_routed_experts (its PR 12162) is not verified here, so it is refused."""
    check_engine(cfg)
    check_reward(cfg.reward)
    check_request_bounds(cfg)
    if cfg.algorithm.router_replay:
        _check(ENGINES[cfg.engine.kind].returns_routing, "algorithm.router_replay",
               f"needs an engine that returns its MoE routing; engine.kind={cfg.engine.kind!r} "
               "does not here (use engine.kind: embedded)")
