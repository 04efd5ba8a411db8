"""``rollout/episodes/source.py``: the three producers of episodes are one ``EpisodeSource``, and
``build_episode_source`` picks the run's by ``episodes.kind`` (None: single-turn), which with
its ``source``, ``timeout_s`` and ``concurrency`` is checked at load."""

from pathlib import Path

import pytest

from megatron_grpo.config.base import ConfigValueError
from megatron_grpo.config.episodes import EpisodesConfig
from megatron_grpo.rollout.episodes.agent.runner import AgentRunner
from megatron_grpo.rollout.episodes.source import EpisodeSource, build_episode_source
from megatron_grpo.rollout.episodes.environment.loop import EpisodeRunner
from megatron_grpo.rollout.episodes.function.source import RolloutFunction
from tools.tiny import build_tokenizer

FUNCTION = '''
def passthrough(engine, prompts, n, sampling, seed):
    return engine.generate([p.prompt_ids for p in prompts], n, sampling, sampling_seed=seed)
'''


@pytest.mark.parametrize("kind", [EpisodeRunner, AgentRunner, RolloutFunction])
def test_every_producer_is_an_episode_source(kind):
    assert issubclass(kind, EpisodeSource)


def test_the_source_is_chosen_by_the_episodes_kind(tmp_path):
    tok = build_tokenizer()
    build = dict(max_inflight=4, use_template=True, vocab_size=len(tok))
    assert build_episode_source(EpisodesConfig(), tok, **build) is None
    runner = build_episode_source(EpisodesConfig(kind="environment", source="calculator", observation_role="user"),
                                  tok, **build)
    assert type(runner) is EpisodeRunner and runner.max_inflight == 4  # concurrency null: the engine's
    runner.close()
    runner = build_episode_source(EpisodesConfig(kind="environment", source="calculator", observation_role="user",
                                                 concurrency=2), tok, **build)
    assert runner.max_inflight == 2
    fn_file = tmp_path / "fn.py"
    fn_file.write_text(FUNCTION)
    function = build_episode_source(EpisodesConfig(kind="function", source=f"{fn_file}:passthrough"), tok, **build)
    try:
        assert type(function) is RolloutFunction and function.where == f"{fn_file.resolve()}:passthrough"
    finally:
        function.close()
        function.close()  # idempotent: the run and a failed start may both close it
    runner.close()


def test_an_episodes_budget_is_what_the_context_leaves_by_default():
    """Issue 64: the default budget was 512, the demo model's whole context, so any environment on
    the demo was refused at pre-flight. null (the default) is what the context leaves after the
    episode's prompt; a number set is kept."""
    from megatron_grpo.config.episodes import FALLBACK_EPISODE_TOKENS, episode_budget

    assert EpisodesConfig().max_episode_tokens is None
    assert episode_budget(None, 512, 8) == 504 and episode_budget(64, 512, 8) == 64
    assert episode_budget(None, 512, 512) == 1 and episode_budget(None, None, 8) == FALLBACK_EPISODE_TOKENS


AGENT = "def run(client, row):\n    return 0.0\n"


@pytest.mark.parametrize("config", ["demo_cpu.yaml", "demo_cpu_bf16.yaml"])
@pytest.mark.parametrize("kind", ["environment", "agent"])
def test_the_demo_configs_take_an_environment_or_an_agent_with_no_other_key(demo, tmp_path, config, kind):
    """The shipped demo configs with an environment (the built-in calculator) or an SDK agent, and
    no other key, pass the launcher's whole pre-flight. (The tool demos set their own budget.)"""
    from megatron_grpo.preflight import load_experiment
    from megatron_grpo.preflight.run import check_run
    from tests.support.demo_run import demo_overrides

    (tmp_path / "agent.py").write_text(AGENT)
    source = "calculator" if kind == "environment" else f"{tmp_path}/agent.py:run"
    root = Path(__file__).resolve().parent.parent
    cfg = load_experiment(root / "yaml_configs" / config,
                          demo_overrides(demo, tmp_path / "run", 1, f"episodes.kind={kind}", f"episodes.source={source}"))
    check_run(cfg, 1)
    assert not (tmp_path / "run").exists()


