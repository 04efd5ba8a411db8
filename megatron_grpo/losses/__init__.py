"""The corrected GRPO loss: advantages, policy losses, KL/entropy, off-policy correction, metrics.
Spec: docs/loss_spec.md; knobs, why clip_ratio is 0 on pass 1, ``exp(lp - lp.detach())``: docs/algorithms.md.

    adv = compute_advantages(rewards, num_generations, config)         # float[B] -> float[B]
    loss, metrics = compute_policy_loss(log_probs, old_log_probs, advantages, loss_mask, config,
        rollout_log_probs=None, ref_log_probs=None, entropy=None, num_tokens=None, num_sequences=None)
    pooled = reduce_metrics([metrics, ...], group=None)                 # micro-batches / DP ranks

Registries (``registry.py``), keyed by the config's ``Literal`` values: ``ADVANTAGE_ESTIMATORS``,
``POLICY_LOSSES``, ``REDUCTIONS``, ``KL_ESTIMATORS``, ``TIS_WEIGHTS``, ``SEQUENCE_MASKS``.
With ``distillation:`` (``distill.py``) a teacher term joins the advantage or the loss (docs/distillation.md).

Distributed contract: call once per micro-batch with ``num_tokens`` = N (valid tokens of the whole
mini-batch, all DP ranks, counted before off-policy masking) and ``num_sequences`` = S, and SUM
the results; every term divides by N or S, so the parts add up to the whole-batch loss.

Departures (deliberate; table in docs/loss_spec.md#departures-from-the-papers-and-peers):
zero-std groups get A = 0; non-finite rewards raise. Dual clip only for ``ppo`` and only with
``clip_ratio_c``. CISPO's clip metric counts clipped weights (SkyRL: always 1). token_mean divides
by the global pre-masking count (SkyRL PR #849: per micro-batch, post-masking); seq-mean by S with
empty rows (verl: non-empty); Dr.GRPO's horizon is ``max_response_length``. KL uses S and entropy
N, unmasked, no TIS weight (SkyRL: micro-batch denominators). Outlier thresholds alone enable the
off-policy block; missing ``rollout_log_probs`` with it on is an error (SkyRL skips); no per-token
mask; ``is_ratio_*`` over valid tokens. NaN/inf at padding is removed with ``torch.where`` (SkyRL,
TRL multiply by the mask and leak NaN). Missing ``ref_log_probs``/``entropy`` needed by a term raises.
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
