"""DAPO dynamic sampling, soft overlong punishment and overlong filter: the rules against
hand-computed values, the config checks, and ``generate_and_score`` against the real
embedded engine (extra rounds replace zero-variance groups; truncated responses leave the loss)."""


import pytest
import torch

from megatron_grpo.config import AlgorithmConfig, EngineConfig, RolloutConfig, TrainerConfig
from megatron_grpo.config.base import ConfigValueError
from megatron_grpo.config.dapo import DynamicSamplingConfig, OverlongConfig
from megatron_grpo.data.prompts import Prompt
from megatron_grpo.rewards.scorer import ScoredBatch
from megatron_grpo.rollout.dynamic_sampling import (choose_groups, informative_groups, overlong_penalty,
                                                     truncated_rewards)
from tests.support.configs import experiment

N = 4


def test_overlong_penalty_hand_computed():
    # L_max 10, L_cache 4: no penalty up to 6, then -(L - 6) / 4, times the factor 0.5
    got = overlong_penalty(torch.tensor([3, 6, 7, 8, 9, 10]), 10, 4, 0.5)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    # L_cache = L_max: the ramp starts at 0
    assert overlong_penalty(torch.tensor([0, 5, 10]), 10, 10, 1.0).tolist() == [0.0, -0.5, -1.0]


def test_truncated_rewards_hand_computed():
    got = truncated_rewards(torch.tensor([1.0, 0.5, 1.0, -0.25]), torch.tensor([False, True, True, False]), 0.0)
    assert got.tolist() == [1.0, 0.0, 0.0, -0.25]
    assert truncated_rewards(torch.tensor([2.0, 2.0]), torch.tensor([True, False]), -1.0).tolist() == [-1.0, 2.0]


def test_informative_groups_and_choice():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 7.3229351, 7.3229351, 7.3229351, 7.3229351])
    assert informative_groups(rewards, N).tolist() == [False, True, False]  # float ties count as equal
    picks = choose_groups([torch.tensor([True, False]), torch.tensor([False, True, True])], 3)
    assert picks == [(0, 0), (1, 1), (1, 2)]
    # too few informative groups: filled with dropped ones, in generation order
    assert choose_groups([torch.tensor([False, True]), torch.tensor([False, False])], 3) == [(0, 1), (0, 0), (1, 0)]


def test_config_checks():
    with pytest.raises(ConfigValueError, match="buffer_length"):
        RolloutConfig(max_new_tokens=8, overlong=OverlongConfig(buffer_length=9))
    with pytest.raises(ConfigValueError, match="num_generations"):
        RolloutConfig(num_generations=1, dynamic_sampling=DynamicSamplingConfig(enabled=True))
    with pytest.raises(ConfigValueError, match="max_extra_rounds"):
        DynamicSamplingConfig(max_extra_rounds=-1)
    with pytest.raises(ConfigValueError, match="truncated_reward"):
        OverlongConfig(truncated_reward=float("nan"))
    # with episodes too: an episode that ended on a cut (test_multi_turn::test_truncated_reward_grades_...)
    from megatron_grpo.config import EpisodesConfig
    experiment(rollout=RolloutConfig(overlong=OverlongConfig(truncated_reward=0.0)),
               episodes=EpisodesConfig(kind="environment", source="calculator"))


class _PerPromptReward:
    """Reward functions as users write them: prompts marked ``const`` score 0.5 for every
    response (a zero-variance group); the others score the first response token's id."""

    def score_samples(self, samples):
        rewards = [0.5 if s.row.get("const") else float(s.response_ids[0]) for s in samples]
        return ScoredBatch(rewards=rewards, per_function={"r": rewards})


def _prompt(i: int, const: bool) -> Prompt:
    return Prompt(index=i, where=f"test:{i}", text=f"p{i}", prompt_ids=[5 + i, 6, 7], answer="", fields={"const": const})


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from megatron_grpo.models.tokenizer import load_tokenizer
    from megatron_grpo.generation import RolloutClient
    from megatron_grpo.generation.manager import RolloutServerManager
    from tools.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5))
    manager = RolloutServerManager(experiment(engine=EngineConfig(dtype="float32")), model_dir=model_dir,
                                   run_dir=tmp_path_factory.mktemp("run"))
    try:
        (url,) = manager.start()
        yield RolloutClient([url], request_timeout_s=120, max_retries=1), load_tokenizer(model_dir)
    finally:
        manager.stop()


def _cfg(seed=3, **rollout):
    return experiment(rollout=RolloutConfig(num_generations=N, max_new_tokens=6, **rollout),
                      algorithm=AlgorithmConfig(), trainer=TrainerConfig(run_dir="unused", seed=seed))


def _seed_with_cut_and_whole_responses(engine) -> int:
    """The first trainer.seed from 3 whose responses (6 tokens at most) are some cut at the cap,
    some not: the overlong rules then have both kinds to tell apart."""
    for seed in range(3, 30):
        lengths = _run(engine, _cfg(seed), None).batch.loss_mask.sum(dim=1)
        if (lengths == 6).any() and (lengths < 6).any():
            return seed
    raise AssertionError("no seed in 3..29 gave both cut and whole responses")


