"""One YAML file = one experiment: the top-level `ExperimentConfig` and its loader.

``load_config(path, overrides)`` parses the YAML, applies dotted command-line overrides
(``algorithm.eps_clip_high=0.28``, values parsed as YAML scalars), builds every section
strictly (``base.build_section``) and runs the checks that span sections. Any problem is a
``ConfigError`` whose one line names the file and the dotted key.
"""

from __future__ import annotations

import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_grpo.config import aliases
from megatron_grpo.config.algorithm import AlgorithmConfig
from megatron_grpo.config.base import ConfigError, ConfigValueError, build_section, check, to_dict
from megatron_grpo.config.distillation import DistillationConfig
from megatron_grpo.config.engine import EngineConfig
from megatron_grpo.config.episodes import EpisodesConfig
from megatron_grpo.config.evaluation import EvalConfig
from megatron_grpo.config.model import ModelConfig, ParallelConfig
from megatron_grpo.config.rollout import RolloutConfig
from megatron_grpo.config.sections import (
    ENV_LABEL,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    OptimizerConfig,
    RewardConfig,
    TrainerConfig,
)
from megatron_grpo.config.sync import SyncConfig


@dataclass(kw_only=True)
class ExperimentConfig:
    model: ModelConfig
    """The policy network (a Hugging Face directory) and its precision."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor/pipeline/data parallel sizes and batch sizes."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """What each step generates: group size, prompts per step, sampling, schedule, DAPO."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    """The rollout engine: its kind, servers, precision, quantization and timeouts."""

    sync: SyncConfig = field(default_factory=SyncConfig)
    """The per-step weight sync into the engine and its verification."""

    episodes: EpisodesConfig = field(default_factory=EpisodesConfig)
    """Multi-turn episodes with an environment, or a custom rollout function."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, policy loss, KL/entropy and off-policy correction."""

    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation from a frozen teacher (off while distillation.teacher is null)."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer, learning-rate schedule and gradient clipping."""

    data: DataConfig
    """Prompt dataset."""

    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward functions."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint cadence, retention and resume."""

    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metric sinks, progress bar, final plot."""

    trainer: TrainerConfig
    """Run directory, number of steps, seed."""

    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation: sets, cadence, pass@k."""

    def __post_init__(self):
        self._check_rollout_against_episodes()
        rollout_batch = self.rollout.batch_size
        check(
            rollout_batch % self.parallel.global_batch_size == 0,
            "parallel.global_batch_size",
            f"{self.parallel.global_batch_size} must divide the rollout batch "
            f"rollout.prompts_per_step*rollout.num_generations = {rollout_batch}",
        )
        if self.algorithm.loss_reduction == "seq_mean_token_sum_norm":
            check(
                self.algorithm.max_response_length >= self.rollout.max_new_tokens,
                "algorithm.max_response_length",
                f"the Dr.GRPO horizon {self.algorithm.max_response_length} is shorter than "
                f"rollout.max_new_tokens = {self.rollout.max_new_tokens}",
            )

        check(self.checkpoint.save_timeout_s is None
              or self.checkpoint.save_timeout_s < self.parallel.distributed_timeout_s, "checkpoint.save_timeout_s",
              f"{self.checkpoint.save_timeout_s:g} must be below parallel.distributed_timeout_s = "
              f"{self.parallel.distributed_timeout_s:g} (past it the other ranks fail first, waiting for this "
              "one in a collective)" if self.checkpoint.save_timeout_s is not None else "")
        check(not (self.parallel.sequence_parallel and self.model.attention_backend != "auto"),
              "model.attention_backend", f"{self.model.attention_backend} uses megatron-core's local layer spec, "
              "which cannot run parallel.sequence_parallel; use auto (TransformerEngine's spec) or turn it off")
        check(not (self.parallel.pack_sequences and self.model.attention_backend == "unfused"),
              "parallel.pack_sequences", "needs model.attention_backend sdpa or auto (megatron-core's unfused "
              "attention has no packed layout)")
        check(not (self.parallel.pack_sequences and self.algorithm.router_replay), "parallel.pack_sequences",
              "cannot be combined with algorithm.router_replay (the replayed routing is laid out per padded row)")
        # router_replay against the engine kind: preflight/rules.py (check_experiment)
        check(not (self.algorithm.router_replay and self.model.recompute_activations), "algorithm.router_replay",
              "cannot be combined with model.recompute_activations (the recomputed forward would "
              "route after later micro-batches set their targets)")
        why = {"environment": "multi-turn episodes", "agent": "multi-turn episodes",
               "function": "its samples carry no routing"}
        check(self.episodes.kind is None or not self.algorithm.router_replay, "algorithm.router_replay",
              f"is not supported with episodes.kind {self.episodes.kind} ({why.get(self.episodes.kind)}): set one "
              "of them off")

        self._check_distillation()
        labels = self.reward.labels
        if self.episodes.multi_turn:
            # an evaluation episode's own reward (evaluation/runner.py)
            labels = [*labels, ENV_LABEL]
            plain = next((s.name for s in self.eval.sets if s.single_turn), None)
            check(self.eval.correct_function != ENV_LABEL or plain is None, "eval.correct_function",
                  f"environment decides only episodes, but set {plain!r} has single_turn: true; name a reward "
                  "function or set single_turn: false")
        by_name = {f.name: label for f, label in zip(self.reward.functions, self.reward.labels)}
        hint = (f" ({self.eval.correct_function!r} is the name of the function labelled "
                f"{by_name[self.eval.correct_function]!r})" if self.eval.correct_function in by_name else "")
        check(
            self.eval.correct_function is None or self.eval.correct_function in labels,
            "eval.correct_function",
            f"{self.eval.correct_function!r} is not a reward function label; labels: {', '.join(labels)}{hint}",
        )

    @property
    def save_timeout_s(self) -> float:
        """``checkpoint.save_timeout_s``, its null resolved (0.9 x the group's timeout)."""
        explicit = self.checkpoint.save_timeout_s
        return explicit if explicit is not None else 0.9 * self.parallel.distributed_timeout_s

    def _check_rollout_against_episodes(self) -> None:
        """The rules between `rollout:` and `episodes:` (the engine kind's are the pre-flight's,
        preflight/rules.py)."""
        # async generates groups from several threads at once, and the rollout function's
        # worker process serves one call at a time
        check(self.rollout.mode != "async" or self.episodes.kind != "function", "rollout.mode",
              "async cannot be combined with episodes.kind function yet (its worker runs one call at a "
              "time; async calls it for several groups at once); use rollout.mode: one_step_off_policy")
        check(not self.episodes.multi_turn or self.rollout.overlong.buffer_length is None,
              "rollout.overlong.buffer_length",
              "the overlong penalty counts response tokens, which in an environment or agent episode include "
              "observations; set it to null with episodes.kind environment or agent")

    def _check_distillation(self) -> None:
        """The rules between `distillation:` and the other sections."""
        distill = self.distillation
        if not distill.enabled:
            return
        # pure distillation trains every sampled token: a filter of groups by their rewards
        # would throw away the very tokens the teacher scores
        check(distill.task_reward or not self.rollout.dynamic_sampling.enabled, "rollout.dynamic_sampling.enabled",
              "drops groups by their rewards, which distillation.task_reward: false does not train on; turn it off")

    @property
    def mini_batches_per_step(self) -> int:
        """Optimizer steps per rollout batch and iteration."""
        return self.rollout.batch_size // self.parallel.global_batch_size

    def to_dict(self, redact: bool = True) -> dict:
        """The config as plain data, secrets (``SECRET_KEYS``) replaced by ``REDACTED``: what
        is printed, saved to the run directory and sent to TensorBoard/wandb."""
        out = to_dict(self)
        for section, key in SECRET_KEYS if redact else ():
            if out[section].get(key) is not None:
                out[section][key] = REDACTED
        return out


