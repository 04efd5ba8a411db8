"""Additivity over micro-batches / DP ranks, and float64 gradient checks.

The trainer calls the loss once per part of a mini-batch with the mini-batch's token count N
and sequence count S and sums the results; this must equal one call on the whole batch,
in value AND gradient, for every loss type, reduction, off-policy option and KL/entropy
setting (TRL's tests/invariant idea). Metrics pooled with ``reduce_metrics`` must equal the
whole batch's metrics.
"""

import itertools

import pytest
import torch

from megatron_grpo.losses import compute_policy_loss, reduce_metrics
from tests.support.losses_cases import EXTRAS, LOSS_TYPES, REDUCTIONS, make_batch, make_config


def loss_and_grads(batch, cfg, parts):
    """Sum of the per-part losses and d/d(log_probs, entropy). ``parts``: a number of
    contiguous row chunks, or a list of (rows, width) micro-batches cut to ``width`` positions
    (token-budget micro-batching)."""
    lp = batch["log_probs"].clone().requires_grad_()
    ent = batch["entropy"].clone().requires_grad_()
    n_tokens = int(batch["loss_mask"].sum())
    n_seqs = batch["loss_mask"].shape[0]
    total, metrics = 0.0, []
    if isinstance(parts, int):
        parts = [(rows, batch["loss_mask"].shape[1]) for rows in torch.arange(n_seqs).chunk(parts)]
    for rows, width in parts:
        part = {k: (v[rows, :width] if v.dim() == 2 else v[rows]) for k, v in batch.items()}
        part["log_probs"], part["entropy"] = lp[rows, :width], ent[rows, :width]
        loss, m = compute_policy_loss(config=cfg, num_tokens=n_tokens, num_sequences=n_seqs, **part)
        total = total + loss
        metrics.append(m)
    total.backward()
    return total.detach(), lp.grad, ent.grad, metrics


def token_budget_parts(mask_BT, budget):
    """The trainer's token-budget plan (``trainer.microbatch``) over the rows' valid lengths."""
    from megatron_grpo.trainer.microbatch import token_budget_plan

    plan = token_budget_plan(mask_BT.sum(dim=1).clamp(min=1).tolist(), budget)
    return [(torch.tensor(rows), width) for rows, width in zip(plan.rows, plan.lengths)]


@pytest.mark.parametrize("loss_type, reduction, extras", list(itertools.product(LOSS_TYPES, REDUCTIONS, EXTRAS)))
def test_sum_over_parts_equals_whole_batch(loss_type, reduction, extras):
    cfg = make_config(loss_type, reduction, extras)
    batch = make_batch()
    whole_loss, whole_lp_grad, whole_ent_grad, (whole_metrics,) = loss_and_grads(batch, cfg, 1)
    assert torch.isfinite(whole_loss) and whole_lp_grad.abs().sum() > 0
    # the batch exercises the clip and every configured mask/weight (not a vacuous check)
    assert whole_metrics["clip_ratio"] > 0
    assert loss_type != "ppo" or whole_metrics["pg_clipfrac_lower"] > 0
    engaged = {"token_tis": ["outlier_seq_masked_ratio", "tis_token_clip_high_ratio", "geo_sequence_mask_masked_ratio"],
               "seq_tis": ["tis_seq_clip_high_ratio", "product_sequence_mask_masked_ratio"], "plain": []}
    for key in engaged[extras]:
        assert whole_metrics[key] > 0, key
    # default denominators (None) are this call's counts: identical to the explicit ones
    plain, _ = compute_policy_loss(config=cfg, **batch)
    torch.testing.assert_close(plain.detach(), whole_loss, rtol=1e-12, atol=1e-12)
    for parts in (2, 4, "token_budget"):
        if parts == "token_budget":  # rows regrouped by length, each part cut to its longest row
            parts = token_budget_parts(batch["loss_mask"], 10)
            assert len({w for _, w in parts}) > 1
        loss, lp_grad, ent_grad, metrics = loss_and_grads(batch, cfg, parts)
        torch.testing.assert_close(loss, whole_loss, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(lp_grad, whole_lp_grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(ent_grad, whole_ent_grad, rtol=1e-10, atol=1e-12)
        pooled = reduce_metrics(metrics)
        assert pooled.keys() == whole_metrics.keys()
        for key, value in whole_metrics.items():
            assert pooled[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("loss_type, extras", list(itertools.product(LOSS_TYPES, ["plain", "token_tis", "seq_tis"])))
def test_gradcheck_float64(loss_type, extras):
    reduction = {"ppo": "token_mean", "gspo": "seq_mean_token_mean", "cispo": "seq_mean_token_sum_norm",
                 "sapo": "seq_mean_token_sum"}[loss_type]
    cfg = make_config(loss_type, reduction, extras)
    if loss_type == "cispo":
        # CISPO's gradient is by design NOT the derivative of its value (the IS weight is
        # detached; test_losses_policy checks it by hand). With bounds [1, 1] the weight is the
        # constant 1, so finite differences can check everything around it.
        cfg.cispo_eps_clip_high = 0.0
    batch = make_batch(B=4, T=4, seed=1)
    rest = {k: v for k, v in batch.items() if k not in ("log_probs", "entropy")}

    def f(lp, ent):
        return compute_policy_loss(log_probs=lp, entropy=ent, config=cfg, **rest)[0]

    lp = batch["log_probs"].clone().requires_grad_()
    ent = batch["entropy"].clone().requires_grad_()
    assert torch.autograd.gradcheck(f, (lp, ent), eps=1e-6, atol=1e-7, rtol=1e-5)
