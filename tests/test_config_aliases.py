"""Deprecated config keys (``config/aliases.py``): the keys of the old flat ``rollout:`` section
load, from the file and from the command line, as the keys of the ``engine:``, ``sync:`` and
``episodes:`` sections that replaced them, and the old selectors, timeouts and workers of
``episodes:`` as its ``kind``/``source``, ``timeout_s`` and ``concurrency`` (an old selector
implies the kind), each announced by exactly one line; giving both names is a one-line error,
unknown keys are refused as before, and the shipped configs and the reference use the current
names."""

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
    "episodes.environment": ("calculator", {}),
    "episodes.agent": ("AGENT_FILE:run", {}),  # AGENT_FILE: a file the test writes
    "episodes.rollout_function": ("FN_FILE:fn", {}),
    "episodes.env_timeout_s": (7.5, {}),
    "episodes.agent_timeout_s": (8.5, {}),
    "episodes.rollout_function_timeout_s": (9.5, {}),
    "episodes.agent_workers": (3, {}),
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
    if value == "AGENT_FILE:run":
        (tmp_path / "agent.py").write_text("def run(client, row):\n    return 0.0\n")
        value = f"{tmp_path / 'agent.py'}:run"
    return value, extra


def _line(old: str, new: str) -> str:
    return f"{aliases.PREFIX} {old} is deprecated; use {aliases.replacement(old, new)}"


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


def _assert_loaded(cfg, new, value, old=None):
    got = _get(cfg, new)
    if isinstance(value, dict):  # a section: each of its keys
        assert {k: getattr(got, k) for k in value} == value
    else:
        assert got == value
    if old in aliases.IMPLIED_KIND:  # an old selector sets the kind too
        assert cfg.episodes.kind == aliases.IMPLIED_KIND[old]


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
    shared = {new for new in DEPRECATED_KEYS.values() if list(DEPRECATED_KEYS.values()).count(new) > 1}
    assert shared == {"episodes.source", "episodes.timeout_s"}  # issue 62: one selector, one deadline
    assert set(aliases.IMPLIED_KIND) == {old for old, new in DEPRECATED_KEYS.items() if new == "episodes.source"}
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
    _assert_loaded(cfg, new, value, old)
    assert _deprecation_lines(capsys.readouterr().err) == [_line(old, new)]
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
    _assert_loaded(cfg, new, value, old)
    assert _deprecation_lines(capsys.readouterr().err) == [_line(old, new)]


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
    ("episodes.enviroment=calculator", "episodes.enviroment: unknown key; did you mean 'episodes.kind: environment "
                                       "with episodes.source' (once episodes.environment)?"),
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
        assert f"| `{old}` | `{aliases.replacement(old, new)}` |" in text
    assert "| `episodes.environment` | `episodes.kind: environment with episodes.source` |" in text
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


# ---- issue 62: the old selectors of `episodes:` imply its kind ----------------------------------

TOOLS = ROOT / "yaml_configs" / "demo_cpu_tools.yaml"  # episodes.kind: environment, source: calculator
SELECTOR_LINE = f"{aliases.PREFIX} episodes.environment is deprecated; use episodes.kind: environment with episodes.source"


def _agent(tmp_path) -> str:
    (tmp_path / "agent.py").write_text("def run(client, row):\n    return 0.0\n")
    return f"{tmp_path / 'agent.py'}:run"


def _episodes_file(tmp_path, episodes: dict) -> Path:
    path = tmp_path / "episodes.yaml"
    path.write_text(yaml.safe_dump({**copy.deepcopy(BASE), "episodes": episodes}))
    return path


def test_an_old_selector_loads_as_kind_and_source_from_a_file_an_override_and_a_section(tmp_path, capsys):
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(BASE))
    for cfg in (load_config(_episodes_file(tmp_path, {"environment": "calculator", "env_timeout_s": 12})),
                load_config(path, ["episodes.environment=calculator", "episodes.env_timeout_s=12"]),
                load_config(path, ["episodes={environment: calculator, env_timeout_s: 12}"])):
        assert (cfg.episodes.kind, cfg.episodes.source, cfg.episodes.deadline_s) == ("environment", "calculator", 12)
    # one line per old key, once per process however many loads name it
    assert _deprecation_lines(capsys.readouterr().err) == [
        SELECTOR_LINE, f"{aliases.PREFIX} episodes.env_timeout_s is deprecated; use episodes.timeout_s"]


