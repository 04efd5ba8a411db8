"""Hostile input to `megatron-grpo train`: every case ends with exit code 2, ONE line on
stderr naming the file and the key or line, and nothing in the run directory.

A tiny HF model and a 4-line JSONL dataset are built once; each case copies what it breaks.
Cases marked SUBPROCESS run the real command (`python -m megatron_grpo.cli train ...`) to
prove the exit code and the bare stderr; the others call `megatron_grpo.launcher.cli.main` in
the test process (the same code path, without ~4 s of interpreter start-up each), with the
rank launcher replaced by a failure: reaching it would mean the bad input was not caught.

A reward function that raises or returns a non-number only shows when responses are scored:
`RewardScorer` is tested directly, and one real short run (embedded engine, disk weight
sync) checks the trainer turns it into the same one-line error and exit code 2.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml

from megatron_grpo.launcher import cli

ROOT = Path(__file__).resolve().parents[1]
DATA_LINES = [{"prompt": f"what is {i} plus 1", "answer": str(i + 1)} for i in range(4)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The good inputs every case starts from: a tiny qwen2 model and a 4-prompt dataset."""
    from tools.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("hostile")
    model = save_tiny_model(root / "model", "qwen2", seed=0)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in DATA_LINES))
    return {"model": model, "data": data}


@dataclass
class Ctx:
    """Per-case scratch space: writes broken variants of the good inputs under ``tmp``."""

    tmp: Path
    world: dict
    plugin_dir: Path = field(init=False)

    def __post_init__(self):
        self.plugin_dir = self.tmp / "plugins"
        self.plugin_dir.mkdir()

    @property
    def run_dir(self) -> Path:
        return self.tmp / "run"

    def base(self) -> dict:
        return {
            "model": {"hf_dir": str(self.world["model"]), "dtype": "float32"},
            "parallel": {"global_batch_size": 4},
            "rollout": {"num_generations": 2, "prompts_per_step": 2, "max_new_tokens": 2},
            "sync": {"transport": "disk"},
            "data": {"train_file": str(self.world["data"])},
            "logging": {"tensorboard": False, "progress_bar": False, "plot": False},
            "trainer": {"run_dir": str(self.run_dir), "num_steps": 1},
        }

    def config(self, edit: Callable[[dict], None] | str | None = None, name: str = "run.yaml") -> str:
        """Write a config: the base one changed by ``edit(cfg)``, or ``edit`` as raw YAML text."""
        path = self.tmp / name
        if isinstance(edit, str):
            path.write_text(edit)
        else:
            cfg = self.base()
            if edit is not None:
                edit(cfg)
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return str(path)

    def model(self, edit: Callable[[Path], None]) -> str:
        """A copy of the good model directory changed by ``edit(dir)``."""
        out = self.tmp / "model"
        shutil.copytree(self.world["model"], out)
        edit(out)
        return str(out)

    def dataset(self, content: bytes | str, name: str = "data.jsonl") -> str:
        path = self.tmp / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return str(path)

    def plugin(self, module: str, source: str) -> str:
        (self.plugin_dir / f"{module}.py").write_text(textwrap.dedent(source))
        return module

    def train(self, *argv: str, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``megatron-grpo train ARGV`` as a user runs it, from ``tmp``, with the plug-in folder on
        its path (and ``env`` added)."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(self.plugin_dir), str(ROOT)]), **(env or {})}
        return subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "train", *argv], capture_output=True,
                              text=True, env=env, cwd=self.tmp, timeout=timeout)


def _set(path: str, value):
    """An edit setting the dotted ``path`` of the config to ``value``."""
    def edit(cfg):
        *parents, last = path.split(".")
        node = cfg
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return edit


def _drop(section: str):
    return lambda cfg: cfg.pop(section)


def _edit_json(name: str, **changes):
    def edit(d: Path):
        cfg = json.loads((d / name).read_text())
        cfg.update(changes)
        (d / name).write_text(json.dumps(cfg))
    return edit


def _lines(*records) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


# Each case: ctx -> (argv, substrings the error line must contain). The first substring is
# always the file the line must name (the config, the dataset, or a model file).
Case = Callable[[Ctx], tuple[list[str], list[str]]]


def _cfg_case(edit, *needles, extra=()) -> Case:
    def case(ctx):
        path = ctx.config(edit)
        return ["--config", path, *extra], [path, *needles]
    return case


def _model_case(edit, *needles) -> Case:
    def case(ctx):
        model = ctx.model(edit)
        path = ctx.config(_set("model.hf_dir", model))
        return ["--config", path], [path, "model.hf_dir", model, *needles]
    return case


def _data_case(content, *needles, data_key: dict | None = None, name="data.jsonl") -> Case:
    """A dataset with ``content``; needles after the file: ``:LINE:`` etc."""
    def case(ctx):
        data = ctx.dataset(content, name)

        def edit(cfg):
            cfg["data"]["train_file"] = data
            cfg["data"].update(data_key or {})
        path = ctx.config(edit)
        return ["--config", path], [data, *needles]
    return case


def _reward_case(module_source: str | None, name: str, *needles, kwargs=None) -> Case:
    def case(ctx):
        if module_source is not None:
            ctx.plugin(name.split(".")[0], module_source)
        fn = {"name": name, **({"kwargs": kwargs} if kwargs else {})}
        path = ctx.config(_set("reward.functions", [fn]))
        return ["--config", path], [path, "reward.functions[0]", *needles]
    return case


def _plugin_file_case(file_name: str, source: str, key: str, attr: str, *needles) -> Case:
    """An environment or rollout function file ``file_name`` holding ``source``, run by the kind
    of ``key`` (the label its error carries: ``episodes.environment``, ``episodes.rollout_function``)."""
    kind = {"episodes.environment": "environment", "episodes.rollout_function": "function"}[key]

    def case(ctx):
        plugin = ctx.plugin_dir / file_name
        plugin.write_text(source)

        def edit(cfg):
            cfg["episodes"] = {"kind": kind, "source": f"{plugin}:{attr}", "max_episode_tokens": 16}
            cfg["engine"] = {"kind": "inprocess"}
        path = ctx.config(edit)
        return ["--config", path], [path, key, *needles]
    return case


def _yaml_syntax(ctx):
    path = ctx.config("model:\n  hf_dir: x\ntrainer:\n  run_dir: [unclosed\n  num_steps: 3\n")
    return ["--config", path], [path, "line ", "YAML syntax error"]


def _config_missing(ctx):
    path = str(ctx.tmp / "nope.yaml")
    return ["--config", path], [path, "file not found"]


def _top_level_list(ctx):
    path = ctx.config("- model\n- data\n")
    return ["--config", path], [path, "top level must be a mapping"]


def _nproc_not_divisible(ctx):
    path = ctx.config(_set("parallel.tp", 2))
    return ["--config", path, "--nproc", "3"], [path, "parallel.tp", "does not divide the world size 3"]


def _override_case(override: str, *needles) -> Case:
    """A good config with one bad command-line override: the line must blame the override."""
    def case(ctx):
        return ["--config", ctx.config(), override], [f"override {override!r}", *needles]
    return case