def _run(engine, cfg, more):
    from megatron_grpo.generation import SamplingParams
    from megatron_grpo.rollout.generate import GenerationContext, generate_and_score

    client, tok = engine
    sampling = SamplingParams(temperature=1.0, max_new_tokens=cfg.rollout.max_new_tokens)
    ctx = GenerationContext(client, sampling, _PerPromptReward(), tok, cfg, more_prompts=more)
    return generate_and_score(ctx, 0, [_prompt(0, True), _prompt(1, False)])


@pytest.mark.slow
def test_dynamic_sampling_replaces_zero_variance_groups(engine):
    drawn = []

    def more():
        drawn.append(len(drawn))
        return [_prompt(10 + len(drawn), True), _prompt(20 + len(drawn), False)]

    result = _run(engine, _cfg(dynamic_sampling=DynamicSamplingConfig(enabled=True, max_extra_rounds=3)), more)
    s = result.stats
    assert drawn == [0]  # one extra round brought the second informative group
    assert s["dynamic_sampling/num_extra_rounds"] == 1 and s["dynamic_sampling/num_groups_dropped"] == 2
    assert s["dynamic_sampling/num_groups_short"] == 0 and s["frac_groups_zero_std"] == 0.0
    batch = result.batch
    assert batch.num_sequences == 2 * N
    assert batch.tokens[:N, 0].unique().tolist() == [6] and batch.tokens[N:, 0].unique().tolist() == [5 + 21]
    assert (batch.advantages.view(2, N).std(dim=1) > 0).all()

    # without the option: the zero-variance group stays, no extra round
    plain = _run(engine, _cfg(), more)
    assert drawn == [0] and plain.stats["frac_groups_zero_std"] == 0.5
    assert not any(k.startswith("dynamic_sampling/") for k in plain.stats)


@pytest.mark.slow
def test_dynamic_sampling_cap_fills_with_dropped_groups(engine):
    always_const = lambda: [_prompt(30, True), _prompt(31, True)]  # noqa: E731
    result = _run(engine, _cfg(dynamic_sampling=DynamicSamplingConfig(enabled=True, max_extra_rounds=2)), always_const)
    assert result.stats["dynamic_sampling/num_extra_rounds"] == 2
    assert result.stats["dynamic_sampling/num_groups_short"] == 1
    assert result.stats["dynamic_sampling/num_groups_dropped"] == 5
    assert result.batch.num_sequences == 2 * N


@pytest.mark.slow
def test_overlong_penalty_and_filter_on_engine_responses(engine):
    seed = _seed_with_cut_and_whole_responses(engine)
    cfg = _cfg(seed, overlong=OverlongConfig(buffer_length=4, penalty_factor=1.0, filter=True))
    result = _run(engine, cfg, None)
    plain = _run(engine, _cfg(seed), None)  # same seeds: the same responses
    lengths = plain.batch.loss_mask.sum(dim=1)
    expected_penalty = overlong_penalty(lengths.long(), 6, 4, 1.0)
    assert result.stats["overlong/penalty_mean"] == pytest.approx(float(expected_penalty.mean()))
    # truncated responses (6 tokens without a stop) carry no loss tokens; the others keep theirs
    truncated = lengths == 6
    assert truncated.any()
    assert result.stats["overlong/num_filtered"] == float(truncated.sum())
    assert (result.batch.loss_mask[truncated] == 0).all()
    assert torch.equal(result.batch.loss_mask[~truncated], plain.batch.loss_mask[~truncated])


@pytest.mark.slow
def test_truncated_reward_replaces_score_and_penalty_of_cut_responses(engine):
    """With the same seeds (the same responses), the truncated ones' rewards become the constant
    whatever their score and soft penalty; the others keep score + penalty; the advantages follow."""
    from megatron_grpo.losses.advantages import compute_advantages

    over = OverlongConfig(buffer_length=4, truncated_reward=-2.0)
    seed = _seed_with_cut_and_whole_responses(engine)
    result = _run(engine, _cfg(seed, overlong=over), None)
    plain = _run(engine, _cfg(seed), None)
    lengths = plain.batch.loss_mask.sum(dim=1)
    truncated = lengths == 6
    assert truncated.any() and (~truncated).any()
    scores = torch.tensor([0.5] * N + plain.batch.tokens[N:, 3].tolist(), dtype=torch.float32)  # _PerPromptReward
    expected = torch.where(truncated, torch.tensor(-2.0), scores + overlong_penalty(lengths.long(), 6, 4, 1.0))
    assert torch.allclose(result.batch.advantages, compute_advantages(expected, N, _cfg().algorithm), atol=1e-6)
    assert result.stats["truncated_ratio"] == float(truncated.float().mean())
