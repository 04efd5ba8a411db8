"""Deprecated config keys (``config/aliases.py``): the keys of the old flat ``rollout:`` section
load, from the file and from the command line, as the keys of the ``engine:``, ``sync:`` and
``episodes:`` sections that replaced them, each announced by exactly one line; giving both
names is a one-line error, unknown keys are refused as before, and the shipped configs and the
reference use the current names."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_grpo.config import ConfigError, ExperimentConfig, aliases, load_config
from megatron_grpo.config.aliases import DEPRECATED_KEYS, key_type, removed_sections
from megatron_grpo.config.experiment import apply_overrides
from megatron_grpo.config.reference import render
from tests.support.configs import BASE

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "yaml_configs").glob("*.yaml"))

# Old key -> (a value it may take, other settings (current keys) the value needs). Every entry
# of the table needs one: a new entry without a sample fails test_every_alias_has_a_sample.
SAMPLES = {
    "rollout.engine": ("sglang", {}),
    "rollout.urls": (["http://127.0.0.1:30000"], {}),
    "rollout.num_servers": (2, {}),
    "rollout.host": ("0.0.0.0", {}),
    "rollout.port": (31000, {}),
    "rollout.api_key": ("k3y", {}),
    "rollout.sglang": ({"tp": 2, "mem_fraction_static": 0.5}, {}),
    "rollout.embedded": ({"max_batch_size": 8}, {}),
    "rollout.dtype": ("bfloat16", {}),
    "rollout.quantization": ("int8", {}),
    "rollout.fp8_format": ("e5m2", {"engine.quantization": "fp8"}),
    "rollout.max_restarts": (5, {}),
    "rollout.max_inflight_requests": (7, {}),
    "rollout.launch_timeout_s": (12.5, {}),
    "rollout.request_timeout_s": (33.0, {}),
    "rollout.max_retries": (4, {}),
    "rollout.base_gpu_id": (3, {}),
    "rollout.colocate": (True, {}),
    "rollout.weight_sync_transport": ("tensor", {}),
    "rollout.weight_sync_backend": ("gloo", {}),
    "rollout.weight_sync_master_address": ("10.0.0.2", {}),
    "rollout.weight_update_bucket_mb": (32, {}),
    "rollout.verify_weights_every": (0, {}),
    "rollout.verify_logprob_tolerance": (0.01, {}),
    "rollout.environment": ("calculator", {}),
    "rollout.rollout_function": ("FN_FILE:fn", {}),  # FN_FILE: a file the test writes
    "rollout.rollout_function_timeout_s": (9.0, {}),
    "rollout.multi_turn.observation_role": ("user", {}),
    "rollout.multi_turn.observation_formatter": ("fmt.py:render", {}),
    "rollout.multi_turn.max_turns": (3, {}),
    "rollout.multi_turn.max_episode_tokens": (99, {}),
    "rollout.multi_turn.env_timeout_s": (7.0, {}),
    "rollout.multi_turn.on_env_error": ("drop", {}),
    "rollout.multi_turn.env_reward": ("replace", {}),
}


@pytest.fixture(autouse=True)
def fresh_announcements(monkeypatch):
    """Each test starts as a fresh process: nothing announced yet."""
    monkeypatch.setattr(aliases, "_announced", set())


def _value(old, tmp_path):
    value, extra = SAMPLES[old]
    if value == "FN_FILE:fn":
        (tmp_path / "fn.py").write_text("def fn(engine, prompts, n, sampling, seed):\n    return []\n")
        value = f"{tmp_path / 'fn.py'}:fn"
    return value, extra


def _base_without(new: str) -> dict:
    """The demo's config (current keys) without ``new``, so that only its old name gives it."""
    raw = copy.deepcopy(BASE)
    *parents, leaf = new.split(".")
    node = raw
    for part in parents:
        node = node.get(part, {})
    node.pop(leaf, None)
    return raw


