"""One GRPO optimizer step at TP2, PP2 and DP2 equals the TP1 step: same loss, same
old-policy log-probs, same updated weights (max |delta| <= 1e-5), through the real Megatron
schedule, DDP, megatron-core optimizer, vocab-parallel op and corrected loss. The same holds
for token-budget micro-batches (``parallel.max_tokens_per_microbatch``: rows regrouped by
length, each micro-batch cut to its own length, shapes varying along the pipeline) and for
the step that skips the old-log-prob pass (pi_old = detached pi_theta), and for the loss with
the entropy bonus and the k3 KL term (the CPU demo's loss) at TP2 and PP2, and for packed
micro-batches (``parallel.pack_sequences``: each micro-batch's rows concatenated into one row)
at TP1 and PP2, and for packed rows that share their prompt (``parallel.share_prefix``: two GRPO
groups of four, each prompt run once per micro-batch) at TP1, TP2, PP2 and DP2."""

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.step_equivalence import (MICRO, N_SEQ, REGULARIZED, initial_weights, merged_weights, one_step,
                                            step_batch)

BUDGET = 18  # tokens per micro-batch: 1-3 rows of 4-7 tokens, so the shapes vary
SHARED_BUDGET = 12  # the grouped batch's groups (19 and 18 tokens shared) are cut into chunks of 1-3 rows


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tools.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("hf"), "qwen2", seed=1))


@pytest.fixture(scope="module")
def reference(tiny_hf):
    (ref,) = run_distributed(one_step, 1, tiny_hf, tp=1, pp=1, timeout_s=300)
    return ref


@pytest.fixture(scope="module")
def regularized_reference(tiny_hf):
    (ref,) = run_distributed(one_step, 1, tiny_hf, None, False, True, tp=1, pp=1, timeout_s=300)
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 1)], ids=["tp2", "pp2", "dp2"])
def test_step_matches_tp1(tiny_hf, reference, tp, pp):
    _assert_same_step(run_distributed(one_step, 2, tiny_hf, tp=tp, pp=pp, timeout_s=300), reference, tiny_hf)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_regularized_step_matches_tp1(tiny_hf, regularized_reference, reference, tp, pp):
    """With the entropy bonus and the k3 KL term on (vocab-parallel entropy and its gradient
    across TP ranks; the reference log-probs on the last stage) the TP2 / PP2 step equals TP1's."""
    results = run_distributed(one_step, 2, tiny_hf, None, False, True, tp=tp, pp=pp, timeout_s=300)
    _assert_same_step(results, regularized_reference, tiny_hf, ("entropy", "kl_loss", "k3_kl"))
    # the two terms really changed the step (the comparison covers their gradients)
    worst = max((regularized_reference["weights"][k] - v).abs().max().item() for k, v in reference["weights"].items())
    assert worst > 1e-4, worst
    # the KL-to-reference term is on and non-zero (k3_kl is the rollout-vs-pi_old mismatch, not this term)
    reg = regularized_reference["metrics"]
    assert reg["kl_loss"] > 0.01, reg["kl_loss"]
    # and both terms are in the loss with their weights (docs/loss_spec.md: + kl_coef * KL - entropy_coef * H)
    expected = reference["metrics"]["loss"] + REGULARIZED["kl_loss_coef"] * reg["kl_loss"] - REGULARIZED["entropy_coef"] * reg["entropy"]
    assert abs(reg["loss"] - expected) <= 1e-5, (reg["loss"], expected)


def test_token_budget_plan_varies_shapes():
    """The budget used below really regroups rows into micro-batches of different shapes."""
    from megatron_grpo.trainer.microbatch import plan_micro_batches

    plan = plan_micro_batches(step_batch(), MICRO, BUDGET)
    assert len(set(plan.lengths)) > 1 and len({len(r) for r in plan.rows}) > 1
    assert [r for rows in plan.rows for r in rows] != list(range(N_SEQ))  # reordered


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (2, 1, 1)],
                         ids=["tp1", "tp2", "pp2", "dp2"])
