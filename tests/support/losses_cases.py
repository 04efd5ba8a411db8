"""The loss cases the tests/test_losses_*.py modules share: every policy-loss type, reduction and
off-policy/KL/entropy setting (``make_config``), and a random float64 batch with varied lengths
and NaN/inf in every padded slot (``make_batch``)."""

import torch

from megatron_grpo.config import AlgorithmConfig

LOSS_TYPES = ["ppo", "gspo", "cispo", "sapo"]
REDUCTIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
EXTRAS = {
    "plain": {},
    # KL + entropy + token TIS + outlier mask + geometric mask
    "token_tis": {
        "kl_loss_coef": 0.05,
        "entropy_coef": 0.01,
        "off_policy_correction": {
            "tis_ratio_type": "token",
            "token_tis_ratio_clip_high": 1.5,
            "outlier_token_is_threshold_high": 1.8,
            "outlier_token_is_threshold_low": 0.45,
            "sequence_mask_metric": "geometric",
            "geo_mask_low": 0.85,
            "geo_mask_high": 1.15,
        },
    },
    # k2 KL + sequence TIS + product mask
    "seq_tis": {
        "kl_loss_coef": 0.05,
        "kl_estimator": "k2",
        "off_policy_correction": {
            "tis_ratio_type": "sequence",
            "sequence_tis_ratio_clip_high": 1.5,
            "sequence_mask_metric": "product",
            "product_mask_low": 0.75,
            "product_mask_high": 1.55,
        },
    },
}


def make_config(loss_type, reduction, extras):
    kw = dict(EXTRAS[extras])
    if loss_type == "ppo":
        kw["clip_ratio_c"] = 1.5
    return AlgorithmConfig(policy_loss_type=loss_type, loss_reduction=reduction, max_response_length=8, **kw)


def make_batch(B=8, T=6, seed=0, dtype=torch.float64):
    """Random batch with varied lengths (row 3 empty) and NaN/inf in every padded slot."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 2, 5, 0, 3, 6, 1, 4])[:B]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.int64)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3 - 0.1
    lp = old + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    rollout = old + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    ref = old + 0.5 * torch.randn(B, T, generator=g, dtype=dtype)
    ent = torch.rand(B, T, generator=g, dtype=dtype) * 2
    adv = torch.randn(B, generator=g, dtype=dtype)
    pad = mask == 0
    for t, fill in ((lp, float("nan")), (old, float("inf")), (rollout, -float("inf")), (ref, float("nan")), (ent, float("nan"))):
        t[pad] = fill
    return dict(log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=mask,
                rollout_log_probs=rollout, ref_log_probs=ref, entropy=ent)