def _set(raw: dict, dotted: str, value) -> dict:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return raw


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _assert_loaded(cfg, new, value):
    got = _get(cfg, new)
    if isinstance(value, dict):  # a section: each of its keys
        assert {k: getattr(got, k) for k in value} == value
    else:
        assert got == value


def _flow(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def _deprecation_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(aliases.PREFIX)]


def test_every_alias_has_a_sample():
    assert set(SAMPLES) == set(DEPRECATED_KEYS)


def test_every_alias_names_a_current_key_and_no_current_key():
    """A typo in the table (a target that does not exist, or an old name that is still a key)
    fails here rather than in a user's run."""
    for old, new in DEPRECATED_KEYS.items():
        assert key_type(ExperimentConfig, new) is not None, f"{old} -> {new}: no such key"
        assert key_type(ExperimentConfig, old) is None, f"{old} is still a key of the schema"
    assert len(set(DEPRECATED_KEYS.values())) == len(DEPRECATED_KEYS)  # no two old keys share a target
    assert removed_sections(ExperimentConfig) == ["rollout.multi_turn"]


@pytest.mark.parametrize("old", list(DEPRECATED_KEYS))
def test_an_old_key_in_the_file_loads_as_the_new_key_with_one_line(old, tmp_path, capsys):
    new = DEPRECATED_KEYS[old]
    value, extra = _value(old, tmp_path)
    raw = _set(_base_without(new), old, value)
    for key, v in extra.items():
        _set(raw, key, v)
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    _assert_loaded(cfg, new, value)
    assert _deprecation_lines(capsys.readouterr().err) == [f"{aliases.PREFIX} {old} is deprecated; use {new}"]
    load_config(path)  # a command loads its config more than once: still one line
    assert _deprecation_lines(capsys.readouterr().err) == []


@pytest.mark.parametrize("old", list(DEPRECATED_KEYS))
def test_an_old_key_on_the_command_line_loads_as_the_new_key_with_one_line(old, tmp_path, capsys):
    new = DEPRECATED_KEYS[old]
    value, extra = _value(old, tmp_path)
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(_base_without(new)))
    overrides = [f"{key}={_flow(v)}" for key, v in extra.items()] + [f"{old}={_flow(value)}"]
    cfg = load_config(path, overrides)
    _assert_loaded(cfg, new, value)
    assert _deprecation_lines(capsys.readouterr().err) == [f"{aliases.PREFIX} {old} is deprecated; use {new}"]


def test_a_key_under_an_old_section_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(BASE))
    cfg = load_config(path, ["rollout.sglang.tp=2", "rollout.multi_turn={max_turns: 3, env_reward: replace}"])
    assert cfg.engine.sglang.tp == 2 and cfg.episodes.max_turns == 3 and cfg.episodes.env_reward == "replace"
    assert _deprecation_lines(capsys.readouterr().err) == [
        f"{aliases.PREFIX} rollout.sglang.tp is deprecated; use engine.sglang.tp",
        f"{aliases.PREFIX} rollout.multi_turn.max_turns is deprecated; use episodes.max_turns",
        f"{aliases.PREFIX} rollout.multi_turn.env_reward is deprecated; use episodes.env_reward"]


def test_the_old_demo_config_loads_as_the_new_one_with_one_line_per_key(tmp_path, capsys):
    """The demo's config as written before the split (the flat rollout section) resolves to the
    same config as today's file."""
    old = {**copy.deepcopy(BASE), "rollout": {**BASE["rollout"], "engine": BASE["engine"]["kind"],
                                              "weight_sync_transport": BASE["sync"]["transport"],
                                              "weight_update_bucket_mb": BASE["sync"]["bucket_mb"]}}
    del old["engine"], old["sync"]
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    assert load_config(path) == load_config(ROOT / "yaml_configs" / "demo_cpu.yaml")
    assert _deprecation_lines(capsys.readouterr().err) == [
        f"{aliases.PREFIX} rollout.engine is deprecated; use engine.kind",
        f"{aliases.PREFIX} rollout.weight_sync_transport is deprecated; use sync.transport",
        f"{aliases.PREFIX} rollout.weight_update_bucket_mb is deprecated; use sync.bucket_mb"]


