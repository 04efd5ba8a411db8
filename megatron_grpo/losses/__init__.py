"""The corrected GRPO loss: advantages, policy-loss family, KL/entropy terms, off-policy
(train/rollout) correction and metrics. Specification: docs/loss_spec.md (formulas, choices, departures).

Public API::

    adv = compute_advantages(rewards, num_generations, config)         # float[B] -> float[B]
    loss, metrics = compute_policy_loss(log_probs, old_log_probs, advantages, loss_mask, config,
        rollout_log_probs=None, ref_log_probs=None, entropy=None,
        num_tokens=None, num_sequences=None)                            # 0-d tensor, dict[str, float]
    pooled = reduce_metrics([metrics, ...], group=None)                 # micro-batches / DP ranks

The loss, with l the per-token surrogate of ``policy_loss_type``, w the detached TIS weight
and m' the valid mask after the off-policy masks (``off_policy.py``)::

    loss = agg(l * w, m') + kl_loss_coef * (1/S) sum_i mean_t k_{i,t} - entropy_coef * sum m H / N

With ``distillation:`` (``distill.py``) the advantage of token t becomes A + coef (lt - lo)
(form advantage), or coef (1/S) sum_i mean_t k(lp, lt) is added (form loss), lt the frozen
teacher's log-prob of the sampled token.

Registries (``registry.py``), one per concept, keyed by the config's ``Literal`` values:
``ADVANTAGE_ESTIMATORS`` (grpo|dr_grpo|rloo), ``POLICY_LOSSES`` (ppo|gspo|cispo|sapo),
``REDUCTIONS`` (token_mean|seq_mean_token_mean|seq_mean_token_sum|seq_mean_token_sum_norm),
``KL_ESTIMATORS`` (k1|k2|k3|low_var_kl), ``TIS_WEIGHTS`` (token|sequence) and
``SEQUENCE_MASKS`` (geometric|product).

Distributed contract
--------------------
The trainer calls ``compute_policy_loss`` once per micro-batch with ``num_tokens`` = N, the
valid tokens of the whole mini-batch (all micro-batches, all DP ranks, counted BEFORE
off-policy masking), and ``num_sequences`` = S, its number of sequences, and SUMS the
returned losses (undoing Megatron's 1/num_microbatches and DDP's 1/dp averaging). Every
term divides by N or S, never by a count of the tensor in hand, so the sum over parts equals
the whole-batch loss in value and gradient for every reduction, loss type, off-policy option,
KL and entropy setting, whatever TP/PP/DP and the micro-batch split (tested). The KL term
uses S (SkyRL's seq-mean-token-mean with a global denominator; SkyRL divides by the
micro-batch's rows) and the entropy bonus uses N (SkyRL: the micro-batch's tokens).

num_iterations, and why the clip fraction is 0 when it is 1
-----------------------------------------------------------
``algorithm.num_iterations`` is the number of optimizer passes over one rollout batch. The
trainer computes pi_old (``old_log_probs``) once, before the first update. On the first pass
the weights are still those of pi_old, so r = pi_theta / pi_old == 1 for every token: -A r
and -A clip(r) are equal, nothing is clipped, and ``clip_ratio``, ``clip_ratio_low/high``
and ``pg_clipfrac_lower`` are exactly 0 (the trainer may even pass
``old_log_probs = log_probs.detach()``, which makes r bit-exactly 1). This is expected, not a
bug (huggingface/trl#3120, #3757; minimind#775): clipping only acts from the second pass on,
after an optimizer step has moved pi_theta away from pi_old. With num_iterations == 1 and one
mini-batch per rollout batch the clip is therefore inert and GRPO is plain REINFORCE with a
group baseline; it matters with num_iterations > 1 or several mini-batches per rollout.

Why ``exp(lp - lp.detach())`` is not a no-op
--------------------------------------------
Its VALUE is exp(0) = 1, but its GRADIENT is d/dθ exp(lp - c) = exp(lp - c) * dlp/dθ = dlp/dθ
(c is a constant to autograd). So -A * exp(lp - sg(lp)) has the constant value -A and the
gradient -A * grad log pi_theta: exactly the REINFORCE / policy-gradient estimator, and exactly
the PPO-clip gradient at r = 1 (where both branches of the max agree and the clamp passes the
gradient). Dropping the ratio would leave a constant with no gradient. GSPO uses the same
trick per token: s_{i,t} = sg(s_i) * exp(lp - sg(lp)) has the value of the sequence ratio
and the gradient of each token's log-prob.

Departures from the papers and peers (all deliberate)
----------------------------------------------------
Advantages (``advantages.py``): zero-std groups (std <= 1e-6) get A = 0 for every estimator
(peers divide ~1 ulp of rounding by 1e-6); float64 arithmetic; non-finite rewards raise.
Policy losses (``policy.py``): dual clip only for ``ppo`` and only when ``clip_ratio_c`` is set
(verl always on, SkyRL via a separate loss type); CISPO clip metrics count tokens whose weight
was clipped (SkyRL's metric is always 1); SAPO has no hard clip and reports the tokens PPO's
band would clip. Reductions (``reductions.py``): token_mean divides by the global pre-masking
token count (SkyRL PR #849: per micro-batch, post-masking); seq-mean modes divide by S
including empty rows (verl: non-empty rows); Dr.GRPO's H is ``max_response_length`` (SkyRL:
prompt + generation length). KL (``kl.py``): k3/low_var_kl clamped as verl/SkyRL; the KL and
entropy terms use the unmasked valid mask and no TIS weight (SkyRL). Off-policy
(``off_policy.py``): enabled by outlier thresholds alone too (skyrl 0.4.0, not PR #849);
missing ``rollout_log_probs`` with the block enabled is an error (SkyRL silently skips); the
mismatch metrics are logged whenever ``rollout_log_probs`` is given; ``is_ratio_*`` over valid
tokens only; no per-token mask. NaN/inf at padded positions never reach the loss or the
gradient (inputs pass through ``torch.where`` first; SkyRL and TRL multiply by the mask and leak
NaN). Missing ``ref_log_probs`` / ``entropy`` when their coefficient is > 0 is an error.

Metrics (docs/loss_spec.md#metrics): ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``,
``pg_clipfrac_lower``, ``ppo_kl`` (mean lo - lp), ``entropy``, ``kl_loss`` (KL term before its
coefficient), ``is_ratio_mean/std/max/min``, ``rollout_train_logprobs_abs_diff_mean/_std``,
``k3_kl`` (KL(mu || pi_old)), ``tis_token_clip_high_ratio``, ``tis_seq_clip_high_ratio``,
``outlier_seq_masked_ratio`` (+``_over_high_ratio``/``_under_low_ratio``, likewise for
``geo_sequence_mask_*`` and ``product_sequence_mask_*``), ``num_valid_tokens``,
``num_sequences``. Token metrics are over the valid mask before off-policy masking.
"""

from megatron_grpo.losses.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from megatron_grpo.losses.kl import KL_ESTIMATORS
from megatron_grpo.losses.loss import compute_policy_loss
from megatron_grpo.losses.metrics import reduce_metrics
from megatron_grpo.losses.off_policy import SEQUENCE_MASKS, TIS_WEIGHTS
from megatron_grpo.losses.policy import POLICY_LOSSES
from megatron_grpo.losses.reductions import REDUCTIONS

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "REDUCTIONS",
    "SEQUENCE_MASKS",
    "TIS_WEIGHTS",
    "compute_advantages",
    "compute_policy_loss",
    "reduce_metrics",
]
