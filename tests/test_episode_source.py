"""``rollout/episode_source.py``: the three producers of episodes are one ``EpisodeSource``, and
``build_episode_source`` picks the run's by its ``episodes:`` key (None: single-turn)."""

import pytest

from megatron_grpo.config.episodes import EpisodesConfig
from megatron_grpo.rollout.agents.runner import AgentRunner
from megatron_grpo.rollout.episode_source import EpisodeSource, build_episode_source
from megatron_grpo.rollout.multi_turn import EpisodeRunner
from megatron_grpo.rollout.rollout_function import RolloutFunction
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