@pytest.mark.parametrize("old,new,value", [
    ("rollout.engine", "engine.kind", "sglang"),
    ("rollout.weight_sync_transport", "sync.transport", "tensor"),
    ("rollout.multi_turn.max_turns", "episodes.max_turns", 3),
])
def test_the_old_and_the_new_key_together_are_one_line_naming_both(old, new, value, tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump(_set(_set(copy.deepcopy(BASE), old, value), new, value)))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"{path}: {new}: is given twice: as {new} and as its deprecated name {old}; keep only {new}"
    clean = tmp_path / "clean.yaml"
    clean.write_text(yaml.safe_dump(_base_without(new)))
    for overrides in ([f"{old}={value}", f"{new}={value}"], [f"{new}={value}", f"{old}={value}"]):
        with pytest.raises(ConfigError) as e:
            load_config(clean, overrides)
        line = str(e.value)
        assert "\n" not in line and f"{new}: is given twice: as {new} and as its deprecated name {old}" in line, line


def test_a_section_given_under_both_names_conflicts_only_on_a_shared_key(tmp_path):
    raw = _set(_set(copy.deepcopy(BASE), "rollout.sglang", {"tp": 2}), "engine.sglang", {"mem_fraction_static": 0.5})
    path = tmp_path / "merge.yaml"
    path.write_text(yaml.safe_dump(raw))
    sglang = load_config(path).engine.sglang
    assert (sglang.tp, sglang.mem_fraction_static) == (2, 0.5)
    path.write_text(yaml.safe_dump(_set(raw, "engine.sglang.tp", 4)))
    with pytest.raises(ConfigError, match=r"engine.sglang.tp: is given twice: as engine.sglang.tp and as its "
                                          r"deprecated name rollout.sglang.tp"):
        load_config(path)


def test_the_command_line_still_wins_over_the_file_whichever_names_they_use(tmp_path):
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(BASE))  # engine.kind: inprocess
    assert load_config(path, ["rollout.engine=embedded"]).engine.kind == "embedded"
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(_set(_base_without("engine.kind"), "rollout.engine", "embedded")))
    assert load_config(old, ["engine.kind=sglang"]).engine.kind == "sglang"


@pytest.mark.parametrize("override,message", [
    ("engine.kindd=sglang", "engine.kindd: unknown key; did you mean 'kind'?"),
    ("sync.transprt=tensor", "sync.transprt: unknown key; did you mean 'transport'?"),
    ("episodes.max_turn=3", "episodes.max_turn: unknown key; did you mean 'max_turns'?"),
    ("rollout.weight_sync=tensor", "rollout.weight_sync: unknown key"),
    ("rollout.max_new_tokns=3", "rollout.max_new_tokns: unknown key; did you mean 'max_new_tokens'?"),
    # issue 64: a misspelt old key points at the key it now is
    ("rollout.multi_turn.max_turn=3", "rollout.multi_turn.max_turn: unknown key; did you mean 'episodes.max_turns' "
                                      "(once rollout.multi_turn.max_turns)?"),
    ("rollout.engien=inprocess", "rollout.engien: unknown key; did you mean 'engine.kind' (once rollout.engine)?"),
    ("rollout.weight_sync_transprt=tensor", "rollout.weight_sync_transprt: unknown key; did you mean "
                                            "'sync.transport' (once rollout.weight_sync_transport)?"),
    ("rollout={engien: inprocess}", "rollout.engien: unknown key; did you mean 'engine.kind' (once rollout.engine)?"),
])
def test_unknown_keys_are_refused_as_before(override, message, tmp_path):
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(BASE))
    with pytest.raises(ConfigError) as e:
        load_config(path, [override])
    assert str(e.value).startswith(f"override {override!r}: {message}"), str(e.value)


