"""Strict config loading: every malformed config is one line naming file and key, exit 2."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from megatron_grpo.config import AlgorithmConfig, ConfigError
from megatron_grpo.config.experiment import apply_overrides
from megatron_grpo.preflight import load_experiment
from tests.support.configs import BASE, with_change

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "yaml_configs").glob("*.yaml"))


def write(tmp_path, raw, name="exp.yaml"):
    p = tmp_path / name
    p.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return p


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_experiment(path)
    assert cfg.trainer.run_dir


# (change, dotted key the error must name, fragment of the message)
MALFORMED = [
    ("algorithm.eps_clip_hgh", 0.3, "algorithm.eps_clip_hgh", "did you mean 'eps_clip_high'"),
    ("algorithm.eps_clip_high", "big", "algorithm.eps_clip_high", "expected a number"),
    ("algorithm.policy_loss_type", "ppo2", "algorithm.policy_loss_type", "expected one of"),
    ("algorithm.loss_reduction", "mean", "algorithm.loss_reduction", "expected one of"),
    ("algorithm.eps_clip_low", -0.1, "algorithm.eps_clip_low", "must be in [0, 1)"),
    ("algorithm.clip_ratio_c", 0.5, "algorithm.clip_ratio_c", "c > 1"),
    ("algorithm.num_iterations", 0, "algorithm.num_iterations", ">= 1"),
    ("algorithm.off_policy_correction.tis_ratio_type", "tokens", "algorithm.off_policy_correction.tis_ratio_type", "expected one of"),
    ("algorithm.off_policy_correction.geo_mask_low", 1.5, "algorithm.off_policy_correction.geo_mask_low", "geo_mask_low <= 1"),
    ("algorithm.loss_reduction", "seq_mean_token_sum_norm", "algorithm.max_response_length", "required"),
    ("parallel.tp", 3, "parallel.world_size", "not divisible by tp*pp"),
    ("parallel.micro_batch_size", -1, "parallel.micro_batch_size", ">= 1"),
    ("parallel.ep", 0, "parallel.ep", ">= 1"),
    ("parallel.ep", 3, "parallel.ep", "does not divide dp = world_size/(tp*pp*cp) = 1"),
    ("parallel.global_batch_size", 192, "parallel.global_batch_size", "must divide the rollout batch"),
    ("parallel.tp", 1.5, "parallel.tp", "expected an integer"),
    ("parallel.sequence_parallel", "yes", "parallel.sequence_parallel", "expected true or false"),
    ("parallel.distributed_timeout_s", 0, "parallel.distributed_timeout_s", "> 0"),
    ("rollout.temperature", 0, "rollout.temperature", "> 0"),
    ("rollout.top_p", 1.5, "rollout.top_p", "(0, 1]"),
    ("sync.transport", "nccl", "sync.transport", "expected one of"),
    ("engine.urls", ["localhost:3000"], "engine.urls[0]", "http://"),
    ("rollout.num_generations", 0, "rollout.num_generations", ">= 1"),
    ("rollout.mode", "two_step_off_policy", "rollout.mode", "expected one of"),
    ("optimizer.lr", 0, "optimizer.lr", "> 0"),
    ("optimizer.lr_decay_style", "step", "optimizer.lr_decay_style", "expected one of"),
    ("data.train_file", "data.csv", "data.train_file", ".jsonl or .parquet"),
    ("checkpoint.keep_last", 0, "checkpoint.keep_last", ">= 1"),
    ("checkpoint.save_timeout_s", 0, "checkpoint.save_timeout_s", "> 0 or null"),
    ("checkpoint.save_timeout_s", 600, "checkpoint.save_timeout_s", "must be below parallel.distributed_timeout_s = 600"),
    ("trainer.num_steps", "ten", "trainer.num_steps", "expected an integer"),
    ("model.dtype", "fp8", "model.dtype", "expected one of"),
    ("model.dtype", "float16", "model.dtype", "use bfloat16"),
    ("model.attention_backend", "flash", "model.attention_backend", "expected one of"),
    ("parallel.pack_sequences", True, "parallel.pack_sequences", "needs max_tokens_per_microbatch"),
    ("modle.hf_dir", "x", "modle", "did you mean 'model'"),
    ("reward.functions", [], "reward.functions", "at least one"),
    ("reward.functions", [{"nme": "x"}], "reward.functions[0].nme", "did you mean 'name'"),
]


@pytest.mark.parametrize("dotted,value,key,fragment", MALFORMED, ids=[m[0] + "=" + str(m[1]) for m in MALFORMED])
def test_malformed_config_names_key(tmp_path, dotted, value, key, fragment):
    path = write(tmp_path, with_change(dotted, value))
    with pytest.raises(ConfigError) as info:
        load_experiment(path)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(f"{path}: {key}: "), line
    assert fragment in line, line


PACKING = ["parallel.pack_sequences=true", "parallel.max_tokens_per_microbatch=256"]
COMBINATIONS = [  # (overrides, dotted key the error must name, fragment of the message)
    (PACKING + ["parallel.sequence_parallel=true"], "parallel.pack_sequences", "sequence_parallel"),
    (PACKING + ["model.attention_backend=unfused"], "parallel.pack_sequences", "sdpa or auto"),
    (PACKING + ["algorithm.router_replay=true"], "parallel.pack_sequences", "router_replay"),
    (["parallel.sequence_parallel=true", "model.attention_backend=sdpa"], "model.attention_backend",
     "cannot run parallel.sequence_parallel"),
]


@pytest.mark.parametrize("overrides,key,fragment", COMBINATIONS, ids=lambda c: str(c))
def test_attention_and_packing_combinations_are_refused(tmp_path, overrides, key, fragment):
    path = write(tmp_path, apply_overrides(BASE, overrides))
    with pytest.raises(ConfigError) as info:
        load_experiment(path)
    assert str(info.value).startswith(f"{path}: {key}: ") and fragment in str(info.value), str(info.value)


def test_the_save_deadline_defaults_below_the_groups_timeout(tmp_path):
    """checkpoint.save_timeout_s null: 0.9 x parallel.distributed_timeout_s (a rank whose save
    hangs fails in its own line before its peers' collectives time out); explicit: as set."""
    assert load_experiment(write(tmp_path, BASE)).save_timeout_s == 540.0
    raw = apply_overrides(BASE, ["parallel.distributed_timeout_s=100", "checkpoint.save_timeout_s=30"])
    assert load_experiment(write(tmp_path, raw)).save_timeout_s == 30.0


def test_packing_config_loads(tmp_path):
    assert load_experiment(write(tmp_path, apply_overrides(BASE, PACKING))).parallel.pack_sequences


def test_off_policy_mode_with_colocate_names_both_keys(tmp_path):
    raw = apply_overrides(BASE, ["rollout.mode=one_step_off_policy", "engine.colocate=true", "sync.transport=tensor"])
    path = write(tmp_path, raw)
    with pytest.raises(ConfigError) as info:
        load_experiment(path)
    line = str(info.value)
    assert line.startswith(f"{path}: rollout.mode: one_step_off_policy ") and "engine.colocate: true" in line, line
    assert load_experiment(write(tmp_path, with_change("rollout.mode", "one_step_off_policy"), "ok.yaml")).rollout.mode \
        == "one_step_off_policy"


def test_missing_required_section(tmp_path):
    raw = dict(BASE)
    raw.pop("data")
    with pytest.raises(ConfigError, match=r"exp.yaml: .*data"):
        load_experiment(write(tmp_path, raw))


def test_yaml_syntax_error_names_line(tmp_path):
    path = write(tmp_path, "model:\n  hf_dir: x\n  dtype: [float32\n")
    with pytest.raises(ConfigError, match=r"exp.yaml: line \d+, column \d+: YAML syntax error"):
        load_experiment(path)


def test_empty_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError, match="empty"):
        load_experiment(write(tmp_path, ""))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_experiment(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="file not found"):
        load_experiment(tmp_path / "nope.yaml")