SHIPPED = sorted(p.name for p in (Path(__file__).resolve().parent.parent / "yaml_configs").glob("*.yaml"))


@pytest.mark.parametrize("config", SHIPPED)
@pytest.mark.parametrize("kind", ["environment", "agent"])
def test_every_shipped_config_takes_an_environment_or_an_agent_with_no_other_key(tmp_path, config, kind):
    """Issue 64: every YAML we ship loads with an environment (the built-in calculator) or an SDK
    agent set and nothing else (the SmolLM2 configs refused both: their truncated_reward was
    refused with episodes). A config that already runs the other kind (the tool demos) switches
    to this one: kind and source replace the file's."""
    from megatron_grpo.preflight import load_experiment

    (tmp_path / "agent.py").write_text(AGENT)
    source = "calculator" if kind == "environment" else f"{tmp_path}/agent.py:run"
    path = Path(__file__).resolve().parent.parent / "yaml_configs" / config
    cfg = load_experiment(path, [f"episodes.kind={kind}", f"episodes.source={source}"])
    assert (cfg.episodes.kind, cfg.episodes.source) == (kind, source)


def _fn_file(tmp_path) -> str:
    (tmp_path / "fn.py").write_text(FUNCTION)
    return f"{tmp_path / 'fn.py'}:passthrough"


@pytest.mark.parametrize("kind,timeout_s,concurrency", [
    (None, 30.0, 64), ("environment", 30.0, 64), ("agent", 300.0, 8), ("function", 300.0, None)])
def test_the_deadline_and_the_concurrency_default_by_kind(tmp_path, kind, timeout_s, concurrency):
    source = {None: None, "environment": "calculator", "agent": None, "function": _fn_file(tmp_path)}[kind]
    if kind == "agent":
        (tmp_path / "agent.py").write_text(AGENT)
        source = f"{tmp_path / 'agent.py'}:run"
    cfg = EpisodesConfig(kind=kind, source=source)
    assert (cfg.timeout_s, cfg.concurrency, cfg.deadline_s) == (None, None, timeout_s)
    if concurrency is not None:
        assert cfg.episodes_at_once(64) == concurrency
        assert EpisodesConfig(kind=kind, source=source, concurrency=3).episodes_at_once(64) == 3
    assert EpisodesConfig(kind=kind, source=source, timeout_s=7.5).deadline_s == 7.5
    # the read-only views of the old selectors: the source under its kind's name, else None
    views = {"environment": cfg.environment, "agent": cfg.agent, "function": cfg.rollout_function}
    assert {k: v for k, v in views.items() if v is not None} == ({kind: source} if kind else {})


@pytest.mark.parametrize("settings,line", [
    (dict(kind="environment"), "source: is needed with episodes.kind environment: what runs its episodes"),
    (dict(source="calculator"), "kind: is needed with episodes.source 'calculator': environment, agent or function"),
    (dict(kind="environment", source="calculater"), "source: 'calculater' is neither a built-in environment"),
    (dict(kind="function", source="calculator"), "source: 'calculator' is not a file path path/to/file.py:fn"),
    (dict(kind="environment", source="calculator", timeout_s=0), "timeout_s: must be > 0 or null, got 0"),
    (dict(kind="environment", source="calculator", concurrency=0), "concurrency: must be >= 1 or null, got 0"),
    (dict(kind="function", source="FN", concurrency=2), "concurrency: is not used with episodes.kind function "
                                                        "(the function gets the whole step in one call)"),
])
def test_the_kind_and_its_source_are_checked_at_load(tmp_path, settings, line):
    if settings.get("source") == "FN":
        settings = {**settings, "source": _fn_file(tmp_path)}
    with pytest.raises(ConfigValueError) as e:
        EpisodesConfig(**settings)
    assert f"{e.value.key}: {e.value.message}".startswith(line), e.value