SECRET_KEYS = (("engine", "api_key"),)
"""(section, key) of the values that never leave the process."""

REDACTED = "<redacted>"


MAX_YAML_DEPTH = 64
"""Deepest nesting of mappings and lists a config may have (real ones are 4 deep); deeper
input would hit Python's recursion limit inside PyYAML."""

MAX_YAML_VALUES = 100_000
"""Most values a config may hold once its aliases (``*name``) are expanded (real ones hold a
few hundred). A 1 KB file of nested aliases ("billion laughs") expands to 10^9 values, which
every later walk of the tree (the checks, the printed and saved resolved config) would visit."""


class YamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (``1e-6`` is a number: PyYAML's YAML 1.1 resolver needs
    ``1.0e-6`` and would hand the string "1e-6" to a float field), and three refusals with the
    line: a key given twice in one mapping (PyYAML keeps the last one silently), nesting deeper
    than ``MAX_YAML_DEPTH``, and aliases that expand past ``MAX_YAML_VALUES`` values."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._expanded: dict[int, int] = {}  # id(node) -> values it holds once aliases are expanded

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_YAML_DEPTH} levels", mark)
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        if self._expanded_size(node) > MAX_YAML_VALUES:
            raise yaml.composer.ComposerError(
                None, None, f"aliases (*name) expand this value to more than {MAX_YAML_VALUES} values", mark)
        return node

    def _expanded_size(self, node) -> int:
        """Values under ``node`` with every alias expanded, memoised per node: an alias is the
        same node object as its anchor, so this costs one visit per distinct node."""
        key = id(node)
        if key not in self._expanded:
            if isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            elif isinstance(node, yaml.SequenceNode):
                children = node.value
            else:
                children = []
            self._expanded[key] = 1 + sum(self._expanded_size(c) for c in children)
        return self._expanded[key]

    def construct_mapping(self, node, deep=False):
        first_line: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: explicit keys may override it
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = first_line.get(key)
            except TypeError:  # an unhashable key: the base class reports it with its line
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given at line {first})", key_node.start_mark)
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _construct_int(loader: YamlLoader, node) -> int:
    """PyYAML's int, with an integer past Python's digit limit (4300) refused at its line: its
    ``ValueError`` is no YAML error, and escaped the loader as a traceback."""
    try:
        return yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)
    except ValueError:
        raise yaml.constructor.ConstructorError(
            None, None, f"an integer of {len(node.value)} digits, more than the {sys.get_int_max_str_digits()} "
            "Python reads", node.start_mark) from None


YamlLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
               r"|\.[0-9_]+(?:[eE][-+][0-9]+)?"
               r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def yaml_load(text: str):
    """Parse YAML text with ``YamlLoader``."""
    return yaml.load(text, Loader=YamlLoader)  # noqa: S506 - a SafeLoader subclass


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=1"`` -> (["a", "b"], 1); the value is parsed as a YAML scalar or flow list."""
    source = f"override {text!r}"
    if "=" not in text:
        raise ConfigError("", "must look like section.key=value", source)
    key, value = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(key, "has an empty key part", source)
    try:
        parsed = yaml_load(value) if value.strip() else None
    except (yaml.constructor.ConstructorError, yaml.composer.ComposerError) as e:
        # YAML that parses but is refused (a key given twice, nesting or aliases past the
        # bounds): a plain string instead would hide the problem behind a type error
        problem = str(getattr(e, "problem", None) or e).splitlines()[0]
        raise ConfigError(key.strip(), re.sub(r" \(first given at line 1\)$", "", problem), source) from None
    except yaml.YAMLError:  # not YAML at all: the text itself is the value (a URL, a path)
        parsed = value
    return parts, parsed


def apply_overrides(raw: dict, overrides: list[str], renamed: Optional[aliases.Renamed] = None) -> dict:
    """Set each dotted override in a copy of ``raw`` (creating intermediate mappings). A
    deprecated key is set under its current name (``aliases.DEPRECATED_KEYS``) and appended to
    ``renamed``; the old and the new name of one key both on the command line are an error."""
    import copy

    raw = copy.deepcopy(raw)
    spelling: dict[str, tuple[str, bool]] = {}  # current key -> (as first given, deprecated)
    kind_given: Optional[tuple[Optional[str], Any]] = None  # episodes.kind on the command line: (old selector, value)
    for text in overrides:
        source = f"override {text!r}"
        parts, value = parse_override(text)
        try:
            settings = list(aliases.rename_override(parts, value, ExperimentConfig))
        except ConfigError as e:
            raise e.with_source(source) from None
        for parts, value, old in settings:
            key = ".".join(parts)
            first, first_old = spelling.setdefault(key, (old or key, old is not None))
            if first_old != (old is not None):
                raise ConfigError(key, f"is given twice: as {key} and as its deprecated name "
                                       f"{first if first_old else old}; keep only {key}", source)
            if old is not None and renamed is not None:
                renamed.append((old, key))
            if value is aliases.ANNOUNCE_ONLY:
                continue
            # an old selector (episodes.environment=X) also sets the kind, which must agree
            # with an episodes.kind given on the command line
            pairs = (aliases.selector_settings(old, key, value, raw) if old in aliases.IMPLIED_KIND
                     else [(key, value)])
            for dotted, v in pairs:
                if dotted == aliases.KIND_KEY:
                    by = old if old in aliases.IMPLIED_KIND else None
                    if kind_given is not None and (kind_given[0] is None) != (by is None) \
                            and None not in (kind_given[1], v) and kind_given[1] != v:
                        raise ConfigError(dotted, aliases.kind_conflict_message(
                            kind_given[1] if by else v, by or kind_given[0]), source)
                    kind_given = (by, v)
                try:
                    node = aliases.parent_section(raw, dotted.split("."), dotted)
                except ConfigError as e:
                    raise e.with_source(source) from None
                node[dotted.split(".")[-1]] = v
    return raw


