"""`rollout:` section: the generation engine, sampling, and the per-step weight sync."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from megatron_grpo.config.base import check
from megatron_grpo.config.dapo import DynamicSamplingConfig, OverlongConfig
from megatron_grpo.config.env_connectors import connector_problem, split_connector_spec


@dataclass(kw_only=True)
class SGLangConfig:
    """`rollout.sglang:` settings of launched SGLang servers (rollout.engine: sglang)."""

    python: Optional[str] = None
    """Interpreter that runs `python -m sglang.launch_server`. null: this interpreter if it can
    import sglang, else the environment built by `bash launch/setup_sglang_cpu.sh`
    ($MEGATRON_GRPO_SGLANG_VENV or ~/.cache/megatron-grpo/sglang-cpu)."""

    tp: int = 1
    """Tensor-parallel size of each launched SGLang server (--tp-size)."""

    mem_fraction_static: float = 0.8
    """SGLang --mem-fraction-static of a launched server."""

    extra_args: list[str] = field(default_factory=list)
    """Extra command-line arguments for `sglang.launch_server` (after the ones the trainer sets;
    on a machine without CUDA the CPU flags are added first)."""

    def __post_init__(self):
        check(self.tp >= 1, "tp", f"must be >= 1, got {self.tp}")
        check(0 < self.mem_fraction_static <= 1, "mem_fraction_static",
              f"must be in (0, 1], got {self.mem_fraction_static}")


@dataclass(kw_only=True)
class EmbeddedConfig:
    """`rollout.embedded:` settings of the launched embedded engine (rollout.engine: embedded)."""

    max_batch_size: int = 64
    """Rows of the embedded engine's running decode batch; queued sequences join it as rows
    finish (continuous batching)."""

    max_request_sequences: int = 256
    """Most sequences (inputs times n) the launched engine accepts in one /generate request; more
    is a 413 (a bound on the work one request can queue). The trainer asks for
    rollout.num_generations per request and an eval set's n: both must fit (checked at pre-flight)."""

    max_request_tokens: int = 1048576
    """Most tokens one /generate request may put in flight on the launched engine: per sequence
    its prompt tokens plus max_new_tokens; more is a 413."""

    max_request_mb: int = 16
    """Largest request body (MiB) the launched engine reads; a larger one is a 413."""

    def __post_init__(self):
        for key in ("max_batch_size", "max_request_sequences", "max_request_tokens", "max_request_mb"):
            check(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")


BUILTIN_ENVIRONMENTS = ("calculator", "guess_number")
"""Names of the built-in environments (``rollout/environments/builtin.py``)."""

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


@dataclass(kw_only=True)
class MultiTurnConfig:
    """`rollout.multi_turn:` episodes of a `rollout.environment` (docs/multi_turn.md)."""

    observation_role: Literal["tool", "user"] = "tool"
    """Chat role of an observation turn, rendered by the tokenizer's chat template (not guessed
    from the template: a template that does not know the role renders it as something else)."""

    observation_formatter: Optional[str] = None
    """`path/to/file.py:fn` with fn(observation: str, tokenizer) -> list[int]: the token ids that
    follow a model turn, instead of the chat template's delta render (for templates that rewrite
    earlier turns). null: the template's delta render."""

    max_turns: int = 4
    """Model turns per episode; the episode ends after the environment's answer to the last one."""

    max_episode_tokens: int = 512
    """Token budget of an episode after the prompt (model and observation tokens): a model turn
    gets at most what is left (finish_reason length when cut), an observation that does not fit
    with at least one more model token ends the episode."""

    env_timeout_s: float = 30.0
    """Deadline of one environment call (construction or step); a call past it is killed with
    its worker process and the episode ends as an environment error."""

    on_env_error: Literal["zero_reward", "drop"] = "zero_reward"
    """An episode whose environment raised, timed out or sent an observation with unknown tokens:
    zero_reward: its reward is 0; drop: it trains nothing (loss mask 0) and its reward is its
    group's mean over the other episodes (so the group mean is unchanged)."""

    env_reward: Literal["add", "replace"] = "add"
    """How the environment's reward (the sum of its per-step rewards) combines with the reward
    functions' score: added to it, or replacing it."""

    def __post_init__(self):
        check(self.max_turns >= 1, "max_turns", f"must be >= 1, got {self.max_turns}")
        check(self.max_episode_tokens >= 1, "max_episode_tokens", f"must be >= 1, got {self.max_episode_tokens}")
        check(self.env_timeout_s > 0, "env_timeout_s", f"must be > 0, got {self.env_timeout_s}")
        f = self.observation_formatter
        check(f is None or ENVIRONMENT_FILE_RE.match(f) is not None, "observation_formatter",
              f"must be a file path path/to/file.py:fn or null, got {f!r}")


@dataclass(kw_only=True)
class RolloutConfig:
    engine: Literal["embedded", "sglang", "inprocess"] = "embedded"
    """The kind of rollout server: embedded (the package's own HTTP engine, transformers) or
    sglang. Launched by the trainer unless `urls` is set; with `urls` it names the kind of the
    servers there (checked when the run starts). inprocess: the embedded engine's generation
    code inside trainer rank 0's process, no server (single machine; the weight sync is an
    in-memory copy and the weight_sync_transport/backend keys are not used;
    docs/rollout_engines.md)."""

    urls: list[str] = field(default_factory=list)
    """Servers started elsewhere (http://host:port); used round-robin instead of launching any."""

    num_servers: int = 1
    """Servers the trainer launches (rollout data parallelism): requests are spread over them
    and every one receives every weight update. Ignored when `urls` is set."""

    host: str = "127.0.0.1"
    """Address a launched server binds to. Anything but loopback exposes it to the network."""

    port: Optional[int] = None
    """Port of a launched server; null picks a free one."""

    api_key: Optional[str] = None
    """API key sent to (and, for launched servers, enforced by) the engine."""

    num_generations: int = 8
    """Responses sampled per prompt (the GRPO group size)."""

    prompts_per_step: int = 4
    """Prompts per rollout batch; the batch holds prompts_per_step * num_generations sequences."""

    max_new_tokens: int = 64
    """Maximum response length in tokens."""

    temperature: float = 1.0
    """Sampling temperature; the trainer scores log_softmax(logits / temperature) to match."""

    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""

    top_k: int = -1
    """Top-k sampling (-1 = off)."""

    min_p: float = 0.0
    """Min-p sampling: tokens below min_p times the most likely token's probability are cut (0 = off)."""

    sampling_mask_replay: bool = True
    """With truncated sampling (top_p < 1, top_k > 0 or min_p > 0): the engine reports the set of
    tokens each draw could pick and the trainer scores the same renormalised, truncated
    distribution (the log-probs, ratios, KL and entropy of the policy that generated the data;
    docs/loss_spec.md). false: both sides report the full distribution (the ratios are then
    computed against a distribution the engine did not sample from). SGLang reports its sets
    only with 1 < top_k <= sampling_mask_max_kept (docs/off_policy.md)."""

    sampling_mask_max_kept: int = 1024
    """Most kept-set ids the engine sends per sampled token. Embedded engine: a larger set is not
    sent and that token is scored on the full distribution (counted in
    rollout/sampling_mask_unsent_frac). SGLang: its --sampling-mask-max-tokens; a larger support
    aborts the request."""

    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a response (the tokenizer's EOS always does)."""

    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """Settings of launched SGLang servers."""

    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)
    """Settings of the launched embedded engine."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter and compute dtype of a launched server, SGLang or embedded (`--dtype`; auto:
    the checkpoint's). It may differ from the trainer's model.dtype (a bf16 trainer's fp32 main
    weights are cast once to it in the weight sync); any difference shows as a train/rollout
    log-prob mismatch (docs/off_policy.md)."""

    quantization: Optional[Literal["fp8", "int8"]] = None
    """Serve the decoder's attention and MLP projections quantized (docs/off_policy.md,
    "Quantized rollouts"): fp8: weights (one scale per output channel) and activations (one per
    token, dynamic) in 8-bit floating point, as SGLang's --quantization fp8 (passed to a launched
    SGLang; needs CUDA there); int8: weights only (embedded engine). The engine quantizes every
    weight update it receives; the trainer keeps training in its own dtype, so the difference
    shows as train/rollout log-prob mismatch. Embeddings, norms and lm_head stay unquantized.
    null: the engine serves the weights as sent."""

    fp8_format: Literal["e4m3", "e5m2"] = "e4m3"
    """Float8 format of quantization: fp8. e4m3 (3 mantissa bits, max 448) is what inference
    engines use; e5m2 (2 mantissa bits, max 57344; embedded engine only) roughly doubles the
    rounding error, for studying a larger mismatch."""

    max_restarts: int = 3
    """Times a launched server that died is restarted before the run stops with an error."""

    max_inflight_requests: int = 64
    """HTTP requests the client keeps in flight at once (over all servers)."""

    launch_timeout_s: float = 300.0
    """Deadline for a launched server to become healthy."""

    request_timeout_s: float = 600.0
    """Deadline for one HTTP request (a whole /generate batch)."""

    max_retries: int = 3
    """Attempts per request (with exponential back-off) before a clear error."""

    weight_sync_transport: Literal["distributed", "tensor", "disk"] = "distributed"
    """How new weights reach the engine each step: a process group broadcast, colocated
    tensors, or safetensors files + /update_weights_from_disk."""

    weight_sync_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend of the distributed transport. auto: what the engine kind supports
    on this machine (NCCL with CUDA where the engine accepts it, else gloo)."""

    weight_sync_master_address: Optional[str] = None
    """Address of trainer rank 0's machine that the weight-update group of the distributed
    transport listens on and the engines connect to. null: 127.0.0.1, which only an engine on
    the same machine can reach: set it (an address of this machine the engines can reach)
    when rollout.urls names engines on other hosts."""

    base_gpu_id: Optional[int] = None
    """First CUDA device (an index among the devices the trainer sees) of the launched
    engines: server i uses the rollout.sglang.tp (SGLang) or 1 (embedded) devices from
    base_gpu_id + i * that count (SGLang --base-gpu-id). null: right after the trainer ranks'
    own GPUs on this machine (device LOCAL_RANK per rank), or GPU 0 when the engine shares the
    trainer's GPUs (colocate, or the tensor transport). Ignored without CUDA and with urls."""

    colocate: bool = False
    """The engine shares the trainer's GPUs and gives its memory back while the trainer
    trains: it releases its weights and KV cache after generation and resumes them before the
    next weight sync (SGLang's memory release and resume routes, --enable-memory-saver). Needs
    CUDA, rollout.engine sglang and weight_sync_transport tensor (CUDA IPC, no copy)."""

    mode: Literal["sync", "one_step_off_policy", "async"] = "sync"
    """sync: every step generates with the weights trained so far, then trains (policy lag 0).
    one_step_off_policy: the engine generates step k+1's batch while the trainer trains on step
    k, so every batch after the first is sampled by weights one step old (policy lag 1); the
    loss's pi_old is the trainer's recomputed log-probs and the engine's log-probs are the
    behaviour policy (turn on algorithm.off_policy_correction). Not with colocate.
    async: rank 0 keeps the engine generating groups continuously; each step trains on the
    first prompts_per_step whole groups to finish, none started more than max_staleness
    versions before the trained one; a weight sync retracts the sequences in flight, which
    resume with the new weights, each token recording its version and log-prob
    (docs/off_policy.md, "Asynchronous rollouts"). The embedded, in-process or SGLang engine;
    not with colocate or dynamic_sampling."""

    max_staleness: int = 1
    """rollout.mode async: the largest policy lag of a trained token (step s trains only samples
    whose first token was drawn by weights of version >= s - max_staleness). >= 1."""

    stale_groups: Literal["regenerate", "drop"] = "regenerate"
    """rollout.mode async: what happens to a finished group over max_staleness: regenerate its
    prompt with the current weights, or drop it (the prompt is skipped). Counted either way."""

    weight_update_bucket_mb: int = 512
    """Size of one weight-sync bucket in MiB."""

    verify_weights_every: int = 1
    """Verify what the engines serve every N syncs (0 = never): per-tensor checksums on the
    embedded engine; on SGLang, the first rows of each tensor (/get_weights_by_name, where the
    architecture supports it) and the log-probs of a probe sequence against the trainer's."""

    verify_logprob_tolerance: float = 1e-3
    """Largest mean |engine - trainer| log-prob on the verification probe (temperature 1). fp32
    on both sides agrees to ~1e-6; raise it when the engine runs in bf16 (~1e-2)."""

    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    """DAPO dynamic sampling: drop zero-variance groups, sample until the batch is full."""

    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO soft overlong punishment and overlong filter."""

    environment: Optional[str] = None
    """Multi-turn episodes with an environment (docs/multi_turn.md): a built-in (calculator,
    guess_number) or `path/to/env.py:ClassName`, a class constructed with the dataset row whose
    `step(response) -> {"observation", "done", "reward"}` answers each model turn; or an
    environment of another library: `skyrl_gym:<env id>`, `openenv:path/to/app.py:app`,
    `tools:path/to/env.py:ClassName` (a TRL environment_factory class). null: single-turn rollouts."""

    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Turn limits, observation rendering and environment failures of `environment` episodes."""

    rollout_function: Optional[str] = None
    """`path/to/file.py:fn`, a function that generates each step's samples instead of the
    built-in loop (docs/multi_turn.md, "Custom rollout functions"): fn(engine, prompts, n,
    sampling, seed) -> n Samples per prompt, prompt-major (token ids, the engine's log-probs,
    output_mask), checked every call. null: single-turn, or the `environment` episode loop."""

    rollout_function_timeout_s: float = 300.0
    """Deadline of rollout_function's own code: loading its file, and each stretch in which it
    neither returns nor calls engine.generate (the engine's calls have request_timeout_s).
    The function runs in a worker process; past the deadline the worker is killed and the run
    stops with one line naming the file and the function."""

    def __post_init__(self):
        bl = self.overlong.buffer_length
        check(bl is None or bl <= self.max_new_tokens, "overlong.buffer_length",
              f"{bl} exceeds max_new_tokens = {self.max_new_tokens}")
        check(not self.dynamic_sampling.enabled or self.num_generations > 1, "dynamic_sampling.enabled",
              "needs num_generations > 1 (a group of one has no reward variance)")
        for key in ("num_generations", "prompts_per_step", "max_new_tokens", "weight_update_bucket_mb"):
            check(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        check(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 or >= 1, got {self.top_k}")
        check(0 <= self.min_p < 1, "min_p", f"must be in [0, 1), got {self.min_p}")
        check(self.sampling_mask_max_kept >= 1, "sampling_mask_max_kept",
              f"must be >= 1, got {self.sampling_mask_max_kept}")
        check(self.port is None or 0 < self.port < 65536, "port", f"must be in 1..65535, got {self.port}")
        # the key itself is never echoed (a secret); SGLang reads a key starting with "-" as an option
        check(self.api_key is None or not self.api_key.startswith("-"), "api_key",
              "must not start with '-' (SGLang's argument parser would read it as an option)")
        check(self.num_servers >= 1, "num_servers", f"must be >= 1, got {self.num_servers}")
        check(self.verify_logprob_tolerance > 0, "verify_logprob_tolerance", "must be > 0")
        check(self.max_restarts >= 0, "max_restarts", f"must be >= 0, got {self.max_restarts}")
        check(self.max_inflight_requests >= 1, "max_inflight_requests", "must be >= 1")
        check(self.launch_timeout_s > 0, "launch_timeout_s", "must be > 0")
        check(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        check(self.rollout_function_timeout_s > 0, "rollout_function_timeout_s", "must be > 0")
        check(self.max_retries >= 1, "max_retries", f"must be >= 1, got {self.max_retries}")
        check(self.fp8_format == "e4m3" or self.quantization == "fp8", "fp8_format",
              f"{self.fp8_format!r} needs quantization: fp8 (got quantization: {self.quantization})")
        check(self.verify_weights_every >= 0, "verify_weights_every", "must be >= 0")
        check(self.max_staleness >= 1, "max_staleness", f"must be >= 1, got {self.max_staleness}")
        check(self.mode != "async" or not self.dynamic_sampling.enabled, "mode",
              "async cannot be combined with dynamic_sampling.enabled (a group is trained as it finishes; "
              "there are no extra rounds); set one of them off")
        # async generates groups from several threads at once, and the rollout function's
        # worker process serves one call at a time
        check(self.mode != "async" or self.rollout_function is None, "mode",
              "async cannot be combined with rollout.rollout_function yet (its worker runs one call at a "
              "time; async calls it for several groups at once); use rollout.mode: one_step_off_policy")
        for i, url in enumerate(self.urls):
            check(url.startswith(("http://", "https://")), f"urls[{i}]", f"must start with http:// or https://, got {url!r}")
        check(self.base_gpu_id is None or self.base_gpu_id >= 0, "base_gpu_id", f"must be >= 0, got {self.base_gpu_id}")
        check(self.weight_sync_master_address is None or bool(self.weight_sync_master_address.strip()),
              "weight_sync_master_address", "must be an address or null")
        # colocate, the engine kind's transports and backends, and engines in urls on other
        # hosts are checked against the engine adapters and the network by the pre-flight
        # (preflight/rules.py: check_rollout).
        if self.environment is not None:
            problem = environment_problem(self.environment)
            check(problem is None, "environment", problem or "")
            check(bl is None, "overlong.buffer_length",
                  "the overlong penalty counts response tokens, which in an environment episode include "
                  "observations; set it to null with rollout.environment")
        if self.rollout_function is not None:
            problem = rollout_function_problem(self.rollout_function)
            check(problem is None, "rollout_function", problem or "")
            check(self.environment is None, "rollout_function",
                  "cannot be combined with rollout.environment (the environment's episode loop is the built-in "
                  "rollout function); set one of them to null")

    @property
    def truncates(self) -> bool:
        """The engine samples from a truncated distribution (top-k, top-p or min-p)."""
        return self.top_p < 1 or self.top_k != -1 or self.min_p > 0

    @property
    def batch_size(self) -> int:
        """Sequences per rollout batch."""
        return self.prompts_per_step * self.num_generations
