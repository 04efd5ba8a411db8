"""The micro-batch plans (``trainer.microbatch``): every row exactly once, the token budget
held, each micro-batch cut to its own longest row, and the log-probs put back in row order."""

import torch

from megatron_grpo.rollout.batch import build_train_batch
from megatron_grpo.trainer.microbatch import (fixed_plan, packed_plan, plan_micro_batches, sequence_lengths,
                                              split, token_budget_plan, unsplit)


def _batch():
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15], [16, 17, 18]]
    outputs = [[20] * 9, [21] * 2, [22] * 5, [], [23] * 1]
    return build_train_batch(prompts, outputs, [[-0.5] * len(o) for o in outputs], torch.arange(5.0), pad_id=0)


def test_sequence_lengths_are_prompt_plus_response():
    assert sequence_lengths(_batch()).tolist() == [12, 4, 9, 2, 4]  # an empty response needs 2


def test_token_budget_plan_docstring_example_and_budget():
    plan = token_budget_plan([10, 3, 4, 9], 20)
    assert plan.rows == ((0, 3), (2, 1)) and plan.lengths == (10, 4)
    lengths = [int(x) for x in torch.randint(2, 60, (40,), generator=torch.Generator().manual_seed(0))]
    plan = token_budget_plan(lengths, 64)
    assert sorted(r for rows in plan.rows for r in rows) == list(range(40))
    for rows, length in zip(plan.rows, plan.lengths):
        assert length == max(lengths[r] for r in rows)
        assert len(rows) * length <= 64 or len(rows) == 1
    assert token_budget_plan([100, 3], 50).rows == ((0,), (1,))  # longer than the budget: alone


def test_packed_plan_docstring_example_and_budget():
    plan = packed_plan([10, 3, 4, 9], 20)
    assert plan.rows == ((0, 3), (2, 1)) and plan.lengths == (10, 4)
    lengths = [int(x) for x in torch.randint(2, 60, (40,), generator=torch.Generator().manual_seed(0))]
    plan = packed_plan(lengths, 128)
    assert sorted(r for rows in plan.rows for r in rows) == list(range(40))
    for rows, length in zip(plan.rows, plan.lengths):
        assert length == max(lengths[r] for r in rows)
        assert sum(lengths[r] for r in rows) <= 128 or len(rows) == 1
    assert len(plan.rows) < len(token_budget_plan(lengths, 128).rows)  # real tokens fill the budget
    assert packed_plan([100, 3], 50).rows == ((0,), (1,))  # longer than the budget: alone
    assert plan_micro_batches(_batch(), 2, 18, packed=True).rows == packed_plan([12, 4, 9, 2, 4], 18).rows


def test_split_cuts_and_unsplit_restores_order():
    batch = _batch()
    plan = plan_micro_batches(batch, 2, 18)
    parts = split(batch, plan)
    assert [tuple(p.tokens.shape) for p in parts] == [(1, 12), (2, 9), (2, 4)]
    for p, rows in zip(parts, plan.rows):
        width = p.tokens.shape[1]
        assert torch.equal(p.tokens, batch.tokens[list(rows), :width])
        assert p.loss_mask.sum() == batch.loss_mask[list(rows)].sum()  # no response token cut off
    back = unsplit([p.rollout_log_probs for p in parts], plan, batch.num_sequences, batch.seq_length - 1)
    assert torch.equal(back, batch.rollout_log_probs)
    fixed = fixed_plan(5, batch.seq_length, 2)
    assert fixed.rows == ((0, 1), (2, 3), (4,)) and fixed.num_padded_tokens == 5 * batch.seq_length
    assert torch.equal(unsplit([p.loss_mask for p in split(batch, fixed)], fixed, 5, batch.seq_length - 1),
                       batch.loss_mask)


def test_mini_batch_order_mixes_groups_the_same_on_every_rank_and_resume():
    """algorithm.shuffle_mini_batches: the permutation depends on (seed, step) alone (every
    rank holds the same broadcast batch and must cut it the same way; a resumed run too),
    changes with the step, and mixes the prompt groups across the optimizer steps; a batch
    that is one mini-batch keeps its order."""
    import torch

    from megatron_grpo.rollout.batch import mini_batch_order

    assert mini_batch_order(16, 16, seed=1, step=0) is None
    order = mini_batch_order(16, 4, seed=1, step=0)
    assert sorted(order.tolist()) == list(range(16))
    assert torch.equal(order, mini_batch_order(16, 4, seed=1, step=0))
    assert not torch.equal(order, mini_batch_order(16, 4, seed=1, step=1))
    assert not torch.equal(order, mini_batch_order(16, 4, seed=2, step=0))
    groups = order.view(4, 4) // 4  # 4 prompts x 4 samples, in generation order; one row per mini-batch
    assert any(len(set(g.tolist())) > 1 for g in groups)
