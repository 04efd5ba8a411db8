"""Policy losses, reductions, dual clip, KL and entropy terms against hand-computed values.

The base batch (B = 2, T = 3); pi_old = 0.5 everywhere, pi_theta = 0.5 r, so the PPO ratios
are exactly the r below. Row 0 has A = +1 and a padded last position holding NaN / inf,
row 1 has A = -2. eps_clip_low = eps_clip_high = 0.2 (band [0.8, 1.2]) unless stated.

    row 0 (A = +1): r = [1.5, 0.9, pad]
    row 1 (A = -2): r = [0.5, 1.1, 1.25]
"""

import math

import pytest
import torch

from megatron_grpo.config import AlgorithmConfig
from megatron_grpo.losses import compute_policy_loss

NAN, INF = float("nan"), float("inf")
RATIOS = [[1.5, 0.9, 1.0], [0.5, 1.1, 1.25]]
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
ADV = torch.tensor([1.0, -2.0])


def batch(ratios=RATIOS):
    old = torch.full((2, 3), math.log(0.5))
    lp = (old + torch.tensor(ratios).log()).clone()
    lp[0, 2], old[0, 2] = NAN, INF  # padding may hold anything
    return lp.requires_grad_(), old


def run(cfg, ratios=RATIOS, **kw):
    lp, old = batch(ratios)
    loss, metrics = compute_policy_loss(lp, old, ADV, MASK, cfg, **kw)
    loss.backward()
    return loss, metrics, lp.grad


def test_ppo_token_mean_value_gradient_and_metrics():
    # Per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   row 0: r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped high); r=0.9 -> -0.9
    #   row 1: r=0.5 -> max(1.0, 1.6) = 1.6 (clipped low); r=1.1 -> 2.2; r=1.25 -> max(2.5, 2.4) = 2.5
    # sum = 4.2 over N = 5 tokens
    loss, metrics, grad = run(AlgorithmConfig())
    assert loss.item() == pytest.approx(0.84, abs=1e-6)
    # d/dlp: clipped tokens 0, others -A r / N: -0.9/5, 2.2/5, 2.5/5; padded 0
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.18, 0.0], [0.0, 0.44, 0.5]]))
    assert metrics["clip_ratio_low"] == pytest.approx(0.2)
    assert metrics["clip_ratio_high"] == pytest.approx(0.2)
    assert metrics["clip_ratio"] == pytest.approx(0.4)
    assert metrics["pg_clipfrac_lower"] == 0.0
    # ppo_kl = mean(lo - lp) = -(ln 1.5 + ln 0.9 + ln 0.5 + ln 1.1 + ln 1.25) / 5
    assert metrics["ppo_kl"] == pytest.approx(0.014917771398214496, abs=1e-6)
    assert metrics["num_valid_tokens"] == 5 and metrics["num_sequences"] == 2


@pytest.mark.parametrize(
    "reduction, extra, expected",
    [
        # token sums per row: row 0 = -2.1 (2 tokens), row 1 = 6.3 (3 tokens)
        ("token_mean", {}, 4.2 / 5),
        ("seq_mean_token_mean", {}, (-2.1 / 2 + 6.3 / 3) / 2),  # 0.525
        ("seq_mean_token_sum", {}, (-2.1 + 6.3) / 2),  # 2.1
        ("seq_mean_token_sum_norm", {"max_response_length": 5}, (-2.1 + 6.3) / 2 / 5),  # 0.42
    ],
)
def test_reductions_hand_values(reduction, extra, expected):
    loss, _, _ = run(AlgorithmConfig(loss_reduction=reduction, **extra))
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_global_denominators_override_local_counts():
    lp, old = batch()
    # token_mean with N = 10 (a mini-batch twice this size): 4.2 / 10
    loss, _ = compute_policy_loss(lp, old, ADV, MASK, AlgorithmConfig(), num_tokens=10)
    assert loss.item() == pytest.approx(0.42, abs=1e-6)
    cfg = AlgorithmConfig(loss_reduction="seq_mean_token_sum")
    loss, _ = compute_policy_loss(lp, old, ADV, MASK, cfg, num_sequences=torch.tensor(6))
    assert loss.item() == pytest.approx(4.2 / 6, abs=1e-6)