def _yaml_case(text: str, *needles) -> Case:
    """The good config with raw YAML ``text`` appended (a second document body at top level)."""
    def case(ctx):
        good = yaml.safe_dump(ctx.base(), sort_keys=False)
        path = ctx.config(good + text)
        return ["--config", path], [path, *needles]
    return case


def _alias_bomb(levels: int = 9) -> str:
    """~1 KB of YAML whose nested aliases expand to 9^levels values ("billion laughs"),
    placed where a mapping of anything is allowed (a reward function's kwargs)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "reward:\n  functions:\n  - name: format\n    kwargs:\n" + "".join(f"      {line}\n" for line in lines)


def _yaml_huge_integer(ctx):
    """An integer of 5000 digits: past Python's 4300-digit limit, PyYAML's ValueError escaped the
    loader as a traceback (issue 48, second round)."""
    good = yaml.safe_dump(ctx.base(), sort_keys=False)
    path = ctx.config(good.replace("num_steps: 1", "num_steps: " + "9" * 5000))
    return ["--config", path], [path, "line ", "an integer of 5000 digits, more than the 4300 Python reads"]


def _config_is_a_fifo(ctx):
    """``--config`` naming a FIFO (or ``<(...)``, a pipe): the read blocked for ever, or the second
    read (the launcher reads the config twice, each rank again) found it empty."""
    path = str(ctx.tmp / "run.yaml")
    os.mkfifo(path)
    return ["--config", path], [path, "is not a regular file", "write it to a file"]


def _dataset_missing(ctx):
    data = str(ctx.tmp / "missing.jsonl")
    path = ctx.config(_set("data.train_file", data))
    return ["--config", path], [data, "file not found (data.train_file)"]


def _partial_sharded(d: Path):
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                  "lm_head.weight": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _tokenizer_removed(d: Path):
    for f in d.glob("tokenizer*"):
        f.unlink()


def _weights_removed(d: Path):
    (d / "model.safetensors").unlink()


def _duplicate_in_config_json(d: Path):
    """config.json with a second vocab_size before the real one (json keeps the last silently)."""
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text.replace("{", '{\n  "vocab_size": 7,', 1))


def _parquet_nan_answer(ctx):
    """A Parquet dataset whose answer column holds NaN (JSONL refuses the literal when parsing)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = str(ctx.tmp / "data.parquet")
    pq.write_table(pa.table({"prompt": ["what is 1", "what is 2"], "answer": [2.0, float("nan")]}), data)
    path = ctx.config(_set("data.train_file", data))
    return ["--config", path], [data, ": row 1:", "'answer' must be a finite number or a string, got nan"]


def _megatron_ckpt_missing(ctx):
    path = ctx.config(_set("model.megatron_ckpt", str(ctx.tmp / "no_ckpt")))
    return ["--config", path], [path, "model.megatron_ckpt", "checkpoint directory not found"]


RAISES_AT_IMPORT = "raise RuntimeError('this plug-in is broken')\n"
NO_KWARG = "def fn(response, answer):\n    return 0.0\n"