def test_overrides_are_validated_like_the_file(tmp_path):
    path = write(tmp_path, BASE)
    cfg = load_experiment(path, ["algorithm.eps_clip_high=0.28", "trainer.num_steps=7"])
    assert cfg.algorithm.eps_clip_high == 0.28 and cfg.trainer.num_steps == 7
    with pytest.raises(ConfigError, match=r"algorithm.eps_clip_high: expected a number"):
        load_experiment(path, ["algorithm.eps_clip_high=high"])
    with pytest.raises(ConfigError, match=r"algorithm.eps_clip_hi: unknown key"):
        load_experiment(path, ["algorithm.eps_clip_hi=0.3"])


def test_override_errors_name_the_override_not_the_file(tmp_path):
    path = write(tmp_path, BASE)
    with pytest.raises(ConfigError) as e:
        load_experiment(path, ["trainer.num_steps=3", "trainer.num_steps=abc"])
    assert str(e.value) == ("override 'trainer.num_steps=abc': trainer.num_steps: expected an integer, "
                            "got str 'abc'")
    with pytest.raises(ConfigError, match=r"^override 'rollout=\{a: 1\}': rollout.a: unknown key"):
        load_experiment(path, ["rollout={a: 1}"])
    # a bad value from the file still names the file, overrides or not
    bad = write(tmp_path, with_change("trainer.num_steps", "abc"))
    with pytest.raises(ConfigError, match=rf"^{bad}: trainer.num_steps: expected an integer"):
        load_experiment(bad, ["algorithm.eps_clip_high=0.28"])