def test_dual_clip():
    # row 1 last ratio 4.0: clip loss max(-(-2)*4, 2*1.2) = 8 > -A c = 2*3 = 6 -> bounded at 6
    ratios = [[1.5, 0.9, 1.0], [0.5, 1.1, 4.0]]
    loss, metrics, grad = run(AlgorithmConfig(clip_ratio_c=3.0), ratios)
    # -1.2 - 0.9 + 1.6 + 2.2 + 6 = 7.7 over 5
    assert loss.item() == pytest.approx(7.7 / 5, abs=1e-6)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.2)
    assert grad[1, 2].item() == 0.0  # the dual-clipped token has no gradient
    loss, metrics, grad = run(AlgorithmConfig(), ratios)  # without dual clip: 8
    assert loss.item() == pytest.approx(9.7 / 5, abs=1e-6)
    assert metrics["pg_clipfrac_lower"] == 0.0
    assert grad[1, 2].item() == pytest.approx(2 * 4.0 / 5, rel=1e-6)


def test_gspo():
    # s_i = exp(mean_t log r): row 0 sqrt(1.35) = 1.161895 (> 1.1: clipped with eps_high 0.1),
    # row 1 (0.6875)^(1/3) = 0.882587 (in band). Per token: row 0 -1.1 (x2); row 1 2 * 0.882587 (x3).
    loss, metrics, grad = run(AlgorithmConfig(policy_loss_type="gspo", eps_clip_high=0.1))
    assert loss.item() == pytest.approx(0.6191045005978187, abs=1e-6)
    # gradient of each token of row 1: -A s_1 / N = 2 * 0.882587 / 5; row 0 clipped -> 0
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0], [0.3530348335] * 3]))
    assert metrics["clip_ratio_high"] == pytest.approx(0.4)
    assert metrics["clip_ratio_low"] == 0.0


def test_cispo():
    # weights clip(r, 1 - 0, 1 + 5) = row 0 [1.5, 1.0], row 1 [1.0, 1.1, 1.25]; l = -w A lp with
    # lp = ln(0.5 r): row 0: -1.5 ln 0.75 = 0.431523, -ln 0.45 = 0.798508;
    # row 1: 2 ln 0.25 = -2.772589, 2.2 ln 0.55 = -1.315241, 2.5 ln 0.625 = -1.175009
    loss, metrics, grad = run(AlgorithmConfig(policy_loss_type="cispo"))
    assert loss.item() == pytest.approx(-4.0328083921210425 / 5, abs=1e-6)
    # d/dlp = -w A / N (the weight is detached)
    torch.testing.assert_close(grad, torch.tensor([[-0.3, -0.2, 0.0], [0.4, 0.44, 0.5]]))
    # weight clipped at the lower bound 1 for r = 0.9 and r = 0.5; nothing above 6
    assert metrics["clip_ratio_low"] == pytest.approx(0.4)
    assert metrics["clip_ratio_high"] == 0.0
    assert metrics["clip_ratio"] == pytest.approx(0.4)


def test_sapo():
    # l = -A (4/tau) sigmoid(tau (r - 1)), tau = 1 (A > 0) / 1.05 (A < 0):
    #   row 0: -4 sigmoid(0.5) = -2.489837, -4 sigmoid(-0.1) = -1.900083
    #   row 1: 2 (4/1.05) sigmoid(1.05 * [-0.5, 0.1, 0.25]) = 2.831877, 4.009340, 4.306672
    loss, metrics, grad = run(AlgorithmConfig(policy_loss_type="sapo"))
    assert loss.item() == pytest.approx(1.3515937420027007, abs=1e-6)
    # d/dlp = -A 4 sigmoid' (tau (r-1)) r / N
    expected = [[-0.2820044546, -0.1795507489, 0.0], [0.1868279647, 0.4387894750, 0.4914846799]]
    torch.testing.assert_close(grad, torch.tensor(expected))
    # no hard clip: the metrics report PPO's band (r=1.5 with A>0, r=0.5 with A<0)
    assert metrics["clip_ratio"] == pytest.approx(0.4)