CASES: dict[str, Case] = {
    # ---- the config file itself --------------------------------------------------------
    "yaml_syntax_error": _yaml_syntax,
    "config_file_missing": _config_missing,
    "config_file_empty": _cfg_case("", "the file is empty"),
    "top_level_not_a_mapping": _top_level_list,
    "unknown_top_level_key": _cfg_case(_set("trainr", {"seed": 1}), "trainr", "unknown key", "did you mean 'trainer'"),
    "unknown_nested_key": _cfg_case(_set("algorithm.eps_clipp_high", 0.3), "algorithm.eps_clipp_high", "unknown key"),
    "unknown_deeply_nested_key": _cfg_case(_set("algorithm.off_policy_correction.tis_clip", 2.0),
                                           "algorithm.off_policy_correction.tis_clip", "unknown key"),
    "missing_required_section": _cfg_case(_drop("data"), "data", "is required but missing"),
    "section_not_a_mapping": _cfg_case(_set("rollout", 5), "rollout", "expected a mapping"),
    "wrong_type_int": _cfg_case(_set("trainer.num_steps", "ten"), "trainer.num_steps", "expected an integer"),
    "wrong_type_float": _cfg_case(_set("optimizer.lr", "fast"), "optimizer.lr", "expected a number"),
    "wrong_type_bool": _cfg_case(_set("data.shuffle", "yes"), "data.shuffle", "expected true or false"),
    "wrong_type_list": _cfg_case(_set("engine.urls", "http://localhost:1"), "engine.urls", "expected a list"),
    "bad_enum_optimizer": _cfg_case(_set("optimizer.name", "adamw"), "optimizer.name", "expected one of"),
    "bad_enum_engine": _cfg_case(_set("engine.kind", "vllm"), "engine.kind", "'embedded'"),
    "nccl_backend_without_a_gpu": _cfg_case(_set("sync.backend", "nccl"),
                                            "sync.backend", "nccl needs CUDA"),
    "colocate_without_a_gpu": _cfg_case(lambda c: c.update(engine={"kind": "sglang", "colocate": True,
                                                                   "sglang": {"python": sys.executable}},
                                                           sync={"transport": "tensor"}),
                                        "engine.colocate", "needs CUDA"),
    "distributed_optimizer_without_a_gpu": _cfg_case(_set("parallel.use_distributed_optimizer", True),
                                                     "parallel.use_distributed_optimizer", "true needs CUDA"),
    "remote_engine_told_loopback": _cfg_case(lambda c: c.update(engine={"urls": ["http://10.1.2.3:30000"]},
                                                                sync={"transport": "distributed"}),
                                             "sync.master_address", "is on another host"),
    "sglang_interpreter_missing": _cfg_case(lambda cfg: (_set("engine.kind", "sglang")(cfg),
                                                         _set("engine.sglang.python", "/nonexistent/python")(cfg)),
                                            "engine.sglang.python: /nonexistent/python is not an executable interpreter"),
    "bad_enum_dtype": _cfg_case(_set("model.dtype", "fp8"), "model.dtype", "'bfloat16'"),
    "negative_learning_rate": _cfg_case(_set("optimizer.lr", -1e-3), "optimizer.lr", "must be > 0"),
    "zero_temperature": _cfg_case(_set("rollout.temperature", 0), "rollout.temperature", "must be > 0"),
    "bad_override": _override_case("trainer.num_steps", "section.key=value"),
    "override_into_a_scalar": _override_case("trainer.num_steps.x=1", "trainer.num_steps", "is not a section"),
    "override_inf_temperature": _override_case("rollout.temperature=.inf", "rollout.temperature",
                                               "expected a finite number, got inf"),
    "override_nan_learning_rate": _override_case("optimizer.lr=.nan", "optimizer.lr", "expected a finite number"),
    "override_negative_seed": _override_case("trainer.seed=-1", "trainer.seed", "[0, 2^32 - 1]"),
    "override_huge_integer": _override_case("trainer.num_steps=" + "9" * 5000, "trainer.num_steps",
                                            "an integer of 5000 digits"),
    "override_duplicate_key": _override_case("optimizer={lr: 1e-3, lr: 2e-3}", "optimizer: duplicate key 'lr'"),
    "override_max_new_tokens_beyond_context": _override_case("rollout.max_new_tokens=600", "rollout.max_new_tokens",
                                                             "model's context of 512", "set it to at most"),
    "inf_learning_rate": _cfg_case(_set("optimizer.lr", float("inf")), "optimizer.lr", "expected a finite number"),
    "inf_timeout": _cfg_case(_set("engine.request_timeout_s", float("inf")), "engine.request_timeout_s",
                             "expected a finite number"),
    "nan_coefficient": _cfg_case(_set("algorithm.kl_loss_coef", float("nan")), "algorithm.kl_loss_coef",
                                 "expected a finite number"),
    "seed_past_int64": _cfg_case(_set("trainer.seed", 2**70), "trainer.seed", "does not fit a 64-bit integer"),
    "yaml_alias_bomb": _yaml_case(_alias_bomb(), "line ", "expand this value to more than 100000 values"),
    "yaml_deep_nesting": _yaml_case("eval: " + "[" * 5000 + "]" * 5000 + "\n", "line ", "nested deeper than 64"),
    "yaml_huge_integer": _yaml_huge_integer,
    "config_not_a_regular_file": _config_is_a_fifo,
    "yaml_duplicate_key": _yaml_case("trainer: {run_dir: elsewhere, num_steps: 3}\n", "line ",
                                     "duplicate key 'trainer' (first given at line"),
    "eval_max_new_tokens_beyond_context": _cfg_case(
        lambda cfg: _set("eval.sets", [{"name": "held", "path": cfg["data"]["train_file"], "max_new_tokens": 600}])(cfg),
        "eval.sets[0].max_new_tokens", "model's context of 512"),
    # ---- impossible parallel sizes -------------------------------------------------------
    "tp_not_dividing_world_size": _cfg_case(lambda c: c["parallel"].update(tp=2, world_size=3),
                                            "parallel.world_size", "not divisible by tp*pp"),
    "nproc_not_divisible_by_tp": _nproc_not_divisible,
    "global_batch_not_multiple_of_micro_dp": _cfg_case(
        lambda c: c["parallel"].update(world_size=2, micro_batch_size=2, global_batch_size=2),
        "parallel.global_batch_size", "micro_batch_size*dp = 2*2"),
    "global_batch_not_dividing_rollout_batch": _cfg_case(_set("parallel.global_batch_size", 3),
                                                         "parallel.global_batch_size", "must divide the rollout batch"),
    "tp_not_dividing_kv_heads": _cfg_case(lambda c: c["parallel"].update(tp=4, world_size=4),
                                          "parallel.tp", "num_key_value_heads = 2"),
    "sequence_parallel_without_tp": _cfg_case(_set("parallel.sequence_parallel", True),
                                              "parallel.sequence_parallel", "needs tp > 1"),
    # ---- the model directory -------------------------------------------------------------
    "model_dir_missing": _cfg_case(_set("model.hf_dir", "/nonexistent/model"), "model.hf_dir",
                                   "/nonexistent/model", "directory not found"),
    "model_dir_without_config_json": _model_case(lambda d: (d / "config.json").unlink(), "config.json: not found"),
    "config_json_invalid": _model_case(lambda d: (d / "config.json").write_text("{\n  'model_type': qwen2\n"),
                                       "config.json:2: invalid JSON"),
    "config_json_duplicate_key": _model_case(_duplicate_in_config_json, "config.json: duplicate key 'vocab_size'"),
    "config_json_not_an_object": _model_case(lambda d: (d / "config.json").write_text("[1, 2]"),
                                             "expected a JSON object"),
    "partial_model_dir_no_weights": _model_case(_weights_removed, "no model.safetensors"),
    "partial_sharded_model_dir": _model_case(_partial_sharded, "model-00002-of-00002.safetensors",
                                             "partial download"),
    "corrupt_weights_file": _model_case(lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00garbage"),
                                        "unreadable weights"),
    "unsupported_model_type": _model_case(_edit_json("config.json", model_type="gpt2"),
                                          "model_type 'gpt2' is not supported"),
    "tokenizer_bigger_than_vocab": _model_case(_edit_json("config.json", vocab_size=100),
                                               "vocab_size is 100", "do not belong together"),
    "tokenizer_missing": _model_case(_tokenizer_removed, "no tokenizer files"),
    "megatron_ckpt_missing": _megatron_ckpt_missing,
    "resume_path_not_a_checkpoint": _cfg_case(_set("checkpoint.resume", "/nonexistent/ckpt"),
                                              "checkpoint.resume", "not a complete checkpoint"),
    # ---- the dataset -----------------------------------------------------------------------
    "dataset_missing": _dataset_missing,
    "dataset_wrong_extension": _cfg_case(_set("data.train_file", "train.csv"), "data.train_file",
                                         "must end in .jsonl or .parquet"),
    "dataset_bad_json_line": _data_case(_lines(DATA_LINES[0], DATA_LINES[1], '{"prompt": "x", answer: 1}'),
                                        ":3:", "invalid JSON"),
    "dataset_missing_prompt_field": _data_case(_lines(DATA_LINES[0], {"question": "x", "answer": "1"}),
                                               ":2:", "missing field 'prompt'"),
    "dataset_missing_answer_field": _data_case(_lines(*DATA_LINES[:3], {"prompt": "what is 1"}),
                                               ":4:", "missing field 'answer'"),
    "dataset_custom_key_missing": _data_case(_lines(*DATA_LINES), ":1:", "missing field 'question'",
                                             data_key={"prompt_key": "question"}),
    "dataset_empty": _data_case(b"", "the dataset is empty"),
    "dataset_duplicate_key": _data_case(_lines(DATA_LINES[0], '{"prompt": "x", "answer": "1", "answer": "2"}'),
                                        ":2:", "duplicate key 'answer'"),
    "dataset_deep_nesting": _data_case(_lines(DATA_LINES[0], '{"prompt": "x", "answer": "1", "meta": '
                                              + "[" * 100_000 + "]" * 100_000 + "}"), ":2:", "nested too deeply"),
    "dataset_huge_integer": _data_case(_lines(DATA_LINES[0], '{"prompt": "x", "answer": ' + "9" * 5000 + "}"),
                                       ":2:", "an integer has more than 4300 digits"),
    "dataset_lone_surrogate": _data_case(_lines(DATA_LINES[0], '{"prompt": "x \\ud800 y", "answer": "1"}'),
                                         ":2:", "lone UTF-16 surrogate"),
    "dataset_nan_literal": _data_case(_lines(DATA_LINES[0], '{"prompt": "x", "answer": NaN}'), ":2:",
                                      "NaN is not valid JSON"),
    "dataset_inf_answer": _data_case(_lines(DATA_LINES[0], '{"prompt": "x", "answer": 1e999}'), ":2:",
                                     "'answer' must be a finite number or a string, got inf"),
    "dataset_nan_answer_parquet": _parquet_nan_answer,
    "dataset_10mb_line": _data_case(_lines(DATA_LINES[0], {"prompt": "word " * 2_000_000, "answer": "1"}), ":2:",
                                    "(its first 16384 characters), longer than data.max_prompt_length = 512"),
    "dataset_only_blank_lines": _data_case("\n  \n\n", "the dataset is empty"),
    "dataset_line_not_an_object": _data_case(_lines(DATA_LINES[0], '["what is 1", "2"]'), ":2:",
                                             "expected a JSON object"),
    "dataset_prompt_wrong_type": _data_case(_lines({"prompt": 7, "answer": "8"}), ":1:",
                                            "must be a string or a list of chat messages"),
    "dataset_invalid_utf8": _data_case(_lines(DATA_LINES[0]).encode() + b'{"prompt": "\xff\xfe"}\n', ":2:",
                                       "not valid UTF-8"),
    "dataset_prompt_too_long": _data_case(_lines(DATA_LINES[0], {"prompt": " ".join(map(str, range(100))), "answer": "1"}),
                                          ":2:", "longer than data.max_prompt_length = 64",
                                          data_key={"max_prompt_length": 64}),
    "dataset_prompt_longer_than_model_context": _data_case(
        _lines(DATA_LINES[0], {"prompt": " ".join(map(str, range(199))) * 3, "answer": "1"}), ":2:",
        "model's context of 512", data_key={"max_prompt_length": 4096}),
    "episode_longer_than_model_context": _cfg_case(
        lambda cfg: [_set("episodes.kind", "environment")(cfg), _set("episodes.source", "calculator")(cfg),
                     _set("episodes.max_episode_tokens", 600)(cfg)],
        "episodes.max_episode_tokens", "600 after the longest prompt", "model's context of 512",
        "set it to at most"),
    # ---- reward functions ------------------------------------------------------------------
    "reward_unknown_builtin": _reward_case(None, "exact_match", "unknown reward function",
                                           "did you mean 'math_exact_match'"),
    "reward_module_does_not_import": _reward_case(None, "no_such_module_xyz.fn", "cannot import module"),
    "reward_module_raises_at_import": _reward_case(RAISES_AT_IMPORT, "hostile_broken_plugin.fn",
                                                   "RuntimeError: this plug-in is broken"),
    # a grading script's unguarded `sys.exit(main())`: `megatron-grpo train` ended with its code (0), nothing trained
    "reward_module_exits_at_import": _reward_case("import sys\ndef fn(response, answer):\n    return 0.0\nsys.exit(0)\n",
                                                  "hostile_exits_plugin.fn", "module 'hostile_exits_plugin' called "
                                                  "sys.exit(0) while being imported"),
    "reward_attribute_missing": _reward_case(NO_KWARG, "hostile_plugin_attr.nope", "has no attribute 'nope'"),
    "reward_not_callable": _reward_case("fn = 3\n", "hostile_plugin_value.fn", "not a function"),
    "reward_kwargs_do_not_fit": _reward_case(NO_KWARG, "hostile_plugin_kwargs.fn", "kwargs", kwargs={"scale": 2}),
    "reward_all_weights_zero": _cfg_case(_set("reward.functions", [{"name": "format", "weight": 0}]),
                                         "reward.functions", "every weight is 0"),
    # ---- environments and rollout functions: imported and checked before the run directory is written
    "environment_class_missing": _plugin_file_case("envs.py", "class Env:\n    def step(self, r):\n        pass\n",
                                                   "episodes.environment", "Nope", "envs.py:Nope",
                                                   "has no attribute 'Nope'"),
    "environment_without_step": _plugin_file_case("envs.py", "class Env:\n    pass\n", "episodes.environment", "Env",
                                                  "envs.py:Env", "no method step"),
    "environment_import_fails": _plugin_file_case("envs.py", "import no_such_module_xyz\nclass Env:\n    pass\n",
                                                  "episodes.environment", "Env", "envs.py", "no_such_module_xyz"),
    "environment_exits_at_import": _plugin_file_case("envs.py", "import sys\nclass Env:\n    pass\nsys.exit(3)\n",
                                                     "episodes.environment", "Env", "envs.py",
                                                     "loading the file called sys.exit(3)"),
    "rollout_function_import_fails": _plugin_file_case("fn.py", "import no_such_module_xyz\ndef f(*a):\n    pass\n",
                                                       "episodes.rollout_function", "f", "fn.py", "no_such_module_xyz"),
    "rollout_function_missing": _plugin_file_case("fn.py", "def f(engine, prompts, n, sampling, seed):\n    pass\n",
                                                  "episodes.rollout_function", "g", "fn.py", "g"),
    # ---- logging -----------------------------------------------------------------------------
    "wandb_project_without_wandb": _cfg_case(_set("logging.wandb_project", "grpo"), "logging.wandb_project",
                                             "wandb is not installed"),
}

