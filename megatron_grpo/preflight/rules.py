"""The config rules that need another package: what the engine kind can do (its adapter in
``rollout/engines``), colocation, where a remote engine connects back to, the reward
registry's names and MoE router replay. No machine facts here (see ``layout.py``)."""

from __future__ import annotations

from typing import Optional
from urllib.parse import urlsplit

from megatron_grpo.config.base import ConfigError
from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.config.rollout import RolloutConfig
from megatron_grpo.config.sections import RewardConfig
from megatron_grpo.rewards.registry import name_problem
from megatron_grpo.generation.engines import ENGINES, EngineAdapter
from megatron_grpo.runtime.placement import is_loopback


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def colocate_problem(rollout_cfg: RolloutConfig, adapter: EngineAdapter,
                     cuda: Optional[bool] = None) -> Optional[tuple[str, str]]:
    """(dotted key, message) of the first ``rollout.colocate`` rule the config breaks, or None.
    Every colocate rule is here: the transport, the mode, the engine's memory release and,
    when ``cuda`` is known (the run's pre-flight), the GPU."""
    if not rollout_cfg.colocate:
        return None
    if rollout_cfg.weight_sync_transport != "tensor":
        return ("rollout.colocate", f"needs weight_sync_transport: tensor (got {rollout_cfg.weight_sync_transport!r}): "
                "a colocated engine receives CUDA IPC handles of the trainer's weights")
    if rollout_cfg.mode != "sync":
        return ("rollout.mode", f"{rollout_cfg.mode} needs the engine to generate while the trainer trains, so it "
                "cannot be combined with rollout.colocate: true (the engine's GPU memory is released during "
                "training); set rollout.mode: sync or rollout.colocate: false")
    if not adapter.supports_memory_release:
        return ("rollout.colocate", f"rollout.engine={adapter.name!r} cannot release its GPU memory between rollouts "
                "(use rollout.engine: sglang)")
    if cuda is False:
        return "rollout.colocate", "needs CUDA (the engine releases GPU memory); this machine has no usable GPU"
    return None


def remote_engine_problem(rollout_cfg: RolloutConfig) -> Optional[str]:
    """Why the engines in ``rollout.urls`` cannot join the weight-update group, or None.

    With the distributed transport each engine connects to ``weight_sync_master_address``;
    a loopback (or unset) address points an engine on another host at itself.
    """
    if rollout_cfg.weight_sync_transport != "distributed" or not is_loopback(rollout_cfg.weight_sync_master_address):
        return None
    for i, url in enumerate(rollout_cfg.urls):
        if not is_loopback(urlsplit(url).hostname):
            return (f"is {rollout_cfg.weight_sync_master_address or 'null (127.0.0.1)'} but rollout.urls[{i}] = "
                    f"{url} is on another host, which would connect to itself; set it to an address of this "
                    "machine that the engine can reach")
    return None