def test_an_unknown_key_under_an_old_section_in_the_file(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(_set(copy.deepcopy(BASE), "rollout.multi_turn", {"max_turn": 3})))
    with pytest.raises(ConfigError, match=rf"^{path}: rollout.multi_turn.max_turn: unknown key; did you mean "
                                          r"'episodes.max_turns' \(once rollout.multi_turn.max_turns\)\?"):
        load_config(path)


def test_a_misspelt_old_key_in_the_file_names_the_new_key(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(_set(copy.deepcopy(BASE), "rollout.engien", "inprocess")))
    with pytest.raises(ConfigError, match=rf"^{path}: rollout.engien: unknown key; did you mean 'engine.kind' "
                                          r"\(once rollout.engine\)\?$"):
        load_config(path)


def test_old_keys_inside_a_whole_section_override_load_as_the_new_keys(tmp_path, capsys):
    """Issue 64: ``rollout={engine: inprocess, ...}`` (the old keys inside a section given whole on
    the command line) was "unknown key rollout.engine"; they move as in a file, each announced,
    and the section's other keys still replace it."""
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(BASE))
    section = {**BASE["rollout"], "max_new_tokens": 3, "engine": "inprocess", "weight_sync_transport": "tensor",
               "multi_turn": {"max_turns": 3}}
    cfg = load_config(path, ["rollout=" + yaml.safe_dump(section, default_flow_style=True).strip()])
    assert (cfg.engine.kind, cfg.sync.transport, cfg.episodes.max_turns, cfg.rollout.max_new_tokens) == \
        ("inprocess", "tensor", 3, 3)
    err = capsys.readouterr().err
    for old, new in [("rollout.engine", "engine.kind"), ("rollout.weight_sync_transport", "sync.transport"),
                     ("rollout.multi_turn.max_turns", "episodes.max_turns")]:
        assert f"{old} is deprecated; use {new}" in err, err


def test_an_error_at_an_old_key_names_the_override_and_keeps_the_secret(tmp_path):
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(BASE))
    with pytest.raises(ConfigError) as e:
        load_config(path, ["rollout.api_key=-secret"])
    assert str(e.value).startswith("override 'rollout.api_key=<redacted>': engine.api_key: must not start with '-'")
    assert "secret" not in str(e.value).replace("<redacted>", "")


def test_with_change_and_apply_overrides_map_old_keys():
    renamed = []
    raw = apply_overrides(BASE, ["rollout.weight_sync_transport=tensor"], renamed)
    assert raw["sync"]["transport"] == "tensor" and "weight_sync_transport" not in raw["rollout"]
    assert renamed == [("rollout.weight_sync_transport", "sync.transport")]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_use_no_deprecated_key(path, capsys):
    load_config(path)
    assert _deprecation_lines(capsys.readouterr().err) == []


def test_the_reference_lists_every_alias():
    text = render()
    for old, new in DEPRECATED_KEYS.items():
        assert f"| `{old}` | `{new}` |" in text
    assert "| `engine.kind` |" in text and "| `rollout.engine` |" not in text.split("## Deprecated keys")[0]


def test_validate_config_announces_each_old_key_once():
    out = subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "validate-config", "yaml_configs/demo_cpu.yaml",
                          "rollout.weight_sync_transport=disk", "rollout.multi_turn.max_turns=2"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert _deprecation_lines(out.stderr) == [
        f"{aliases.PREFIX} rollout.weight_sync_transport is deprecated; use sync.transport",
        f"{aliases.PREFIX} rollout.multi_turn.max_turns is deprecated; use episodes.max_turns"]
    resolved = yaml.safe_load(out.stdout)
    assert resolved["sync"]["transport"] == "disk" and resolved["episodes"]["max_turns"] == 2
    assert "weight_sync_transport" not in resolved["rollout"]
