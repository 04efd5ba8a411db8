"""Edge cases (docs/loss_spec.md#edge-cases) and the num_iterations semantics (clip metrics exactly 0 on the
first pass, positive after a real optimizer step on a tiny torch policy)."""

import itertools
import math

import pytest
import torch

from megatron_grpo.config import AlgorithmConfig
from megatron_grpo.losses import compute_advantages, compute_policy_loss
from tests.support.losses_cases import EXTRAS, LOSS_TYPES, REDUCTIONS, make_batch, make_config

CASES = list(itertools.product(LOSS_TYPES, REDUCTIONS, EXTRAS))


@pytest.mark.parametrize("loss_type, reduction, extras", CASES)
def test_all_masked_gives_zero_loss_zero_grad_finite_metrics(loss_type, reduction, extras):
    batch = make_batch(dtype=torch.float32)
    batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    for key in ("log_probs", "old_log_probs", "rollout_log_probs", "ref_log_probs", "entropy"):
        batch[key][:] = float("nan")  # nothing is valid, every value is garbage
    lp = batch.pop("log_probs").requires_grad_()
    ent = batch.pop("entropy").requires_grad_()
    loss, metrics = compute_policy_loss(lp, entropy=ent, config=make_config(loss_type, reduction, extras), **batch)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros_like(lp))
    assert ent.grad is None or torch.equal(ent.grad, torch.zeros_like(ent))  # None: entropy_coef = 0
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["num_valid_tokens"] == 0 and metrics["is_ratio_max"] == 0.0


@pytest.mark.parametrize("loss_type, reduction, extras", CASES)
def test_garbage_in_padding_does_not_leak(loss_type, reduction, extras):
    """NaN/inf padding (make_batch) gives bit-identical loss and gradient to zero padding."""
    cfg = make_config(loss_type, reduction, extras)
    results = []
    for fill in ("garbage", "zeros"):
        batch = make_batch(dtype=torch.float32)
        if fill == "zeros":
            pad = batch["loss_mask"] == 0
            for key in ("log_probs", "old_log_probs", "rollout_log_probs", "ref_log_probs", "entropy"):
                batch[key][pad] = 0.0
        lp = batch.pop("log_probs").requires_grad_()
        loss, metrics = compute_policy_loss(lp, config=cfg, **batch)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
        assert all(math.isfinite(v) for v in metrics.values())
        results.append((loss.detach(), lp.grad, metrics))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_ratio_overflow_stays_finite(loss_type):
    # log-ratios of +-60 (exp would overflow float32 at 88, and bf16-era values go further)
    lp = torch.tensor([[60.0, -60.0, 0.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    rollout = torch.tensor([[-80.0, 80.0, 0.0]])
    cfg = AlgorithmConfig(policy_loss_type=loss_type, off_policy_correction={"tis_ratio_type": "sequence"})
    for adv in (1.0, -1.0):
        loss, metrics = compute_policy_loss(lp, old, torch.tensor([adv]), torch.ones(1, 3), cfg, rollout_log_probs=rollout)
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss_type, adv)
        assert all(math.isfinite(v) for v in metrics.values())


def test_empty_rows_count_in_sequence_denominator():
    # row 1 is empty: seq-mean modes divide by B = 2 (SkyRL/TRL), not by the 1 non-empty row
    lp = torch.zeros(2, 2, requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0]])
    cfg = AlgorithmConfig(loss_reduction="seq_mean_token_mean")
    loss, _ = compute_policy_loss(lp, lp.detach(), torch.tensor([1.0, 5.0]), mask, cfg)
    assert loss.item() == pytest.approx(-0.5)  # row 0: mean(-1, -1) = -1, over 2 rows


# --- num_iterations -------------------------------------------------------------------------

CLIP_KEYS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "pg_clipfrac_lower")


class TinyPolicy(torch.nn.Module):
    """A context-free-ish language model: logits = W @ features(position, prompt)."""

    def __init__(self, vocab=16, dim=8):
        super().__init__()
        self.proj = torch.nn.Linear(dim, vocab)

    def log_probs(self, feats_BTD, tokens_BT):
        logp = torch.log_softmax(self.proj(feats_BTD), dim=-1)
        return logp.gather(-1, tokens_BT.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_clip_is_zero_on_first_iteration_and_positive_after_a_step(loss_type):
    torch.manual_seed(0)
    model = TinyPolicy()
    num_prompts, num_generations, T = 4, 4, 6
    B = num_prompts * num_generations
    feats = torch.randn(B, T, 8)
    with torch.no_grad():
        probs = torch.softmax(model.proj(feats), dim=-1)
        tokens = torch.multinomial(probs.view(-1, 16), 1).view(B, T)
    mask = (torch.arange(T)[None] < torch.randint(2, T + 1, (B, 1))).long()
    rewards = (tokens[:, 0] % 2).float() + 0.1 * (torch.arange(B) % 3).float()
    extra = {"clip_ratio_c": 1.2} if loss_type == "ppo" else {}
    cfg = AlgorithmConfig(policy_loss_type=loss_type, num_iterations=2, **extra)
    adv = compute_advantages(rewards, num_generations, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=20.0)

    # Iteration 1: pi_old is the current policy (the trainer computes old_log_probs before
    # any update, here literally log_probs.detach()), so r == 1 bit-exactly.
    lp = model.log_probs(feats, tokens)
    old = lp.detach()
    loss, metrics = compute_policy_loss(lp, old, adv, mask, cfg)
    assert all(metrics[k] == 0.0 for k in CLIP_KEYS), metrics
    assert metrics["ppo_kl"] == 0.0
    # ... and the gradient is exactly REINFORCE's: -sum(A * lp) / N (exp(lp - sg(lp)) is not a no-op)
    grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    reinforce = -(adv[:, None] * torch.where(mask.bool(), lp, 0.0)).sum() / mask.sum()
    expected = torch.autograd.grad(reinforce, list(model.parameters()), retain_graph=True)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)
    opt.zero_grad()
    loss.backward()
    opt.step()

    # Iteration 2: same rollout batch and pi_old, moved weights -> ratios leave the band.
    lp = model.log_probs(feats, tokens)
    _, metrics = compute_policy_loss(lp, old, adv, mask, cfg)
    assert metrics["clip_ratio"] > 0, metrics
    assert metrics["ppo_kl"] != 0.0
