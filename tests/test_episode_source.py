"""``rollout/episodes/source.py``: the three producers of episodes are one ``EpisodeSource``, and
``build_episode_source`` picks the run's by its ``episodes:`` key (None: single-turn)."""

from pathlib import Path

import pytest

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


def test_the_source_is_chosen_by_the_episodes_key(tmp_path):
    tok = build_tokenizer()
    build = dict(max_inflight=4, use_template=True, vocab_size=len(tok))
    assert build_episode_source(EpisodesConfig(), tok, **build) is None
    runner = build_episode_source(EpisodesConfig(environment="calculator", observation_role="user"), tok, **build)
    assert type(runner) is EpisodeRunner
    fn_file = tmp_path / "fn.py"
    fn_file.write_text(FUNCTION)
    function = build_episode_source(EpisodesConfig(rollout_function=f"{fn_file}:passthrough"), tok, **build)
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
    setting = "episodes.environment=calculator" if kind == "environment" else f"episodes.agent={tmp_path}/agent.py:run"
    root = Path(__file__).resolve().parent.parent
    cfg = load_experiment(root / "yaml_configs" / config, demo_overrides(demo, tmp_path / "run", 1, setting))
    check_run(cfg, 1)
    assert not (tmp_path / "run").exists()


SHIPPED = sorted(p.name for p in (Path(__file__).resolve().parent.parent / "yaml_configs").glob("*.yaml"))


@pytest.mark.parametrize("config", SHIPPED)
@pytest.mark.parametrize("kind", ["environment", "agent"])
def test_every_shipped_config_takes_an_environment_or_an_agent_with_no_other_key(tmp_path, config, kind):
    """Issue 64: every YAML we ship loads with an environment (the built-in calculator) or an SDK
    agent set and nothing else (the SmolLM2 configs refused both: their truncated_reward was
    refused with episodes). A config that already runs the other kind says in one line which key
    to set to null."""
    from megatron_grpo.config.base import ConfigError
    from megatron_grpo.preflight import load_experiment

    (tmp_path / "agent.py").write_text(AGENT)
    setting = "episodes.environment=calculator" if kind == "environment" else f"episodes.agent={tmp_path}/agent.py:run"
    path = Path(__file__).resolve().parent.parent / "yaml_configs" / config
    other = "agent" if kind == "environment" else "environment"
    if f"\n  {other}:" in path.read_text():  # the tool demos: one runs an environment, one an agent
        with pytest.raises(ConfigError, match=r"episodes.agent: cannot be combined with episodes.environment or "
                                              r"episodes.rollout_function .*; set the others to null"):
            load_experiment(path, [setting])
        return
    cfg = load_experiment(path, [setting])
    assert getattr(cfg.episodes, kind) is not None