def test_an_old_selector_agreeing_with_the_kind_is_kept_and_one_disagreeing_is_one_line(tmp_path):
    assert load_config(_episodes_file(tmp_path, {"kind": "environment", "environment": "calculator"})) \
        .episodes.source == "calculator"
    path = _episodes_file(tmp_path, {"kind": "agent", "environment": "calculator"})
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (f"{path}: episodes.kind: is agent but the deprecated episodes.environment implies "
                            "environment; keep only episodes.kind with episodes.source")
    path = _episodes_file(tmp_path, {"kind": "environment", "source": "calculator", "environment": "guess_number"})
    with pytest.raises(ConfigError, match=r": episodes.source: is given twice: as episodes.source and as its "
                                          r"deprecated name episodes.environment; keep only episodes.source$"):
        load_config(path)
    path = _episodes_file(tmp_path, {"environment": "calculator", "agent": _agent(tmp_path)})
    with pytest.raises(ConfigError, match=r": episodes.source: is given twice: as its deprecated names "
                                          r"episodes.environment and episodes.agent; keep only episodes.source$"):
        load_config(path)
    path = _episodes_file(tmp_path, {"env_timeout_s": 10, "agent_timeout_s": 100})
    with pytest.raises(ConfigError, match=r"episodes.timeout_s: is given twice: as its deprecated names "
                                          r"episodes.env_timeout_s and episodes.agent_timeout_s"):
        load_config(path)


@pytest.mark.parametrize("overrides", [["episodes.kind=agent", "episodes.environment=calculator"],
                                       ["episodes.environment=calculator", "episodes.kind=agent"]])
def test_an_old_selector_and_another_kind_on_the_command_line_are_one_line(tmp_path, overrides):
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(BASE))
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    line = str(e.value)
    assert "\n" not in line and line.endswith("episodes.kind: is agent but the deprecated episodes.environment "
                                              "implies environment; keep only episodes.kind with episodes.source")


def test_an_old_selector_on_the_command_line_replaces_the_files_kind(tmp_path):
    """The command line wins over the file, whichever names either uses."""
    agent = _agent(tmp_path)
    cfg = load_config(TOOLS, [f"episodes.agent={agent}"])
    assert (cfg.episodes.kind, cfg.episodes.source) == ("agent", agent)
    cfg = load_config(TOOLS, ["episodes.kind=environment", "episodes.environment=guess_number"])  # agreeing: kept
    assert (cfg.episodes.kind, cfg.episodes.source) == ("environment", "guess_number")


def test_a_null_old_selector_turns_off_only_its_own_kind(tmp_path, capsys):
    """``episodes.environment: null`` said "no environment": it clears the kind when the config's
    kind is environment and sets nothing otherwise (an old file's nulls beside the one set)."""
    assert load_config(TOOLS, ["episodes.environment=null"]).episodes.kind is None
    assert load_config(TOOLS, ["episodes.agent=null"]).episodes.source == "calculator"
    agent = _agent(tmp_path)
    cfg = load_config(_episodes_file(tmp_path, {"environment": None, "rollout_function": None, "agent": agent}))
    assert (cfg.episodes.kind, cfg.episodes.source) == ("agent", agent)
    path = tmp_path / "new.yaml"
    path.write_text(yaml.safe_dump(BASE))
    cfg = load_config(path, [f"episodes={{environment: null, agent: {agent}, agent_workers: 2}}"])
    assert (cfg.episodes.kind, cfg.episodes.source, cfg.episodes.concurrency) == ("agent", agent, 2)
    lines = _deprecation_lines(capsys.readouterr().err)
    assert len(lines) == len(set(lines)) and SELECTOR_LINE in lines and \
        f"{aliases.PREFIX} episodes.agent_workers is deprecated; use episodes.concurrency" in lines


def test_validate_config_takes_an_old_selector_with_one_line():
    out = subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "validate-config", "yaml_configs/demo_cpu.yaml",
                          "episodes.environment=calculator"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert _deprecation_lines(out.stderr) == [SELECTOR_LINE]
    resolved = yaml.safe_load(out.stdout)["episodes"]
    assert (resolved["kind"], resolved["source"]) == ("environment", "calculator") and "environment" not in resolved