def test_token_budget_step_matches_fixed(tiny_hf, reference, world, tp, pp):
    """Token-budget micro-batches (log-prob pass and update) = fixed micro-batches of 2."""
    results = run_distributed(one_step, world, tiny_hf, BUDGET, tp=tp, pp=pp, timeout_s=300)
    _assert_same_step(results, reference, tiny_hf)
    for r in results:
        if r["old_lp"] is not None and world == 1:
            mask = step_batch().loss_mask > 0
            assert (r["old_lp"][mask] - reference["old_lp"][mask]).abs().max() <= 1e-5
    for r in results:
        if r["metrics"] is not None:  # the budget cut padding: fewer token slots than 8 x 9
            assert r["metrics"]["num_padded_tokens"] < reference["metrics"]["num_padded_tokens"]


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), pytest.param(2, 1, 2, marks=pytest.mark.slow)],
                         ids=["tp1", "pp2"])
def test_packed_step_matches_fixed(tiny_hf, reference, world, tp, pp):
    """Packed micro-batches (log-prob pass and update; at PP2 the packed rows' lengths vary
    along the pipeline) = fixed micro-batches of 2: same loss, grad norm, updated weights."""
    results = run_distributed(one_step, world, tiny_hf, BUDGET, False, False, True, tp=tp, pp=pp, timeout_s=300)
    _assert_same_step(results, reference, tiny_hf)
    for r in results:
        if r["old_lp"] is not None:
            mask = step_batch().loss_mask > 0
            assert (r["old_lp"][mask] - reference["old_lp"][mask]).abs().max() <= 1e-5
        if r["metrics"] is not None:  # packing ran fewer token slots than the row-padded budget
            assert r["metrics"]["num_padded_tokens"] == r["metrics"]["num_sequence_tokens"]


@pytest.mark.parametrize("tp,pp,pack", [(1, 1, False), pytest.param(2, 1, False, marks=pytest.mark.slow),
                                        pytest.param(1, 2, False, marks=pytest.mark.slow), (1, 1, True),
                                        pytest.param(1, 2, True, marks=pytest.mark.slow)],
                         ids=["tp1", "tp2", "pp2", "packed_tp1", "packed_pp2"])
def test_logits_of_the_scored_positions_only_change_nothing(tiny_hf, tp, pp, pack):
    """The output layer runs from each micro-batch's first scored position on
    (``megatron_step.first_scored``: the prompt positions before it are context only), or for
    packed rows at their scored positions alone (``packed_scored``): the same loss, entropy, KL,
    grad norm, updated weights and scored old-policy log-probs as with the logits of every
    position, on fewer positions. With the entropy bonus and the KL term, whose per-token terms
    are put back with zeros; at TP2 (vocab-parallel) and PP2 (the last stage's output layer)."""
    world = tp * pp
    budget = BUDGET if pack else None
    full = run_distributed(one_step, world, tiny_hf, budget, False, True, pack, True, tp=tp, pp=pp, timeout_s=300)
    cut = run_distributed(one_step, world, tiny_hf, budget, False, True, pack, tp=tp, pp=pp, timeout_s=300)
    mask = step_batch().loss_mask > 0
    for f, c in zip(full, cut):
        if f["metrics"] is not None:
            assert 0 < c["logit_positions"] < f["logit_positions"], (c["logit_positions"], f["logit_positions"])
        if f["old_lp"] is not None:
            assert (f["old_lp"][mask] - c["old_lp"][mask]).abs().max() <= 1e-6
    last = next(r for r in full if r["metrics"] is not None)
    reference = {**last, "weights": merged_weights(full)}  # every stage's weights
    _assert_same_step(cut, reference, tiny_hf, ("entropy", "kl_loss", "k3_kl"))


@pytest.fixture(scope="module")
def grouped_reference(tiny_hf):
    """The grouped batch's step, fixed micro-batches of 2 rows (no packing, no sharing), with
    the entropy bonus and the KL term."""
    (ref,) = run_distributed(one_step, 1, tiny_hf, None, False, True, False, False, False, True, tp=1, pp=1,
                             timeout_s=300)
    return ref


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), pytest.param(2, 2, 1, marks=pytest.mark.slow), (2, 1, 2),
                                         pytest.param(2, 1, 1, marks=pytest.mark.slow)],
                         ids=["tp1", "tp2", "pp2", "dp2"])