def test_the_api_key_is_redacted_wherever_the_config_is_shown(tmp_path):
    """to_dict feeds validate-config's print, the run's config.yaml, TensorBoard and wandb."""
    cfg = load_experiment(write(tmp_path, with_change("engine.api_key", "hunter2")))
    assert cfg.engine.api_key == "hunter2"
    assert cfg.to_dict()["engine"]["api_key"] == "<redacted>" and "hunter2" not in repr(cfg.to_dict())
    assert cfg.to_dict(redact=False)["engine"]["api_key"] == "hunter2"
    assert load_experiment(write(tmp_path, BASE)).to_dict()["engine"]["api_key"] is None


def test_values_are_never_changed(tmp_path):
    raw = with_change("optimizer.lr", 1)  # an int where a float is declared is kept as given
    cfg = load_experiment(write(tmp_path, raw))
    assert cfg.optimizer.lr == 1
    assert cfg.to_dict()["rollout"]["temperature"] == BASE["rollout"]["temperature"]


def test_world_size_from_launcher(tmp_path):
    # micro-batches of 16: dp = 2 (world size 4 at tp 2) and 4 split the global batch of 64
    path = write(tmp_path, apply_overrides(with_change("parallel.world_size", None), ["parallel.micro_batch_size=16"]))
    assert load_experiment(path, world_size=4).parallel.tp == 2
    with pytest.raises(ConfigError, match=r"parallel.tp: tp\*pp\*cp = 2\*1\*1 does not divide the world size 3"):
        load_experiment(path, world_size=3)
    ep4 = write(tmp_path, apply_overrides(with_change("parallel.world_size", None),
                                          ["parallel.ep=4", "parallel.micro_batch_size=16"]), "ep.yaml")
    assert load_experiment(ep4, world_size=8).parallel.ep == 4
    with pytest.raises(ConfigError, match=r"parallel.ep: 4 does not divide dp = world size/\(tp\*pp\*cp\) = 2"):
        load_experiment(ep4, world_size=4)


def test_deprecated_tis_keys_map_with_warning():
    with pytest.warns(DeprecationWarning, match="use_tis"):
        cfg = AlgorithmConfig(use_tis=True, tis_imp_ratio_cap=3.0)
    assert cfg.off_policy_correction.tis_ratio_type == "token"
    assert cfg.off_policy_correction.token_tis_ratio_clip_high == 3.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="use_tis: conflicts"):
            AlgorithmConfig(use_tis=True, off_policy_correction={"tis_ratio_type": "sequence"})


def test_algorithm_config_accepts_yaml_section():
    cfg = AlgorithmConfig(**BASE["algorithm"])
    assert cfg.off_policy_correction.tis_ratio_type == "token"
    assert cfg.off_policy_correction.enabled


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_grpo.cli", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_validate_config_cli_prints_resolved_config():
    out = run_cli("validate-config", "yaml_configs/demo_cpu.yaml", "trainer.num_steps=3")
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["trainer"]["num_steps"] == 3
    assert resolved["algorithm"]["off_policy_correction"]["geo_mask_low"] == 0.99  # defaults shown


def test_validate_config_cli_error_is_one_line_exit_2(tmp_path):
    path = write(tmp_path, with_change("parallel.tp", 3))
    out = run_cli("validate-config", str(path))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "parallel.world_size" in out.stderr
    assert out.stdout == ""


def test_unknown_subcommand():
    out = run_cli("validate-confg")
    assert out.returncode == 2 and "did you mean 'validate-config'" in out.stderr


def test_exponent_floats_without_a_dot_are_numbers(tmp_path):
    # YAML 1.2 reading: PyYAML's default would make these strings and reject them
    cfg = load_experiment(write(tmp_path, BASE), ["optimizer.lr=2e-3", "optimizer.adam_eps=1E-8"])
    assert cfg.optimizer.lr == 2e-3 and cfg.optimizer.adam_eps == 1e-8