# Run through a real `python -m megatron_grpo.cli train` process (~3 s of interpreter start-up
# each): a representative of every group (config, overrides, parallel sizes, model dir,
# tokenizer, data, rewards) and the inputs that once hung or exhausted a process.
SUBPROCESS_CASES = {
    "yaml_syntax_error", "yaml_alias_bomb", "override_inf_temperature", "nproc_not_divisible_by_tp",
    "partial_model_dir_no_weights", "tokenizer_bigger_than_vocab", "dataset_bad_json_line", "dataset_10mb_line",
    "reward_module_does_not_import", "environment_import_fails", "rollout_function_import_fails",
    "reward_module_exits_at_import",
}


def assert_rejected(code: int, stderr: str, ctx: Ctx, needles: list[str]) -> None:
    assert code == 2, (code, stderr)
    lines = stderr.strip("\n").splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr, got:\n{stderr}"
    line = lines[0]
    assert line.startswith("error: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    assert not ctx.run_dir.exists() or not any(ctx.run_dir.iterdir()), sorted(ctx.run_dir.rglob("*"))


def _no_launch(*args, **kwargs):
    raise AssertionError("pre-flight passed: the ranks would have been started")


@pytest.mark.parametrize("name", sorted(set(CASES) - SUBPROCESS_CASES))
def test_rejected_in_process(name, world, tmp_path, monkeypatch, capfd):
    if name == "wandb_project_without_wandb" and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    ctx = Ctx(tmp_path, world)
    argv, needles = CASES[name](ctx)
    monkeypatch.syspath_prepend(str(ctx.plugin_dir))
    monkeypatch.setattr(cli, "launch_ranks", _no_launch)
    capfd.readouterr()
    code = cli.main(argv)
    out, err = capfd.readouterr()
    assert_rejected(code, err, ctx, needles)
    assert out == ""


@pytest.mark.parametrize("name", sorted(SUBPROCESS_CASES))
def test_rejected_by_the_command(name, world, tmp_path):
    ctx = Ctx(tmp_path, world)
    argv, needles = CASES[name](ctx)
    proc = ctx.train(*argv, timeout=120)
    assert_rejected(proc.returncode, proc.stderr, ctx, needles)
    assert proc.stdout == ""


@pytest.mark.slow  # a whole 1-step run (~20-40 s on 2 busy cores)
def test_a_daemon_a_reward_starts_in_a_session_of_its_own_ends_with_the_run(world, tmp_path):
    """Issue 48: a process a plug-in starts with ``start_new_session=True`` (``setsid``, a daemon)
    leaves its worker's process group, so killing the group missed it: it outlived the run and
    held the ranks' stderr. The launcher is now the subreaper of everything below it, and ends
    what is left once the ranks have: the run exits 0 and no such process remains."""
    marker = f"600.{os.getpid()}{int(time.time() * 1000) % 10**9}7"
    ctx = Ctx(tmp_path, world)
    ctx.plugin("hostile_daemon_plugin", f"""
        import subprocess
        def fn(response, answer):
            subprocess.Popen(["sleep", "{marker}"], start_new_session=True, stdin=subprocess.DEVNULL)
            return 0.0
        """)
    path = ctx.config(lambda cfg: cfg.update(reward={"functions": [{"name": "hostile_daemon_plugin.fn"}]},
                                             engine={"kind": "inprocess"}))
    try:
        proc = ctx.train("--config", path, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        deadline = time.monotonic() + 5
        while (left := _with_marker(marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == [], left
    finally:
        for pid in _with_marker(marker):
            os.kill(pid, 9)


def _with_marker(marker: str) -> list[int]:
    """Pids of live processes whose command line holds ``marker``."""
    import psutil

    return [p.pid for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]


HANGS_AT_IMPORT = """import os, time
def fn(response, answer):
    return 0.0
if os.environ.get("RANK") is not None or os.environ.get("HANG_IN_LAUNCHER"):
    time.sleep(600)
"""


@pytest.mark.slow  # a whole run through torchrun for the rank's half (~20-40 s on 2 busy cores)
def test_a_reward_module_that_never_finishes_importing_is_one_line(world, tmp_path):
    """Issue 48: a reward module's top-level code runs in `megatron-grpo train`'s pre-flight and
    in each rank, and an import that never returned hung the run for good. Now both are under
    ``reward.import_timeout_s``: one line naming the key and the function, exit 2, no traceback,
    no process left (the pre-flight's half: nothing written; the rank's half: the launcher
    prints the rank's line)."""
    for where in ("launcher", "rank"):
        (tmp_path / where).mkdir()
        ctx = Ctx(tmp_path / where, world)
        ctx.plugin("hostile_hangs_plugin", HANGS_AT_IMPORT)

        def edit(cfg):
            cfg["reward"] = {"functions": [{"name": "hostile_hangs_plugin.fn"}], "import_timeout_s": 3}
            cfg["engine"] = {"kind": "inprocess"}
        path = ctx.config(edit)
        proc = ctx.train("--config", path, timeout=240, env={"HANG_IN_LAUNCHER": "1"} if where == "launcher" else {})
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert proc.returncode == 2 and len(lines) == 1, (where, proc.returncode, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, (where, proc.stderr[-3000:])
        assert lines[0].startswith("error: reward.import_timeout_s: building the reward functions "
                                   "(hostile_hangs_plugin.fn) took longer than 3s"), lines
        if where == "launcher":
            assert proc.stderr.strip() == lines[0] and not ctx.run_dir.exists(), proc.stderr
    left = subprocess.run(["pgrep", "-f", "hostile_hangs_plugin"], capture_output=True, text=True).stdout.split()
    assert left == [], left


@pytest.mark.parametrize("argv, needle", [
    (["--world-size", "0"], "--world-size must be >= 1, got 0"),
    (["--world-size", "-2"], "--world-size must be >= 1, got -2"),
    ([], "expand this value to more than 100000 values"),
])
def test_validate_config_refuses_in_one_line(argv, needle, world, tmp_path):
    """`validate-config` prints the resolved config, so an alias bomb once hung it expanding
    the aliases; a world size below 1 once raised ZeroDivisionError."""
    ctx = Ctx(tmp_path, world)
    path = ctx.config(yaml.safe_dump(ctx.base(), sort_keys=False) + (_alias_bomb() if not argv else ""))
    proc = subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "validate-config", *argv, path],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stderr)
    assert proc.stderr.count("\n") == 1 and needle in proc.stderr, proc.stderr


def test_the_docs_table_counts_these_cases():
    """docs/fault_tolerance.md's table of hostile inputs sums to the cases here."""
    text = (ROOT / "docs" / "fault_tolerance.md").read_text()
    assert f"covers {len(CASES)} such inputs ({len(SUBPROCESS_CASES)} through the real command" in text
    table = text[text.index("| class | what was tried | cases |"):].split("\n\n")[0].splitlines()[2:]
    assert sum(int(row.rsplit("|", 2)[1].split()[0]) for row in table) == len(CASES)


def test_at_least_30_cases_and_8_through_the_command():
    assert len(CASES) >= 30 and len(SUBPROCESS_CASES) >= 8
    assert SUBPROCESS_CASES <= set(CASES)


def test_the_good_config_passes_preflight(world, tmp_path, monkeypatch):
    """The cases are not vacuous: the unbroken inputs pass pre-flight (up to the launch)."""
    ctx = Ctx(tmp_path, world)
    launched = []
    monkeypatch.setattr(cli, "launch_ranks", lambda cmd, env: launched.append(cmd) or 0)
    assert cli.main(["--config", ctx.config()]) == 0
    assert launched and "megatron_grpo.train" in launched[0]
    assert [p.name for p in ctx.run_dir.iterdir()] == [".lock"]  # the run directory's lock, and nothing else


# ---- two runs on one run directory ----------------------------------------------------------

def test_a_second_run_on_a_run_dir_in_use_stops_in_one_line(world, tmp_path, monkeypatch, capfd):
    """Issue 48: two runs on one directory destroyed each other's checkpoint and metrics. The
    first start holds the lock while its ranks run (here: while ``_launch_ranks`` runs, which
    writes what rank 0 writes and starts the second run); the second stops at pre-flight with
    one line naming the holder's pid and exit 2, and the first's files are untouched."""
    ctx = Ctx(tmp_path, world)
    path = ctx.config()
    second = {}

    def first_run(cmd, env):
        ctx.run_dir.mkdir(exist_ok=True)
        (ctx.run_dir / "config.yaml").write_text("first\n")
        (ctx.run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in ctx.run_dir.iterdir()}
        monkeypatch.setattr(cli, "launch_ranks", _no_launch)
        capfd.readouterr()
        second["code"] = cli.main(["--config", path])
        second["err"] = capfd.readouterr().err
        second["same"] = before == {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in ctx.run_dir.iterdir()}
        return 0

    monkeypatch.setattr(cli, "launch_ranks", first_run)
    assert cli.main(["--config", path]) == 0
    assert second["code"] == 2 and second["err"].count("\n") == 1, second
    assert second["err"] == (f"error: {path}: trainer.run_dir: {ctx.run_dir} is in use by another run (pid "
                             f"{os.getpid()} holds {ctx.run_dir / '.lock'}); stop it or choose another "
                             "trainer.run_dir\n")
    assert second["same"]


def test_the_lock_of_a_dead_run_is_taken_over(world, tmp_path, monkeypatch):
    """A holder killed with -9 leaves its lock file (and pid) but no lock: flock dies with it."""
    ctx = Ctx(tmp_path, world)
    holder = subprocess.run([sys.executable, "-c", "import os, sys; from megatron_grpo.runtime.run_lock import "
                             "lock_run_dir; lock_run_dir(sys.argv[1]); print(os.getpid(), flush=True); "
                             "os.kill(os.getpid(), 9)", str(ctx.run_dir)],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert holder.returncode == -9 and (ctx.run_dir / ".lock").read_text() == holder.stdout
    monkeypatch.setattr(cli, "launch_ranks", lambda cmd, env: 0)
    assert cli.main(["--config", ctx.config()]) == 0
    assert (ctx.run_dir / ".lock").read_text() == f"{os.getpid()}\n"


def _planted(kind: str, run_dir: Path, victim: Path) -> None:
    """What a careless hand (or another local user, in a shared directory) left in ``run_dir``."""
    run_dir.mkdir()
    if kind == "lock_is_a_link":
        (run_dir / ".lock").symlink_to(victim)
    elif kind == "lock_is_a_fifo":
        os.mkfifo(run_dir / ".lock")
    elif kind == "checkpoints_link_to_nothing":  # a scratch disk that is not mounted
        (run_dir / "checkpoints").symlink_to(victim.parent / "unmounted_scratch" / "checkpoints")
    elif kind == "checkpoints_is_a_file":
        (run_dir / "checkpoints").write_text("not a directory\n")
    elif kind == "step_is_a_file":  # resumed from an older one, then its step failed to save
        (run_dir / "checkpoints").mkdir()
        (run_dir / "checkpoints" / "step_000002").write_text("not a checkpoint\n")


@pytest.mark.parametrize("kind, expected", [
    ("lock_is_a_link", "{run}: cannot create {run}/.lock: it is a symbolic link"),
    ("lock_is_a_fifo", "{run}: {run}/.lock is not a regular file; remove it"),
    ("checkpoints_link_to_nothing", "{run}/checkpoints is a link to {tmp}/unmounted_scratch/checkpoints, which is "
                                    "not a directory: no checkpoint can be resumed from or saved there"),
    ("checkpoints_is_a_file", "{run}/checkpoints is not a directory: no checkpoint can be resumed from or saved there"),
    ("step_is_a_file", "{run}/checkpoints/step_000002 is not a checkpoint directory (a file, or a link to nothing): "
                       "its step could not be saved; remove it"),
])
def test_a_run_dir_that_cannot_hold_the_run_is_refused(kind, expected, world, tmp_path, monkeypatch, capfd):
    """Issue 48, second round. A ``.lock`` planted as a link had the run truncate and overwrite the
    file it named (its pid written there); a FIFO there was an OSError traceback. A ``checkpoints``
    link to an unmounted disk, or a file, made the run start over at step 0 without a word and
    fail at its first save; a file named as a step, resume from the step before and fail to save
    it. Each is one line naming trainer.run_dir, exit 2, nothing written."""
    ctx = Ctx(tmp_path, world)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    _planted(kind, ctx.run_dir, victim)
    before = sorted(p.name for p in ctx.run_dir.iterdir())
    monkeypatch.setattr(cli, "launch_ranks", _no_launch)
    path = ctx.config()
    capfd.readouterr()
    assert cli.main(["--config", path]) == 2
    err = capfd.readouterr().err
    assert err == f"error: {path}: trainer.run_dir: {expected.format(run=ctx.run_dir, tmp=tmp_path)}\n", err
    assert sorted(p.name for p in ctx.run_dir.iterdir()) == before and victim.read_text() == "precious\n"


# ---- reward functions that misbehave at scoring time ------------------------------------------

BAD_REWARDS = """
import math

def raises(response, answer):
    return 1 / 0 if response == "boom" else 0.0

def returns_text(response, answer):
    return "yes"

def returns_none(response, answer):
    return None

def returns_nan(response, answer):
    return math.nan

def returns_inf(response, answer):
    return -math.inf

def exits(response, answer):
    import sys
    sys.exit(0)

def hangs(response, answer):
    while True:
        pass

async def hangs_async(response, answer):
    import asyncio
    await asyncio.sleep(600)

def returns_a_lock(response, answer):
    import threading
    return threading.Lock()

class Unprintable:
    def __str__(self):
        raise RuntimeError("no text for you")

def returns_unprintable(response, answer):
    return Unprintable()

def batch_returns_a_number(samples):
    return 0.5

# a number in a tensor's clothes: the reward 0.5
def tensor_0d(response, answer):
    import torch
    return (torch.tensor([1.0, 0.0]) == 1.0).float().mean()

async def async_tensor_0d(response, answer):
    import torch
    return torch.tensor(0.5)
"""


@pytest.fixture
def bad_rewards(python_module):
    return python_module("hostile_bad_rewards", BAD_REWARDS)


@pytest.mark.parametrize("fn,expected", [
    ("raises", "raised on sample 1: ZeroDivisionError: division by zero"),
    ("returns_text", "returned 'yes' (str) for sample 0; a reward must be a finite number"),
    ("returns_none", "returned 'None' (NoneType) for sample 0"),
    ("returns_nan", "returned 'nan' (float) for sample 0"),
    ("returns_inf", "returned '-inf' (float) for sample 0"),
    # issue 48, second round: a worker that could not send its result back died with a traceback
    # on the run's stderr; an unprintable value escaped as the __str__'s RuntimeError; a batch
    # function's single number read as if the function had raised
    ("returns_a_lock", "failed on sample 0: hostile_bad_rewards.returns_a_lock: its result cannot be sent back to "
                       "the trainer's process (TypeError: cannot pickle '_thread.lock' object)"),
    ("returns_unprintable", "returned a value that cannot be printed (Unprintable) for sample 0"),
    ("batch_returns_a_number", "returned '0.5' (float) for a batch of 2; a batch function returns one number per "
                               "sample"),
])
def test_reward_misbehaving_at_scoring_time(bad_rewards, fn, expected, capfd):
    from megatron_grpo.config.base import build_section
    from megatron_grpo.config.sections import RewardConfig
    from megatron_grpo.rewards import RewardError, RewardScorer

    name = f"{bad_rewards}.{fn}"
    scorer = RewardScorer(build_section(RewardConfig, {"functions": [{"name": "format"}, {"name": name}]},
                                        "reward"))
    try:
        with pytest.raises(RewardError) as err:
            scorer.score(["fine", "boom"], ["1", "2"])
    finally:
        scorer.close()
    line = cli.describe_user_error(err.value, "run.yaml")
    assert line.startswith(f"run.yaml: reward.functions[1] ({name}) {expected}"), line
    assert "\n" not in line
    assert "Traceback" not in capfd.readouterr().err  # nor a worker's, on the run's stderr


def test_numbers_in_numpy_or_torch_clothes_are_rewards():
    """Issue 48, second round: a 0-d tensor ((pred == gold).float().mean()) was reported as the
    function raising "TypeError: iteration over a 0-d tensor", numpy's bool as "returned 'True'
    (bool)" (Python's bool is accepted), a batch function's tensor as a list of refused tensors.
    Each is the number it holds: what the worker sends (``call_in_worker``, run here) and what the
    scorer accepts (``_check_value``, also for an async function's value in the trainer's loop)."""
    import numpy as np
    import torch

    from megatron_grpo.rewards import local
    from megatron_grpo.rewards.scorer import _check_value

    clothes = [np.float32(0.5), np.mean([1.0, 0.0]) > 0.25, (torch.tensor([1.0, 0.0]) == 1.0).float().mean(),
               np.array(0.5), torch.tensor(0.5, requires_grad=True)]
    assert [_check_value(v, "f", 0) for v in clothes] == [0.5, 1.0, 0.5, 0.5, 0.5]
    for value, sent in [(torch.tensor(0.5), 0.5), (torch.full((2,), 0.5), [0.5, 0.5]), (np.bool_(True), True)]:
        local._loaded["fn"] = lambda value=value: value
        status, got = local.call_in_worker((), {})
        assert status == "ok" and [_check_value(v, "f", 0) for v in (got if isinstance(got, list) else [got])] == \
            (sent if isinstance(sent, list) else [sent]), (value, got)
    local._loaded.clear()


@pytest.mark.parametrize("fn", ["tensor_0d", "async_tensor_0d"])
def test_a_0d_tensor_reward_through_the_real_scorer(bad_rewards, fn):
    """The same through the scorer: a plain function in its worker process, an async one in the loop."""
    from megatron_grpo.config.base import build_section
    from megatron_grpo.config.sections import RewardConfig
    from megatron_grpo.rewards import RewardScorer

    scorer = RewardScorer(build_section(RewardConfig, {"functions": [{"name": f"{bad_rewards}.{fn}"}]}, "reward"))
    try:
        assert scorer.score(["a", "b"], ["1", "2"]).rewards == [0.5, 0.5]
    finally:
        scorer.close()


@pytest.mark.parametrize("fn,expected", [
    ("exits", "called sys.exit(0) on sample 0; a reward function returns a number, it does not end the run"),
    ("hangs", "took longer than 0.5s on sample 0 (reward.functions[1].timeout_s); its worker process was killed"),
    ("hangs_async", "took longer than 0.5s on sample 0 (reward.functions[1].timeout_s); the call was cancelled"),
])
def test_reward_that_exits_or_hangs_stops_the_run_in_one_line(bad_rewards, fn, expected):
    """Issue 48: sys.exit(0) in a reward function ended the run with exit code 0, and a hung
    one hung the run until it was stopped by hand. Both are now the same one-line RewardError
    (exit 2) as a raise, the hang past ``reward.functions[i].timeout_s``."""
    import time

    from megatron_grpo.config.base import build_section
    from megatron_grpo.config.sections import RewardConfig
    from megatron_grpo.rewards import RewardError, RewardScorer

    name = f"{bad_rewards}.{fn}"
    deadline = {} if fn == "exits" else {"timeout_s": 0.5}
    scorer = RewardScorer(build_section(RewardConfig, {"functions": [{"name": "format"}, {"name": name, **deadline}]},
                                        "reward"))
    t0 = time.monotonic()
    try:
        with pytest.raises(RewardError) as err:
            scorer.score(["fine", "boom"], ["1", "2"])
    finally:
        scorer.close()
    line = cli.describe_user_error(err.value, "run.yaml")
    assert line == f"run.yaml: reward.functions[1] ({name}) {expected}"
    assert time.monotonic() - t0 < 30  # the worker's start-up (imports) is outside the deadline


@pytest.mark.parametrize("fn", ["hangs", "hangs_async"])
def test_a_hanging_reward_ends_a_big_batch_at_its_first_deadline(bad_rewards, fn):
    """Issue 64: a plain function that never returns, on a 16-sample step at ``timeout_s: 10``,
    ended the run after 175 s: each sample was given the deadline in turn (its worker killed and
    started again each time). docs/rewards.md promises the first call past the deadline stops the
    run: a 256-sample step at 10 s now ends in one deadline and one worker start, not 256."""
    import time

    from megatron_grpo.config.base import build_section
    from megatron_grpo.config.sections import RewardConfig
    from megatron_grpo.rewards import RewardError, RewardScorer

    scorer = RewardScorer(build_section(RewardConfig, {"functions": [{"name": f"{bad_rewards}.{fn}", "timeout_s": 10}]},
                                        "reward"))
    t0 = time.monotonic()
    try:
        with pytest.raises(RewardError, match=r"took longer than 10s on sample 0 "):
            scorer.score(["x"] * 256, ["1"] * 256)
    finally:
        scorer.close()
    assert time.monotonic() - t0 < 30  # one deadline (10 s) and the worker's start-up; 256 deadlines before


def test_an_atexit_hook_that_never_returns_does_not_hold_the_process():
    """Issue 48, second round: a reward module that registered an atexit hook that never returns
    (``atexit.register(worker.join)`` of a thread that runs for ever) kept ``megatron-grpo train``
    and its ranks alive after the run, for good: both import the module, and both end through
    ``exit_now``, which runs the hooks. They now get ``EXIT_HOOKS_TIMEOUT_S`` (1 s here); the
    hooks before the stuck one still run, and the process keeps its exit code."""
    import time

    code = ("import atexit, time; from megatron_grpo.runtime import process; process.EXIT_HOOKS_TIMEOUT_S = 1.0; "
            "atexit.register(time.sleep, 600); atexit.register(print, 'flushed', flush=True); process.exit_now(3)")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 3 and proc.stdout == "flushed\n", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr == ("[megatron-grpo] the exit hooks (atexit) still run after 1s: exiting without them (a "
                           "plug-in's atexit hook that does not return?)\n")
    assert time.monotonic() - started < 60


def test_reward_timeout_is_refused_where_the_function_has_its_own():
    from megatron_grpo.config.base import ConfigError, build_section
    from megatron_grpo.config.sections import RewardConfig
    from megatron_grpo.rewards import RewardScorer

    with pytest.raises(ConfigError, match=r"reward.functions\[0\].timeout_s: is for dotted and file-path functions; "
                                          r"format has its own deadline"):
        RewardScorer(build_section(RewardConfig, {"functions": [{"name": "format", "timeout_s": 5}]}, "reward"))


@pytest.mark.slow
def test_reward_error_in_a_real_run_is_one_line_and_exit_2(world, tmp_path):
    """The real trainer on 2 ranks (dp2): rank 0 scores with a raising reward in step 1. The
    command ends with exit 2 and the error as the last stderr line; torchrun's failure
    report and the other rank's broken-collective traceback are not shown."""
    ctx = Ctx(tmp_path, world)
    ctx.plugin("hostile_run_rewards", "def boom(response, answer):\n    raise KeyError('grader bug')\n")

    def edit(cfg):
        cfg["reward"] = {"functions": [{"name": "hostile_run_rewards.boom"}]}
        cfg["parallel"].update(world_size=2, micro_batch_size=2)
    path = ctx.config(edit)
    proc = ctx.train("--config", path, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"error: {path}: step 1: reward.functions[0] (hostile_run_rewards.boom) raised on sample 0: "
                    "KeyError: 'grader bug'"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("error: ") == 1


PLUGIN_RUN_CASES = {
    # an environment whose step breaks the contract: a number where the observation must be text
    "environment_non_string_observation": (
        "envs.py", "class Bad:\n    def __init__(self, row):\n        pass\n\n"
        "    def step(self, response):\n        return {'observation': 5, 'done': False, 'reward': 0.0}\n",
        lambda cfg, f: cfg.update(episodes={"kind": "environment", "source": f"{f}:Bad", "max_episode_tokens": 16},
                                  engine={"kind": "inprocess"}),
        "step 1: episodes.environment"),
    # a rollout function whose samples hold ids outside the model's vocabulary
    "rollout_function_out_of_vocabulary": (
        "fn.py", "def oov(engine, prompts, n, sampling, seed):\n"
        "    out = engine.generate([p.prompt_ids for p in prompts], n, sampling, sampling_seed=seed)\n"
        "    for s in out:\n        s.output_ids = [10**9 for _ in s.output_ids]\n    return out\n",
        lambda cfg, f: cfg.update(episodes={"kind": "function", "source": f"{f}:oov"}, engine={"kind": "inprocess"}),
        "step 1: episodes.rollout_function"),
    # issue 48, second round: a step reward no float can hold (the worker's check died of the
    # OverflowError: counted as an environment crash, and the run went on)
    "environment_reward_past_float_range": (
        "envs.py", "class Huge:\n    def __init__(self, row):\n        pass\n\n"
        "    def step(self, response):\n        return {'observation': None, 'done': True, 'reward': 10**400}\n",
        lambda cfg, f: cfg.update(episodes={"kind": "environment", "source": f"{f}:Huge", "max_episode_tokens": 16},
                                  engine={"kind": "inprocess"}),
        "step 1: episodes.environment"),
    # issue 48, second round: engine.generate called with text, not ids (a rank's traceback in the
    # engine's code, exit 1)
    "rollout_function_calls_the_engine_with_text": (
        "fn.py", "def text(engine, prompts, n, sampling, seed):\n"
        "    return engine.generate([p.text for p in prompts], n, sampling, sampling_seed=seed)\n",
        lambda cfg, f: cfg.update(episodes={"kind": "function", "source": f"{f}:text"}, engine={"kind": "inprocess"}),
        "step 1: episodes.rollout_function"),
    # issue 64: an environment that hangs on every call (each episode waited out its own deadline,
    # a wave of episodes after another); the step's hang guard ends the run after one wave
    "environment_that_always_hangs": (
        "envs.py", "import time\n\nclass Hangs:\n    def __init__(self, row):\n        pass\n\n"
        "    def step(self, response):\n        time.sleep(3600)\n",
        lambda cfg, f: cfg.update(episodes={"kind": "environment", "source": f"{f}:Hangs", "max_episode_tokens": 16,
                                            "timeout_s": 3}, engine={"kind": "inprocess"}),
        "step 1: episodes.environment"),
    # a reward no float can hold
    "reward_past_float_range": (
        "huge.py", "def huge(response, answer):\n    return 10**400\n",
        lambda cfg, f: cfg.update(reward={"functions": [{"name": f"{f}:huge"}]}),
        "step 1: reward.functions[0]"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLUGIN_RUN_CASES))
def test_a_plugin_that_breaks_its_contract_in_a_real_run_is_one_line_and_exit_2(name, world, tmp_path):
    """Issue 48: an environment, a rollout function or a reward that breaks its contract while
    the run trains ends it with exit 2 and one line naming the step and the plug-in; no
    torchrun report, no traceback (they used to print inside one, exit 1)."""
    file_name, source, edit, needle = PLUGIN_RUN_CASES[name]
    ctx = Ctx(tmp_path, world)
    plugin = ctx.plugin_dir / file_name
    plugin.write_text(source)
    path = ctx.config(lambda cfg: edit(cfg, plugin))
    proc = subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "train", "--config", path],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          cwd=tmp_path, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {path}: {needle}") and file_name in last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("error: ") == 1


@pytest.mark.slow
def test_an_agent_past_the_context_ends_its_episodes_without_a_traceback(world, tmp_path):
    """Issue 48, second round: an agent that sent a conversation past the model's context got a
    500 for each call and each of the SDK's retries, each with uvicorn's traceback on the run's
    stderr (287 lines for 4 episodes of 6 MB messages). Now the SDK's BadRequestError (400) with
    the engine's line: each episode ends as an agent error, said once, and the run completes."""
    ctx = Ctx(tmp_path, world)
    agent = ctx.plugin_dir / "agent.py"
    agent.write_text("def run(client, row):\n"
                     "    messages = list(row['messages']) + [{'role': 'user', 'content': '1 ' * 3000}]\n"
                     "    client.chat.completions.create(model='policy', messages=messages)\n"
                     "    return 1.0\n")
    path = ctx.config(lambda cfg: cfg.update(engine={"kind": "inprocess"}, episodes={
        "kind": "agent", "source": f"{agent}:run", "max_episode_tokens": 16, "observation_role": "user"}))
    proc = subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "train", "--config", path],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "500" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [x for x in proc.stderr.splitlines() if "episodes.agent" in x]
    assert "raised BadRequestError: Error code: 400" in line and "does not fit the context length" in line, line
    assert json.loads((ctx.run_dir / "metrics.jsonl").read_text().splitlines()[-1])["multi_turn/env_errors"] == 4


def test_a_stop_handler_a_plugin_replaced_is_put_back():
    """``stop.reinstall_if_replaced`` (the rank calls it once the reward modules are imported): a
    handler a plug-in replaced is put back and named; in a process that never installed the
    handlers (``megatron-grpo eval``) nothing changes. Run in a subprocess: signal handlers."""
    code = ("import signal; from megatron_grpo.runtime import stop; "
            "assert stop.reinstall_if_replaced() == [] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL; "
            "stop.install(); assert stop.reinstall_if_replaced() == []; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGINT, lambda *a: None); "
            "assert stop.reinstall_if_replaced() == ['SIGTERM', 'SIGINT']; "
            "assert signal.getsignal(signal.SIGTERM) is stop._record is signal.getsignal(signal.SIGINT)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_a_reward_module_that_ignores_sigterm_does_not_keep_the_run_going(world, tmp_path):
    """Issue 48, second round: a reward module whose top-level code ignores SIGTERM (imported by
    rank 0, where the scorer lives) kept the rank training through a stop: the launcher's line
    came only when torchrun killed it, checkpoint.stop_timeout_s later ("before the ranks finished
    their step and saved", nothing saved; 120 s by default). The rank puts its handler back after
    the import, says so, and stops after its step with a checkpoint."""
    import signal as signals
    import time

    ctx = Ctx(tmp_path, world)
    ctx.plugin("hostile_ignores_term", "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n\n"
                                       "def score(response, answer):\n    return 0.5\n")

    def edit(cfg):
        cfg["reward"] = {"functions": [{"name": "hostile_ignores_term.score"}]}
        cfg["trainer"]["num_steps"] = 500
        cfg["checkpoint"] = {"stop_timeout_s": 60}
    path = ctx.config(edit)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ctx.plugin_dir), str(ROOT)])}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_grpo.cli", "train", "--config", path],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        metrics, deadline = ctx.run_dir / "metrics.jsonl", time.monotonic() + 400
        while not (metrics.is_file() and metrics.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:] if proc.poll() else ""
            time.sleep(0.2)
        proc.send_signal(signals.SIGTERM)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143 and time.monotonic() - sent < 50, (proc.returncode, err[-3000:])
    assert "replaced its SIGTERM handler; put back" in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("error: stopped by SIGTERM after step "), err[-3000:]
    assert (ctx.run_dir / "checkpoints" / "latest").is_file()
