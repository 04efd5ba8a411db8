"""The small sections: `optimizer`, `data`, `reward`, `checkpoint`, `logging`, `trainer`."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from megatron_grpo.config.base import check

REMOTE = "remote"
"""The reward function name of the HTTP reward kind (``reward.functions[i].remote``)."""

ENV_LABEL = "environment"
"""The label of an evaluation episode's own reward from the environment (evaluation/runner.py),
which ``eval.correct_function`` may name; no reward function may take it."""

LABEL_RE = re.compile(r"^[^/\s]+$")
"""A reward label: it becomes one path part of ``reward/<label>`` (a '/' would collide with
the ``reward/<label>/<counter>`` keys of a function's counters)."""


def default_label(name: str) -> str:
    """The metric label of a reward function named ``name`` when it gives none: ``fn`` of a
    file path ``path/to/file.py:fn`` or a dotted path ``pkg.module.fn``; the name itself for a
    built-in or ``remote`` (which hold neither ':' nor '.')."""
    if ":" in name:
        return name.rpartition(":")[2]
    return name.rpartition(".")[2]


@dataclass(kw_only=True)
class OptimizerConfig:
    name: Literal["adam", "sgd"] = "adam"
    """megatron-core optimizer (Adam is AdamW-style decoupled weight decay)."""

    lr: float = 1e-6
    """Peak learning rate."""

    min_lr: float = 0.0
    """Learning rate at the end of decay."""

    lr_warmup_steps: int = 0
    """Linear warm-up from 0 to `lr` over this many optimizer steps."""

    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up, down to `min_lr` at the last step."""

    weight_decay: float = 0.0
    """Decoupled weight decay."""

    adam_beta1: float = 0.9
    """Adam beta1."""

    adam_beta2: float = 0.999
    """Adam beta2."""

    adam_eps: float = 1e-8
    """Adam epsilon."""

    clip_grad: float = 1.0
    """Global gradient-norm clip (0 = off)."""

    def __post_init__(self):
        check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        check(0 <= self.min_lr <= self.lr, "min_lr", f"must be in [0, lr], got {self.min_lr}")
        check(self.lr_warmup_steps >= 0, "lr_warmup_steps", f"must be >= 0, got {self.lr_warmup_steps}")
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(0 <= self.adam_beta1 < 1, "adam_beta1", f"must be in [0, 1), got {self.adam_beta1}")
        check(0 <= self.adam_beta2 < 1, "adam_beta2", f"must be in [0, 1), got {self.adam_beta2}")
        check(self.adam_eps > 0, "adam_eps", f"must be > 0, got {self.adam_eps}")
        check(self.clip_grad >= 0, "clip_grad", f"must be >= 0, got {self.clip_grad}")


@dataclass(kw_only=True)
class DataConfig:
    train_file: str
    """Prompt dataset: .jsonl (one JSON object a line) or .parquet."""

    prompt_key: str = "prompt"
    """Field holding the prompt text (or a list of chat messages)."""

    answer_key: str = "answer"
    """Field holding the reference answer passed to the reward functions."""

    apply_chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template (when it has one)."""

    system_prompt: Optional[str] = None
    """System message prepended when the chat template is applied."""

    max_prompt_length: int = 512
    """Prompts longer than this many tokens are an error naming the line."""

    shuffle: bool = True
    """Shuffle prompts each epoch (seeded by trainer.seed)."""

    def __post_init__(self):
        check(bool(self.train_file), "train_file", "must name a .jsonl or .parquet file")
        check(
            self.train_file.endswith((".jsonl", ".parquet")),
            "train_file",
            f"must end in .jsonl or .parquet, got {self.train_file!r}",
        )
        check(bool(self.prompt_key), "prompt_key", "must name the prompt field")
        check(bool(self.answer_key), "answer_key", "must name the answer field")
        check(
            self.prompt_key != self.answer_key,
            "answer_key",
            f"must differ from prompt_key (both are {self.prompt_key!r})",
        )
        check(
            self.system_prompt is None or bool(self.system_prompt.strip()),
            "system_prompt",
            "must be null or a non-empty string",
        )
        check(self.max_prompt_length >= 1, "max_prompt_length", f"must be >= 1, got {self.max_prompt_length}")


@dataclass(kw_only=True)
class RemoteRewardConfig:
    url: str
    """Endpoint that scores one response: POST the sample as JSON, answer `{"reward": number}`."""

    timeout_s: float = 30.0
    """Seconds one request may take (the whole request); then it is retried."""

    max_retries: int = 2
    """Retries after a timeout, a connection error or HTTP 429/5xx (each counted in
    `reward/<label>/retries`); then the run stops with a one-line error."""

    api_key_env: Optional[str] = None
    """Name of an environment variable holding a key sent as `Authorization: Bearer <key>`."""

    def __post_init__(self):
        check(self.url.startswith(("http://", "https://")), "url", f"must start with http:// or https://, got {self.url!r}")
        check(math.isfinite(self.timeout_s) and self.timeout_s > 0, "timeout_s", f"must be > 0, got {self.timeout_s}")
        check(self.max_retries >= 0, "max_retries", f"must be >= 0, got {self.max_retries}")
        check(self.api_key_env is None or bool(self.api_key_env), "api_key_env", "must be null or a variable name")


@dataclass(kw_only=True)
class RewardFunctionConfig:
    name: str
    """A built-in reward (`math_exact_match`, `format`, `reasoning_gym`, `math_verify`), `remote`
    (an HTTP server, see `remote`), a dotted path `pkg.module.fn` or a file path
    `path/to/rewards.py:fn` (relative to the current directory). The function declares what it
    takes by its parameter names (docs/rewards.md)."""

    label: Optional[str] = None
    """Name of the function's metrics (`reward/<label>`, `eval/<set>/reward/<label>_mean`) and
    what `eval.correct_function` names; no '/' or whitespace. null = the name for a built-in or
    `remote`, the function's own name (`fn`) for a dotted or file path, with `[i]` appended when
    that default repeats another label."""

    weight: float = 1.0
    """Weight of this function in the summed reward (may be negative for a penalty)."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the function (`math_exact_match`: use_last_number; `format`:
    style = boxed | hash | boxed_or_hash | number; `reasoning_gym`, `math_verify`: extract =
    answer_tag | boxed | last_number | none, timeout_s)."""

    max_concurrency: int = 32
    """Calls of this function in flight at once (async functions and `remote` overlap; a plain
    function runs one sample after the other)."""

    remote: Optional[RemoteRewardConfig] = None
    """The HTTP server of a `remote` reward (required then, and only then)."""

    timeout_s: Optional[float] = None
    """Deadline of one call of a dotted or file-path function (one sample, or one batch for a
    batch function); null = 60. A plain function runs in a worker process, killed when a call
    passes it; an async one is cancelled. Past it the run stops with one line naming the
    function and the sample. Built-ins take `kwargs.timeout_s`, `remote` its `remote.timeout_s`."""

    def __post_init__(self):
        # Whether the name is one the reward registry resolves: preflight/rules.py (check_reward).
        check(self.label is None or LABEL_RE.match(self.label) is not None, "label",
              f"must be non-empty, without '/' or whitespace (it names metrics reward/<label>), got {self.label!r}")
        check(math.isfinite(self.weight), "weight", f"must be a finite number, got {self.weight}")
        check(self.max_concurrency >= 1, "max_concurrency", f"must be >= 1, got {self.max_concurrency}")
        check(self.timeout_s is None or (math.isfinite(self.timeout_s) and self.timeout_s > 0), "timeout_s",
              f"must be > 0, got {self.timeout_s}")
        if self.name == REMOTE:
            check(self.remote is not None, "remote", "is required for a remote reward (url, timeout_s, ...)")
            check(not self.kwargs, "kwargs", "a remote reward takes no kwargs (its server gets the whole sample)")
        else:
            check(self.remote is None, "remote", f"is only for name: {REMOTE} (this function is {self.name!r})")


@dataclass(kw_only=True)
class RewardConfig:
    functions: list[RewardFunctionConfig] = field(
        default_factory=lambda: [RewardFunctionConfig(name="math_exact_match")]
    )
    """Reward functions; the reward of a response is their weighted sum."""
    import_timeout_s: float = 300.0
    """How long building the reward functions may take in one process: importing a dotted or
    file-path function's module (its top-level code) and constructing a built-in, in
    `megatron-grpo train`'s pre-flight and again in each rank. Past it the run ends with one
    line and exit code 2 (a module whose top-level code never returns hung the run for good)."""

    def __post_init__(self):
        check(len(self.functions) >= 1, "functions", "needs at least one reward function")
        check(math.isfinite(self.import_timeout_s) and self.import_timeout_s > 0, "import_timeout_s",
              f"must be > 0, got {self.import_timeout_s}")
        check(
            any(f.weight != 0 for f in self.functions),
            "functions",
            "every weight is 0, so every reward would be 0",
        )
        labels = self.labels
        for i, label in enumerate(labels):
            check(label != ENV_LABEL, f"functions[{i}].label", f"'{ENV_LABEL}' is reserved for the environment's own "
                  "reward in evaluation; set another label")
            first = labels.index(label)
            check(first == i, f"functions[{i}].label", f"{label!r} is already the label of reward.functions[{first}]; "
                  "labels name metrics and must be unique")

    @property
    def labels(self) -> list[str]:
        """Metric label of each function: its ``label``, else its default (``default_label``),
        with ``[i]`` appended when a default repeats another label."""
        defaults = [default_label(f.name) for f in self.functions]
        given = [f.label for f in self.functions]
        taken = [g if g is not None else d for g, d in zip(given, defaults)]
        return [g if g is not None else (d if taken.count(d) == 1 else f"{d}[{i}]")
                for i, (g, d) in enumerate(zip(given, defaults))]


@dataclass(kw_only=True)
class CheckpointConfig:
    save_every: int = 0
    """Save every N steps (0 = only at the end of the run)."""

    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted."""

    resume: str = "auto"
    """auto: continue from the run directory's newest intact checkpoint if any (a damaged one is
    skipped with one warning line; complete ones that are all damaged stop the run); never:
    start fresh; or a checkpoint directory path (damaged: the run stops, no fallback)."""

    save_on_stop: bool = True
    """On SIGTERM or Ctrl-C (what Slurm sends before preemption), finish the current step, save
    a checkpoint of it (unless one was just saved) and stop, so the relaunched job resumes
    there. false: stop after the step without saving (the last complete checkpoint stays)."""

    stop_timeout_s: float = 120.0
    """Seconds `megatron-grpo train` gives the ranks, after a stop signal, to finish their step
    and save before they are killed (torchrun's shutdown timeout). Keep it below the
    scheduler's own grace period (Slurm's GraceTime / KillWait)."""

    save_timeout_s: Optional[float] = None
    """Seconds megatron-core's part of one save may take on a rank (its writer processes that
    hang or stall, a wait that never ends) before every rank stops with one line, the
    writers killed and the last complete checkpoint intact. null: 0.9 x
    parallel.distributed_timeout_s (the ranks that finished wait that long for a slow one in a
    collective and would fail first); an explicit value must be below it. A write stuck in
    the kernel (a dead network filesystem) may not be interruptible: the group's timeout then
    ends the run."""

    def __post_init__(self):
        check(self.save_timeout_s is None or self.save_timeout_s > 0, "save_timeout_s",
              f"must be > 0 or null, got {self.save_timeout_s}")
        check(self.save_every >= 0, "save_every", f"must be >= 0, got {self.save_every}")
        check(self.stop_timeout_s > 0, "stop_timeout_s", f"must be > 0, got {self.stop_timeout_s}")
        check(self.keep_last >= 1, "keep_last", f"must be >= 1, got {self.keep_last}")
        check(bool(self.resume), "resume", "must be auto, never or a checkpoint path")


@dataclass(kw_only=True)
class LoggingConfig:
    tensorboard: bool = True
    """Also write TensorBoard events (when tensorboard is installed)."""

    wandb_project: Optional[str] = None
    """Weights & Biases project; null = no wandb."""

    wandb_run_name: Optional[str] = None
    """Weights & Biases run name (default: the run directory's name)."""

    progress_bar: bool = True
    """A progress bar with ETA on rank 0."""

    plot: bool = True
    """Write plot.png (reward, KL, clip ratio, mismatch vs step) at the end of the run."""


@dataclass(kw_only=True)
class TrainerConfig:
    run_dir: str
    """Directory of this run: resolved config, metrics.jsonl, checkpoints, plot, engine log."""

    num_steps: int = 100
    """Rollout + update steps."""

    seed: int = 1234
    """Seed of data order, sampling and initialisation."""

    max_consecutive_nonfinite: int = 3
    """Abort after this many consecutive steps with a non-finite loss or gradient (each is
    skipped)."""

    def __post_init__(self):
        check(bool(self.run_dir), "run_dir", "must name a directory")
        check(self.num_steps >= 1, "num_steps", f"must be >= 1, got {self.num_steps}")
        check(0 <= self.seed < 2**32, "seed", f"must be in [0, 2^32 - 1] (numpy's seed range), got {self.seed}")
        check(self.max_consecutive_nonfinite >= 1, "max_consecutive_nonfinite", "must be >= 1")