def test_shared_prefix_step_matches_fixed(tiny_hf, grouped_reference, world, tp, pp):
    """Rows sharing their prompt run it once (``parallel.share_prefix``; log-prob pass and
    update): the same loss, entropy, KL, grad norm, updated weights and old-policy log-probs as
    fixed micro-batches of 2 rows, on fewer token slots than the rows hold."""
    results = run_distributed(one_step, world, tiny_hf, SHARED_BUDGET, False, True, True, False, True, True,
                              tp=tp, pp=pp, timeout_s=300)
    _assert_same_step(results, grouped_reference, tiny_hf, ("entropy", "kl_loss", "k3_kl"))
    mask = step_batch(groups=True).loss_mask > 0
    for r in results:
        if r["old_lp"] is not None and world == 1:
            assert (r["old_lp"][mask] - grouped_reference["old_lp"][mask]).abs().max() <= 1e-5
        if r["metrics"] is not None:  # the prompts ran once: fewer slots than the rows' tokens
            assert r["metrics"]["num_padded_tokens"] < r["metrics"]["num_sequence_tokens"], r["metrics"]


def test_shared_plan_keeps_groups_together():
    """The budget keeps each group whose rows fit in one micro-batch (a group costs its prompt
    once), and cuts the others into chunks of consecutive rows."""
    from megatron_grpo.trainer.microbatch import plan_micro_batches

    batch = step_batch(groups=True)  # lengths 7, 8, 10, 10 | 7, 8, 9, 9; every prompt 6 tokens
    assert plan_micro_batches(batch, MICRO, 18, packed=True, shared=True).rows == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert plan_micro_batches(batch, MICRO, 64, packed=True, shared=True).rows == (tuple(range(N_SEQ)),)
    cut = plan_micro_batches(batch, MICRO, SHARED_BUDGET, packed=True, shared=True)
    assert cut.rows == ((4, 5, 6), (2,), (3,), (0, 1), (7,))  # chunk costs 12, 10, 10, 9, 9


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, BUDGET], ids=["fixed", "budget"])
def test_skipping_old_log_prob_pass_is_exact(tiny_hf, reference, budget):
    """pi_old = detached current log-probs (no old-log-prob pass): same loss, grad norm and
    updated weights as the recomputed pi_old, i.e. same value and same gradient."""
    (result,) = run_distributed(one_step, 1, tiny_hf, budget, True, tp=1, pp=1, timeout_s=300)
    _assert_same_step([result], reference, tiny_hf)


def _assert_same_step(results, reference, tiny_hf, extra_keys=()):
    """Each reporting rank's loss, metrics ``extra_keys``, grad norm and the merged updated
    weights equal ``reference``'s; the step moved the weights."""
    ref_m = reference["metrics"]
    assert reference["applied"] and ref_m["clip_ratio"] == 0.0  # first step: pi_old == pi_theta
    reporters = [r for r in results if r["metrics"] is not None]
    assert reporters
    for r in reporters:
        assert r["applied"]
        assert abs(r["metrics"]["loss"] - ref_m["loss"]) <= 1e-5 * max(1, abs(ref_m["loss"])), (r["metrics"]["loss"], ref_m["loss"])
        for key in ("ppo_kl", "is_ratio_mean", "rollout_train_logprobs_abs_diff_mean", "num_valid_tokens", *extra_keys):
            assert abs(r["metrics"][key] - ref_m[key]) <= 1e-5, key
    weights = merged_weights(results)
    assert set(weights) == set(reference["weights"])
    worst = max((weights[k] - reference["weights"][k]).abs().max().item() for k in weights)
    assert worst <= 1e-5, worst
    for r in reporters:
        assert abs(r["grad_norm"] - reference["grad_norm"]) <= 1e-5 * max(1, reference["grad_norm"]), (
            r["grad_norm"], reference["grad_norm"])
    # the update really moved the weights (the comparison is not vacuous)
    assert any(not torch.equal(reference["weights"][k], v) for k, v in initial_weights(tiny_hf).items())
