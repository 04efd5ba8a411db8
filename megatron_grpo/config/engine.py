"""`engine:` section: which inference engine generates the rollouts, where it runs, and how the
trainer talks to it (servers, precision, quantization, timeouts, GPUs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_grpo.config.base import check


@dataclass(kw_only=True)
class SGLangConfig:
    """`engine.sglang:` settings of launched SGLang servers (engine.kind: sglang)."""

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
    """`engine.embedded:` settings of the launched embedded engine (engine.kind: embedded)."""

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

    decode: Literal["eager", "static"] = "eager"
    """How the embedded and in-process engines decode. eager: the host reads every token as it is
    drawn (continuous batching; host-bound on a GPU). static: preallocated KV caches per
    batch-size bucket, sampling on the device, stops read every stop_check_every tokens, and on a
    GPU each bucket's decode step replayed from a CUDA graph (inference/static_decode.py): the same
    tokens as eager for greedy and seeded requests; queued sequences join free rows at the stop
    checks; MoE and sliding-window models decode eagerly."""

    stop_check_every: int = 8
    """decode: static: tokens drawn between two host reads (stop checks, pause/abort/retract);
    a finished row's draws past its stop are dropped."""

    def __post_init__(self):
        for key in ("max_batch_size", "max_request_sequences", "max_request_tokens", "max_request_mb",
                    "stop_check_every"):
            check(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")


@dataclass(kw_only=True)
class EngineConfig:
    """`engine:` the rollout engine: its kind, its servers and how they are launched and reached."""

    kind: Literal["embedded", "sglang", "inprocess"] = "embedded"
    """The kind of rollout engine: embedded (the package's own HTTP engine, transformers) or
    sglang. Launched by the trainer unless `urls` is set; with `urls` it names the kind of the
    servers there (checked when the run starts). inprocess: the embedded engine's generation
    code inside trainer rank 0's process, no server (single machine; the weight sync is an
    in-memory copy and sync.transport/backend are not used; docs/rollout_engines.md)."""

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
    """HTTP requests the client keeps in flight at once (over all servers); also the most
    environment episodes run at once (episodes.kind environment, unless episodes.concurrency)."""

    launch_timeout_s: float = 300.0
    """Deadline for a launched server to become healthy."""

    request_timeout_s: float = 600.0
    """Deadline for one HTTP request (a whole /generate batch)."""

    max_retries: int = 3
    """Attempts per request (with exponential back-off) before a clear error."""

    base_gpu_id: Optional[int] = None
    """First CUDA device (an index among the devices the trainer sees) of the launched
    engines: server i uses the engine.sglang.tp (SGLang) or 1 (embedded) devices from
    base_gpu_id + i * that count (SGLang --base-gpu-id). null: right after the trainer ranks'
    own GPUs on this machine (device LOCAL_RANK per rank), or GPU 0 when the engine shares the
    trainer's GPUs (colocate, or the tensor transport). Ignored without CUDA and with urls."""

    colocate: bool = False
    """The engine shares the trainer's GPUs and gives its memory back while the trainer
    trains: it releases its weights and KV cache after generation and resumes them before the
    next weight sync (SGLang's memory release and resume routes, --enable-memory-saver). Needs
    CUDA, engine.kind sglang and sync.transport tensor (CUDA IPC, no copy)."""

    def __post_init__(self):
        check(self.port is None or 0 < self.port < 65536, "port", f"must be in 1..65535, got {self.port}")
        # the key itself is never echoed (a secret); SGLang reads a key starting with "-" as an option
        check(self.api_key is None or not self.api_key.startswith("-"), "api_key",
              "must not start with '-' (SGLang's argument parser would read it as an option)")
        check(self.num_servers >= 1, "num_servers", f"must be >= 1, got {self.num_servers}")
        check(self.max_restarts >= 0, "max_restarts", f"must be >= 0, got {self.max_restarts}")
        check(self.max_inflight_requests >= 1, "max_inflight_requests", "must be >= 1")
        check(self.launch_timeout_s > 0, "launch_timeout_s", "must be > 0")
        check(self.request_timeout_s > 0, "request_timeout_s", "must be > 0")
        check(self.max_retries >= 1, "max_retries", f"must be >= 1, got {self.max_retries}")
        check(self.fp8_format == "e4m3" or self.quantization == "fp8", "fp8_format",
              f"{self.fp8_format!r} needs quantization: fp8 (got quantization: {self.quantization})")
        for i, url in enumerate(self.urls):
            check(url.startswith(("http://", "https://")), f"urls[{i}]", f"must start with http:// or https://, got {url!r}")
        check(self.base_gpu_id is None or self.base_gpu_id >= 0, "base_gpu_id", f"must be >= 0, got {self.base_gpu_id}")
        # colocate, the engine kind's transports and backends, and engines in urls on other
        # hosts are checked against the engine adapters and the network by the pre-flight
        # (preflight/rules.py: check_engine).