def check_rollout(rollout_cfg: RolloutConfig) -> None:
    """The ``rollout:`` section against its engine kind's adapter (transports, process-group
    backends, memory release) and the network; ConfigError naming the ``rollout.`` key."""
    adapter = ENGINES[rollout_cfg.engine]
    _check(not (adapter.in_process and rollout_cfg.urls), "rollout.urls",
           f"names servers, but rollout.engine={adapter.name!r} runs inside the trainer (no server); "
           "set rollout.urls: [] or name the servers' kind (embedded, sglang)")
    _check(not adapter.in_process or rollout_cfg.num_servers == 1, "rollout.num_servers",
           f"must be 1 with rollout.engine={adapter.name!r} (one engine, in trainer rank 0's process); "
           f"got {rollout_cfg.num_servers}: use rollout.engine: embedded to scale out")
    colocate = colocate_problem(rollout_cfg, adapter)
    if colocate is not None:
        raise ConfigError(*colocate)
    problem = remote_engine_problem(rollout_cfg)
    _check(problem is None, "rollout.weight_sync_master_address", problem or "")
    _check(rollout_cfg.weight_sync_transport in adapter.transports, "rollout.weight_sync_transport",
           f"{rollout_cfg.weight_sync_transport!r} is not supported by rollout.engine={adapter.name!r} "
           f"(supported: {', '.join(sorted(adapter.transports))})")
    _check(rollout_cfg.weight_sync_backend in ("auto", *adapter.backends), "rollout.weight_sync_backend",
           f"{rollout_cfg.weight_sync_backend!r} is not accepted by rollout.engine={adapter.name!r} "
           f"(accepted: auto, {', '.join(sorted(adapter.backends))})")
    _check(rollout_cfg.quantization is None or rollout_cfg.quantization in adapter.quantizations,
           "rollout.quantization", f"{rollout_cfg.quantization!r} is not served by rollout.engine={adapter.name!r} "
           f"(supported: null, {', '.join(sorted(adapter.quantizations))})")
    _check(rollout_cfg.quantization != "fp8" or rollout_cfg.fp8_format in adapter.fp8_formats,
           "rollout.fp8_format", f"{rollout_cfg.fp8_format!r} is not served by rollout.engine={adapter.name!r} "
           f"(supported: {', '.join(sorted(adapter.fp8_formats))})")
    # Without per-token versions a sequence that spans a sync would carry log-probs of two
    # policies under one label.
    _check(rollout_cfg.mode != "async" or adapter.reports_token_versions, "rollout.mode",
           f"async needs per-token weight versions, which rollout.engine={adapter.name!r} does not report; "
           "use rollout.mode: one_step_off_policy, or rollout.engine: embedded or sglang")
    # An engine without kept sets, trained with truncation and replay on, would score a
    # distribution it never sent.
    replay = rollout_cfg.truncates and rollout_cfg.sampling_mask_replay
    _check(not replay or adapter.reports_sampling_mask,
           "rollout.sampling_mask_replay",
           f"is on and rollout.top_p/top_k/min_p truncate sampling, but rollout.engine={adapter.name!r} does not "
           "report the tokens each draw could pick; set rollout.sampling_mask_replay: false (both sides then score "
           "the full distribution, which the engine did not sample from), or use rollout.engine: embedded")
    # SGLang reports a draw's support only when top_k bounds its size (it refuses the request otherwise).
    _check(not (replay and adapter.sampling_mask_needs_top_k)
           or 1 < rollout_cfg.top_k <= rollout_cfg.sampling_mask_max_kept, "rollout.top_k",
           f"is {rollout_cfg.top_k}, but rollout.engine={adapter.name!r} replays the sampling mask only with "
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
    data.max_prompt_length + rollout.max_new_tokens tokens (rollout.embedded.max_request_*)."""
    if cfg.rollout.engine != "embedded" or cfg.rollout.urls:
        return
    bounds = cfg.rollout.embedded
    for key, n in [("rollout.num_generations", cfg.rollout.num_generations),
                   *((f"eval.sets[{i}].n", s.n) for i, s in enumerate(cfg.eval.sets))]:
        _check(n <= bounds.max_request_sequences, key,
               f"{n} exceeds rollout.embedded.max_request_sequences = {bounds.max_request_sequences} (the most "
               "sequences the launched engine accepts in one request); raise that bound")
    tokens = cfg.rollout.num_generations * (cfg.data.max_prompt_length + cfg.rollout.max_new_tokens)
    _check(tokens <= bounds.max_request_tokens, "rollout.embedded.max_request_tokens",
           f"{bounds.max_request_tokens} is below the {tokens} tokens one rollout request may hold "
           "(num_generations x (data.max_prompt_length + max_new_tokens)); raise it")


def check_experiment(cfg: ExperimentConfig) -> None:
    """Every rule above on a built experiment config, plus MoE router replay against the
    engine. SGLang's return_routed_experts (its PR 12162) is not verified here, so it is refused."""
    check_rollout(cfg.rollout)
    check_reward(cfg.reward)
    check_request_bounds(cfg)
    if cfg.algorithm.router_replay:
        _check(ENGINES[cfg.rollout.engine].returns_routing, "algorithm.router_replay",
               f"needs an engine that returns its MoE routing; rollout.engine={cfg.rollout.engine!r} "
               "does not here (use rollout.engine: embedded)")