def test_kl_estimators_and_term():
    # x = lp - lref: row 0 [0.5, -1], row 1 [0.5, 0.5, -30] (-30: clamped). A = 0, r = 1 -> no pg loss.
    lp = torch.full((2, 3), -1.0, requires_grad=True)
    ref = -1.0 - torch.tensor([[0.5, -1.0, 0.0], [0.5, 0.5, -30.0]])
    ref[0, 2] = NAN
    zero_adv = torch.zeros(2)
    expected = {
        # per-row token means, then mean over the 2 rows
        "k1": ((0.5 - 1.0) / 2 + (0.5 + 0.5 - 30.0) / 3) / 2,
        "k2": ((0.125 + 0.5) / 2 + (0.125 + 0.125 + 450.0) / 3) / 2,
        # k3 = e^{-x} + x - 1: 0.106531 (x=0.5), 0.718282 (x=-1), and x=-30 -> e^{20}-21 -> clamped to 10
        "k3": ((0.10653065971263342 + 0.7182818284590451) / 2 + (2 * 0.10653065971263342 + 10.0) / 3) / 2,
    }
    expected["low_var_kl"] = expected["k3"]
    for estimator, value in expected.items():
        cfg = AlgorithmConfig(kl_loss_coef=0.1, kl_estimator=estimator)
        loss, metrics = compute_policy_loss(lp, lp.detach(), zero_adv, MASK, cfg, ref_log_probs=ref)
        assert metrics["kl_loss"] == pytest.approx(value, rel=1e-6)
        assert loss.item() == pytest.approx(0.1 * value, rel=1e-5)
        assert math.isfinite(torch.autograd.grad(loss, lp)[0].sum().item())
    # k1 gradient: coef / (L_i * S) per valid token
    loss, _ = compute_policy_loss(lp, lp.detach(), zero_adv, MASK, AlgorithmConfig(kl_loss_coef=0.1, kl_estimator="k1"), ref_log_probs=ref)
    (grad,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(grad, torch.tensor([[0.1 / 4, 0.1 / 4, 0.0], [0.1 / 6] * 3]))
    # kl_loss_coef = 0: metric only, no term
    loss, metrics = compute_policy_loss(lp, lp.detach(), zero_adv, MASK, AlgorithmConfig(), ref_log_probs=ref)
    assert loss.item() == 0.0 and metrics["kl_loss"] > 0


def test_entropy_bonus():
    lp = torch.full((2, 3), -1.0, requires_grad=True)
    ent = torch.tensor([[0.5, 1.5, NAN], [1.0, 2.0, 3.0]], requires_grad=True)
    cfg = AlgorithmConfig(entropy_coef=0.01)
    loss, metrics = compute_policy_loss(lp, lp.detach(), torch.zeros(2), MASK, cfg, entropy=ent)
    # -0.01 * (0.5 + 1.5 + 1 + 2 + 3) / 5 = -0.016
    assert loss.item() == pytest.approx(-0.016, abs=1e-7)
    assert metrics["entropy"] == pytest.approx(1.6)
    loss.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.002, -0.002, 0.0], [-0.002] * 3]))
    # global denominator: N = 8 -> -0.01 * 8 / 8
    loss, _ = compute_policy_loss(lp, lp.detach(), torch.zeros(2), MASK, cfg, entropy=ent, num_tokens=8)
    assert loss.item() == pytest.approx(-0.01, abs=1e-7)


def test_token_level_advantages_match_broadcast():
    lp, old = batch()
    adv_bt = ADV[:, None].expand(2, 3).clone()
    adv_bt[0, 2] = NAN
    a, _ = compute_policy_loss(lp, old, adv_bt, MASK, AlgorithmConfig())
    b, _ = compute_policy_loss(lp, old, ADV, MASK, AlgorithmConfig())
    assert a.item() == b.item()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cfg": AlgorithmConfig(kl_loss_coef=0.1)}, "ref_log_probs"),
        ({"cfg": AlgorithmConfig(entropy_coef=0.1)}, "entropy"),
        ({"cfg": AlgorithmConfig(off_policy_correction={"tis_ratio_type": "token"})}, "rollout_log_probs"),
        ({"cfg": AlgorithmConfig(), "adv": torch.zeros(3)}, "advantages"),
        ({"cfg": AlgorithmConfig(), "ref_log_probs": torch.zeros(2, 4)}, "ref_log_probs must have"),
    ],
)
def test_missing_or_misshapen_inputs_raise(kwargs, match):
    lp, old = batch()
    cfg, adv = kwargs.pop("cfg"), kwargs.pop("adv", ADV)
    with pytest.raises(ValueError, match=match):
        compute_policy_loss(lp, old, adv, MASK, cfg, **kwargs)
