"""`algorithm:` section: advantages, policy loss, KL/entropy terms, off-policy correction.

The semantics of every knob, megatron-grpo's choices and its departures from the papers are in
docs/loss_spec.md (the user guide is docs/algorithms.md, the off-policy guide docs/off_policy.md).
Names follow SkyRL where a peer name exists.
"""

from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass, field
from typing import Literal, Optional

from megatron_grpo.config.base import ConfigError, ConfigValueError, build_section, check


@dataclass(kw_only=True)
class OffPolicyCorrectionConfig:
    """Train/rollout mismatch correction with rho = pi_old / mu (SkyRL PR #849 keys)."""

    tis_ratio_type: Optional[Literal["token", "sequence"]] = None
    """Truncated importance sampling weight: per token min(rho, cap), per sequence
    min(prod rho, cap), or null for none."""

    token_tis_ratio_clip_high: float = 2.0
    """Cap of the token-level TIS weight."""

    sequence_tis_ratio_clip_high: float = 5.0
    """Cap of the sequence-level TIS weight."""

    sequence_mask_metric: Optional[Literal["geometric", "product"]] = None
    """Drop whole sequences whose geometric-mean (or product) rho leaves [low, high]; null = off."""

    geo_mask_high: float = 1.01
    """Upper bound of the geometric-mean rho kept by the sequence mask."""

    geo_mask_low: float = 0.99
    """Lower bound of the geometric-mean rho kept by the sequence mask."""

    product_mask_high: float = 2.0
    """Upper bound of the product rho kept by the sequence mask."""

    product_mask_low: float = 0.5
    """Lower bound of the product rho kept by the sequence mask."""

    outlier_token_is_threshold_low: Optional[float] = None
    """Drop a sequence if any valid token has rho below this (null = no bound; e.g. 1e-4)."""

    outlier_token_is_threshold_high: Optional[float] = None
    """Drop a sequence if any valid token has rho above this (null = no bound; e.g. 100)."""

    def __post_init__(self):
        check(self.token_tis_ratio_clip_high > 0, "token_tis_ratio_clip_high", "must be > 0")
        check(self.sequence_tis_ratio_clip_high > 0, "sequence_tis_ratio_clip_high", "must be > 0")
        check(
            0 < self.geo_mask_low <= 1 <= self.geo_mask_high,
            "geo_mask_low",
            f"need 0 < geo_mask_low <= 1 <= geo_mask_high, got {self.geo_mask_low}/{self.geo_mask_high}",
        )
        check(
            0 < self.product_mask_low <= 1 <= self.product_mask_high,
            "product_mask_low",
            "need 0 < product_mask_low <= 1 <= product_mask_high, "
            f"got {self.product_mask_low}/{self.product_mask_high}",
        )
        lo, hi = self.outlier_token_is_threshold_low, self.outlier_token_is_threshold_high
        check(lo is None or lo > 0, "outlier_token_is_threshold_low", f"must be > 0, got {lo}")
        check(hi is None or hi > 0, "outlier_token_is_threshold_high", f"must be > 0, got {hi}")
        check(
            lo is None or hi is None or lo < hi,
            "outlier_token_is_threshold_low",
            f"must be below outlier_token_is_threshold_high ({lo} >= {hi})",
        )

    @property
    def enabled(self) -> bool:
        """On when TIS, a sequence mask or an outlier threshold is set
        (docs/loss_spec.md#off-policy-correction)."""
        return (
            self.tis_ratio_type is not None
            or self.sequence_mask_metric is not None
            or self.outlier_token_is_threshold_low is not None
            or self.outlier_token_is_threshold_high is not None
        )


