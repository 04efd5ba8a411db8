"""The off-policy block (outlier mask -> TIS -> sequence mask) and the mismatch metrics,
against hand-computed values (docs/loss_spec.md#off-policy-correction, #metrics).

Batch: B = 4, T = 3, pi_theta = pi_old (r = 1, so the PPO per-token loss is -A * w), and
rollout log-probs chosen so that rho = pi_old / mu is exactly:

    row 0 (A =  1): rho [1.0, 1.0, 1.0]
    row 1 (A =  2): rho [3.0, 1.0, pad]
    row 2 (A = -1): rho [0.5, 0.8, 1.0]
    row 3 (A =  4): rho [200, pad, pad]

N = 9 valid tokens. Sequence products: 1, 3, 0.4, 200; geometric means: 1, sqrt(3) = 1.732,
0.4^(1/3) = 0.737, 200. Without correction the loss is -(3 + 4 - 3 + 4) / 9 = -8/9.
"""

import math

import pytest
import torch

from megatron_grpo.config import AlgorithmConfig
from megatron_grpo.losses import compute_policy_loss

NAN = float("nan")
RHO = [[1.0, 1.0, 1.0], [3.0, 1.0, 1.0], [0.5, 0.8, 1.0], [200.0, 1.0, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
ADV = torch.tensor([1.0, 2.0, -1.0, 4.0])


def run(off_policy: dict, **cfg):
    old = torch.full((4, 3), math.log(0.25))
    rollout = old - torch.tensor(RHO).log()
    rollout[1, 2], rollout[3, 1:] = NAN, -float("inf")  # padding holds garbage
    lp = old.clone().requires_grad_()
    config = AlgorithmConfig(off_policy_correction=off_policy, **cfg)
    loss, metrics = compute_policy_loss(lp, old, ADV, MASK, config, rollout_log_probs=rollout)
    loss.backward()
    return loss.item(), metrics, lp.grad


def test_mismatch_metrics_without_correction():
    loss, m, _ = run({})
    assert loss == pytest.approx(-8 / 9, abs=1e-6)  # diagnostics only: no correction
    # over the 9 valid tokens (padding excluded): rho = 1,1,1,3,1,0.5,0.8,1,200
    assert m["is_ratio_mean"] == pytest.approx(209.3 / 9, rel=1e-5)  # 23.2556
    assert m["is_ratio_std"] == pytest.approx(62.49222371376584, rel=1e-5)  # population std
    assert m["is_ratio_max"] == pytest.approx(200.0, rel=1e-5)
    assert m["is_ratio_min"] == pytest.approx(0.5, rel=1e-6)
    # rho outside [0.9, 1.1]: 3, 0.5, 0.8 and 200 of the 9 valid tokens (padding excluded)
    assert m["is_ratio_outside_10pct"] == pytest.approx(4 / 9, rel=1e-6)
    # |lmu - lo| = |ln rho|: (ln 3 + ln 2 + ln 1.25 + ln 200) / 9
    assert m["rollout_train_logprobs_abs_diff_mean"] == pytest.approx(0.8125800430100334, rel=1e-5)
    assert m["rollout_train_logprobs_abs_diff_std"] == pytest.approx(1.6284547890290466, rel=1e-5)
    # k3 = mean(rho - ln rho - 1): (0.901388 + 0.193147 + 0.023144 + 193.701683) / 9
    assert m["k3_kl"] == pytest.approx(21.646595675184223, rel=1e-5)
    assert "outlier_seq_masked_ratio" not in m and "tis_token_clip_high_ratio" not in m


def test_token_tis():
    loss, m, grad = run({"tis_ratio_type": "token"})
    # w = min(rho, 2): row 0: -1*(1+1+1) = -3; row 1: -2*(2+1) = -6; row 2: +1*(0.5+0.8+1) = 2.3;
    # row 3: -4*2 = -8  -> -14.7 / 9
    assert loss == pytest.approx(-14.7 / 9, abs=1e-6)
    assert m["tis_token_clip_high_ratio"] == pytest.approx(2 / 9)  # rho = 3 and 200 capped
    assert m["outlier_seq_masked_ratio"] == 0.0
    # the weight is detached: d/dlp = -A w / N
    torch.testing.assert_close(grad[1], torch.tensor([-4.0, -2.0, 0.0]) / 9)
    torch.testing.assert_close(grad[2], torch.tensor([0.5, 0.8, 1.0]) / 9)


def test_outlier_mask_then_token_tis_denominator_is_pre_masking():
    loss, m, grad = run({"tis_ratio_type": "token", "outlier_token_is_threshold_high": 100.0})
    # row 3 (rho 200 > 100) dropped; N stays 9 (tokens counted before off-policy masking)
    assert loss == pytest.approx((-3 - 6 + 2.3) / 9, abs=1e-6)
    assert m["outlier_seq_masked_ratio"] == pytest.approx(0.25)
    assert m["outlier_seq_over_high_ratio"] == pytest.approx(0.25)
    assert m["outlier_seq_under_low_ratio"] == 0.0
    assert m["tis_token_clip_high_ratio"] == pytest.approx(1 / 9)  # only rho = 3 left to cap
    assert grad[3].abs().sum().item() == 0.0


def test_outlier_low_threshold_alone_enables_the_block():
    loss, m, _ = run({"outlier_token_is_threshold_low": 0.6})
    # row 2 has rho 0.5 < 0.6: dropped -> -(3 + 4 + 4) / 9
    assert loss == pytest.approx(-11 / 9, abs=1e-6)
    assert m["outlier_seq_under_low_ratio"] == pytest.approx(0.25)
    assert m["outlier_seq_masked_ratio"] == pytest.approx(0.25)


def test_sequence_tis():
    loss, m, _ = run({"tis_ratio_type": "sequence"})
    # w_i = min(prod rho, 5) = 1, 3, 0.4, 5: -3 - 2*3*2 + 1*0.4*3 - 4*5 = -33.8
    assert loss == pytest.approx(-33.8 / 9, abs=1e-5)
    assert m["tis_seq_clip_high_ratio"] == pytest.approx(0.25)  # row 3 of 4 rows


def test_geometric_mask():
    loss, m, _ = run({"sequence_mask_metric": "geometric"})
    # keep 0.99 <= geo <= 1.01: only row 0 -> -3 / 9
    assert loss == pytest.approx(-3 / 9, abs=1e-6)
    assert m["geo_sequence_mask_masked_ratio"] == pytest.approx(0.75)
    assert m["geo_sequence_mask_over_high_ratio"] == pytest.approx(0.5)  # rows 1 and 3
    assert m["geo_sequence_mask_under_low_ratio"] == pytest.approx(0.25)  # row 2


def test_product_mask():
    loss, m, _ = run({"sequence_mask_metric": "product", "product_mask_low": 0.3, "product_mask_high": 3.5})
    # keep 0.3 <= prod <= 3.5: rows 0, 1, 2 -> (-3 - 4 + 3) / 9
    assert loss == pytest.approx(-4 / 9, abs=1e-6)
    assert m["product_sequence_mask_masked_ratio"] == pytest.approx(0.25)
    assert m["product_sequence_mask_over_high_ratio"] == pytest.approx(0.25)
    assert m["product_sequence_mask_under_low_ratio"] == 0.0


def test_block_order_outlier_then_tis_then_sequence_mask():
    opc = {
        "outlier_token_is_threshold_high": 100.0,
        "tis_ratio_type": "sequence",
        "sequence_mask_metric": "geometric",
        "geo_mask_low": 0.7,
        "geo_mask_high": 1.8,
    }
    loss, m, _ = run(opc)
    # 1. outlier: row 3 dropped. 2. sequence TIS on the remaining mask: row 3 is empty, its
    # product is 1 -> nothing capped (it would be 200 > 5 if TIS ran first). 3. geo mask on the
    # remaining mask: 1, 1.732, 0.737 all in [0.7, 1.8]; row 3 (empty, geo 1) is not counted.
    # loss: -3 - 2*3*2 + 1*0.4*3 = -13.8 over N = 9
    assert loss == pytest.approx(-13.8 / 9, abs=1e-5)
    assert m["tis_seq_clip_high_ratio"] == 0.0
    assert m["outlier_seq_masked_ratio"] == pytest.approx(0.25)
    assert m["geo_sequence_mask_masked_ratio"] == 0.0


@pytest.mark.parametrize("reduction", ["seq_mean_token_mean", "seq_mean_token_sum"])
def test_masked_rows_still_count_in_sequence_denominator(reduction):
    loss, _, _ = run({"sequence_mask_metric": "geometric"}, loss_reduction=reduction)
    # only row 0 survives (-1 per token over 3 tokens); S = 4 rows
    expected = -1.0 / 4 if reduction == "seq_mean_token_mean" else -3.0 / 4
    assert loss == pytest.approx(expected, abs=1e-6)