def build_experiment(raw: Any, world_size: Optional[int] = None) -> ExperimentConfig:
    """Build and validate an ExperimentConfig from a parsed YAML mapping.

    ``world_size`` (the launcher's) is checked against ``parallel.world_size`` and the tp*pp*cp
    product when given.
    """
    if not isinstance(raw, dict):
        raise ConfigError("", f"the top level must be a mapping of sections, got {type(raw).__name__}")
    cfg = build_section(ExperimentConfig, raw)
    if world_size is not None:
        if world_size < 1:  # the launchers refuse it first; this guards the arithmetic below
            raise ConfigError("parallel.world_size", f"the launcher's world size must be >= 1, got {world_size}")
        par = cfg.parallel
        if par.world_size is not None and par.world_size != world_size:
            raise ConfigError(
                "parallel.world_size", f"is {par.world_size} but the launcher started {world_size} ranks"
            )
        if world_size % (par.tp * par.pp * par.cp) != 0:
            raise ConfigError(
                "parallel.tp", f"tp*pp*cp = {par.tp}*{par.pp}*{par.cp} does not divide the world size {world_size}"
            )
        dp = par.dp(world_size)
        if dp % par.ep != 0:
            raise ConfigError("parallel.ep", f"{par.ep} does not divide dp = world size/(tp*pp*cp) = {dp}")
        if par.global_batch_size % (par.micro_batch_size * dp) != 0:
            raise ConfigError(
                "parallel.global_batch_size",
                f"{par.global_batch_size} is not a multiple of micro_batch_size*dp = {par.micro_batch_size}*{dp}",
            )
        try:
            par.check_expert_layout(world_size)
            par.check_vpp_microbatches(dp)
        except ConfigValueError as e:
            raise ConfigError(f"parallel.{e.key}", e.message) from None
    return cfg


def load_config(
    path: str | Path, overrides: list[str] | None = None, world_size: Optional[int] = None, *,
    announce_deprecated: bool = True,
) -> ExperimentConfig:
    """Read, override and validate an experiment YAML. Raises ConfigError naming ``path``.
    Deprecated keys (``aliases.DEPRECATED_KEYS``), in the file or an override, load under their
    current names, each announced by one line on stderr (once per process; not at all with
    ``announce_deprecated`` false, e.g. on the ranks of a run whose launcher announced them)."""
    path = Path(path)
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            # a pipe (`--config <(...)`) is empty when read again, as each rank and the launcher
            # do (the run stopped with "the file is empty"), and a FIFO blocks the read for ever
            raise ConfigError("", "is not a regular file (a pipe, a device or a directory); every process of "
                                  "the run reads the config, so write it to a file", str(path))
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError("", "file not found", str(path)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("", f"cannot read: {e}", str(path)) from None
    try:
        raw = yaml_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        kind = "YAML syntax error" if isinstance(e, (yaml.scanner.ScannerError, yaml.parser.ParserError)) else "YAML"
        raise ConfigError(where, f"{kind}: {problem}", str(path)) from None
    if raw is None:
        raise ConfigError("", "the file is empty", str(path))
    try:
        if isinstance(raw, dict):
            raw, renamed = aliases.rename_file(raw, ExperimentConfig)
            raw = apply_overrides(raw, overrides or [], renamed)
            if announce_deprecated:
                aliases.announce(renamed)
        return build_experiment(raw, world_size)
    except ConfigError as e:  # an override's own mistake already names the override
        raise e.with_source(e.source or error_source(e.where, overrides or [], str(path))) from None


def error_source(where: str, overrides: list[str], path: str) -> str:
    """What to name for a bad value at dotted key ``where``: the command-line override that set
    it (the last one wins, as when applied), or else the YAML file. A secret's value
    (``SECRET_KEYS``) is not repeated."""
    for text in reversed(overrides):
        given = text.split("=", 1)[0].strip()
        key = aliases.current_key(given)  # a deprecated name sets (and names errors by) the current key
        if key and (where == key or where.startswith((key + ".", key + "["))):
            if tuple(key.split(".")) in SECRET_KEYS:
                return f"override '{given}=<redacted>'"
            return f"override {text!r}"
    return path