@dataclass(kw_only=True)
class AlgorithmConfig:
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """grpo: (r - mean) / (std + 1e-6) per group, 0 for zero-std groups; dr_grpo: r - mean;
    rloo: leave-one-out baseline."""

    policy_loss_type: Literal["ppo", "gspo", "cispo", "sapo"] = "ppo"
    """Per-token surrogate: PPO clip, GSPO (sequence ratio), CISPO (clipped-IS REINFORCE),
    SAPO (soft gate)."""

    eps_clip_low: float = 0.2
    """Lower clip: ratios below 1 - eps_clip_low are clipped (ppo, gspo)."""

    eps_clip_high: float = 0.2
    """Upper clip: ratios above 1 + eps_clip_high are clipped (ppo, gspo); 0.28 is DAPO's
    clip-higher."""

    clip_ratio_c: Optional[float] = None
    """Dual-clip constant c (> 1) bounding the loss of negative-advantage tokens at -A*c
    (policy_loss_type: ppo only); null = no dual clip."""

    cispo_eps_clip_low: float = 0.0
    """CISPO weight lower bound is 1 - cispo_eps_clip_low."""

    cispo_eps_clip_high: float = 5.0
    """CISPO weight upper bound is 1 + cispo_eps_clip_high."""

    sapo_tau_pos: float = 1.0
    """SAPO gate temperature for positive advantages."""

    sapo_tau_neg: float = 1.05
    """SAPO gate temperature for negative advantages."""

    loss_reduction: Literal[
        "token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
    ] = "token_mean"
    """How per-token losses become one scalar. token_mean divides by the global count of valid
    tokens of the mini-batch (before off-policy masking)."""

    max_response_length: Optional[int] = None
    """Dr.GRPO horizon H for seq_mean_token_sum_norm (required for that reduction)."""

    kl_loss_coef: float = 0.0
    """Weight of the KL-to-reference loss; > 0 loads a frozen reference model."""

    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """Per-token KL(pi || ref) estimator (docs/loss_spec.md#kl-and-entropy-terms)."""

    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); with entropy_coef_end, its
    weight at the first step."""

    entropy_coef_end: Optional[float] = None
    """The entropy bonus's weight at the last step (trainer.num_steps): the weight moves
    linearly from entropy_coef at step 1 to this at the last step, so a bonus that keeps an
    early policy exploring stops capping the reward it can reach late. null: constant
    entropy_coef. The weight each step used is logged as `entropy_coef`."""

    num_iterations: int = 1
    """Optimizer passes over each rollout batch (PPO epochs). With 1, pi_old == pi_theta and
    the clip fraction is exactly 0."""

    shuffle_mini_batches: bool = False
    """With several optimizer steps per rollout batch (rollout.batch_size > parallel.global_batch_size),
    shuffle the batch's sequences (seeded by trainer.seed and the step, the same on every rank
    and after a resume) before cutting it into mini-batches, so each step mixes prompts instead
    of holding a few whole groups in generation order (TRL's default). Off by default, as in
    verl. No effect with one mini-batch."""

    skip_zero_advantage_steps: bool = False
    """A step whose every advantage is zero (|A| <= 1e-6: every group's rewards equal) skips its
    old-log-prob pass and its optimizer steps when nothing else gives a gradient
    (entropy_coef and kl_loss_coef 0 at that step, no router replay); counted as
    `skipped_zero_advantage` in the metrics. Off by default: a skipped step runs no trainer
    forward, so it logs no loss and no train/rollout mismatch. Unlike a zero-gradient Adam step, the skipped step
    does not move the weights by momentum or weight decay. DAPO's dynamic sampling
    (rollout.dynamic_sampling.enabled) is the other remedy: it refills the batch with groups that
    have a signal."""

    off_policy_correction: OffPolicyCorrectionConfig = field(default_factory=OffPolicyCorrectionConfig)
    """Train/rollout mismatch correction (TIS, sequence masks, outlier masks)."""

    router_replay: bool = False
    """Mixture-of-experts models only: the trainer's log-prob passes (old log-probs and the
    training forward) route every token to the experts the rollout engine chose for it, so
    engine and trainer score the same network (docs/moe.md#router-replay). Needs an engine
    that returns its routing (engine.kind: embedded) and no model.recompute_activations."""

    use_tis: InitVar[Optional[bool]] = None
    """Deprecated: `true` maps to off_policy_correction.tis_ratio_type: token (with a warning)."""

    tis_imp_ratio_cap: InitVar[Optional[float]] = None
    """Deprecated: maps to off_policy_correction.token_tis_ratio_clip_high (with a warning)."""

    def __post_init__(self, use_tis: Optional[bool], tis_imp_ratio_cap: Optional[float]):
        if isinstance(self.off_policy_correction, dict):  # AlgorithmConfig(**yaml_section)
            try:
                self.off_policy_correction = build_section(
                    OffPolicyCorrectionConfig, self.off_policy_correction
                )
            except ConfigError as e:
                raise ConfigValueError(f"off_policy_correction.{e.where}", e.message) from None
        self._map_deprecated_tis(use_tis, tis_imp_ratio_cap)
        check(0 <= self.eps_clip_low < 1, "eps_clip_low", f"must be in [0, 1), got {self.eps_clip_low}")
        check(self.eps_clip_high >= 0, "eps_clip_high", f"must be >= 0, got {self.eps_clip_high}")
        check(
            self.clip_ratio_c is None or self.clip_ratio_c > 1,
            "clip_ratio_c",
            f"dual clip needs c > 1 (or null to disable), got {self.clip_ratio_c}",
        )
        check(
            self.clip_ratio_c is None or self.policy_loss_type == "ppo",
            "clip_ratio_c",
            f"dual clip applies to policy_loss_type: ppo only, not {self.policy_loss_type} "
            "(set clip_ratio_c: null)",
        )
        check(self.cispo_eps_clip_low >= 0, "cispo_eps_clip_low", "must be >= 0")
        check(self.cispo_eps_clip_high >= 0, "cispo_eps_clip_high", "must be >= 0")
        check(self.sapo_tau_pos > 0, "sapo_tau_pos", f"must be > 0, got {self.sapo_tau_pos}")
        check(self.sapo_tau_neg > 0, "sapo_tau_neg", f"must be > 0, got {self.sapo_tau_neg}")
        check(self.kl_loss_coef >= 0, "kl_loss_coef", f"must be >= 0, got {self.kl_loss_coef}")
        check(self.entropy_coef >= 0, "entropy_coef", f"must be >= 0, got {self.entropy_coef}")
        check(self.entropy_coef_end is None or self.entropy_coef_end >= 0, "entropy_coef_end",
              f"must be >= 0 (or null for a constant entropy_coef), got {self.entropy_coef_end}")
        check(self.num_iterations >= 1, "num_iterations", f"must be >= 1, got {self.num_iterations}")
        if self.loss_reduction == "seq_mean_token_sum_norm":
            check(
                self.max_response_length is not None,
                "max_response_length",
                "is required with loss_reduction: seq_mean_token_sum_norm (the Dr.GRPO horizon)",
            )
        check(
            self.max_response_length is None or self.max_response_length >= 1,
            "max_response_length",
            f"must be >= 1, got {self.max_response_length}",
        )

    def _map_deprecated_tis(self, use_tis: Optional[bool], cap: Optional[float]) -> None:
        """Map the deprecated `use_tis` / `tis_imp_ratio_cap` pair (docs/loss_spec.md#off-policy-correction) onto the
        off-policy block, warning once; a conflicting explicit setting is an error."""
        if use_tis is None and cap is None:
            return
        warnings.warn(
            "algorithm.use_tis / tis_imp_ratio_cap are deprecated: use "
            "algorithm.off_policy_correction.tis_ratio_type: token and token_tis_ratio_clip_high",
            DeprecationWarning,
            stacklevel=3,
        )
        if not use_tis:
            check(cap is None, "tis_imp_ratio_cap", "is set but use_tis is not true")
            return
        opc = self.off_policy_correction
        check(
            opc.tis_ratio_type in (None, "token"),
            "use_tis",
            f"conflicts with off_policy_correction.tis_ratio_type: {opc.tis_ratio_type}",
        )
        check(cap is None or cap > 0, "tis_imp_ratio_cap", f"must be > 0, got {cap}")
        opc.tis_ratio_type = "token"
        if cap is not None:
            opc.token_tis_ratio_clip_high = cap


def entropy_coef_at(algorithm: AlgorithmConfig, step: int, num_steps: int) -> float:
    """The entropy bonus's weight at 0-based ``step`` of ``num_steps``: ``entropy_coef``, or,
    with ``entropy_coef_end``, the linear interpolation from ``entropy_coef`` (step 0) to
    ``entropy_coef_end`` (step num_steps - 1). E.g. 0.05 -> 0.0 over 5 steps: 0.05, 0.0375,
    0.025, 0.0125, 0.0."""
    end = algorithm.entropy_coef_end
    if end is None or num_steps <= 1:
        return algorithm.entropy_coef
    frac = min(max(step, 0), num_steps - 1) / (num_steps - 1)
    return algorithm.entropy_coef + (end - algorithm.entropy_coef) * frac
