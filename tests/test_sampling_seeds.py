"""The sampler seeds of generation rounds (``rollout.generate.sampling_seed``): response k of a
round is seeded ``base + k`` (the engines' and the HTTP client's convention), so every round
must own a range of seeds no other round touches. Before, consecutive steps' bases were one
apart: step s+1's response k drew step s's response k+1's stream."""

from megatron_grpo.rollout.generate import ROUNDS_PER_STEP, SEED_SPACE, SEEDS_PER_ROUND, sampling_seed


def test_every_round_owns_its_range_of_seeds():
    bases = [sampling_seed(1234, step, r) for step in range(2000) for r in range(ROUNDS_PER_STEP)]
    assert len(set(bases)) == len(bases)
    assert all(b % SEEDS_PER_ROUND == 0 and 0 <= b and b + SEEDS_PER_ROUND - 1 < SEED_SPACE for b in bases)
    # the old overlap: step s+1's response k was step s's response k+1
    assert sampling_seed(1234, 6) + 0 != sampling_seed(1234, 5) + 1
    runs = {sampling_seed(seed, 0) for seed in (0, 1, 2, 7, 1234)}
    assert len(runs) == 5  # different trainer.seed, different streams


def test_the_seeds_are_a_pure_function_of_seed_step_and_round():
    assert sampling_seed(7, 40, 2) == sampling_seed(7, 40, 2)  # a resumed run redraws the same responses
    late = {sampling_seed(7, 3, r) for r in range(ROUNDS_PER_STEP, ROUNDS_PER_STEP + 50)}
    assert len(late) == 50 and all(b % SEEDS_PER_ROUND == 0 and b < SEED_SPACE for b in late)
    assert not late & {sampling_seed(7, 3, r) for r in range(ROUNDS_PER_STEP)}
