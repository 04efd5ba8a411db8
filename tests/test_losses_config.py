"""Registries match the config's Literal values; the algorithm section rejects bad values at
load time and maps the deprecated TIS keys."""

import typing
import warnings

import pytest

from megatron_grpo.config import AlgorithmConfig, ConfigError, OffPolicyCorrectionConfig
from megatron_grpo.config.base import build_section
from megatron_grpo.losses import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    REDUCTIONS,
    SEQUENCE_MASKS,
    TIS_WEIGHTS,
)


def _literal_values(cls, name):
    tp = typing.get_type_hints(cls)[name]
    if typing.get_origin(tp) is typing.Union:  # Optional[Literal[...]]
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    assert typing.get_origin(tp) is typing.Literal
    return set(typing.get_args(tp))


@pytest.mark.parametrize(
    "registry, cls, field",
    [
        (ADVANTAGE_ESTIMATORS, AlgorithmConfig, "advantage_estimator"),
        (POLICY_LOSSES, AlgorithmConfig, "policy_loss_type"),
        (REDUCTIONS, AlgorithmConfig, "loss_reduction"),
        (KL_ESTIMATORS, AlgorithmConfig, "kl_estimator"),
        (TIS_WEIGHTS, OffPolicyCorrectionConfig, "tis_ratio_type"),
        (SEQUENCE_MASKS, OffPolicyCorrectionConfig, "sequence_mask_metric"),
    ],
)
def test_registry_names_equal_config_literal(registry, cls, field):
    assert set(registry.names()) == _literal_values(cls, field)
    for name in registry.names():
        assert callable(registry.get(name))
    with pytest.raises(ValueError, match="registered: "):
        registry.get("no_such_entry")


def test_defaults_and_nested_block():
    cfg = AlgorithmConfig(off_policy_correction={"tis_ratio_type": "sequence", "geo_mask_low": 0.9})
    assert cfg.off_policy_correction.tis_ratio_type == "sequence"
    assert cfg.off_policy_correction.sequence_tis_ratio_clip_high == 5.0
    assert cfg.off_policy_correction.enabled
    assert not AlgorithmConfig().off_policy_correction.enabled
    # docs/loss_spec.md#off-policy-correction: an outlier threshold alone enables the block.
    assert OffPolicyCorrectionConfig(outlier_token_is_threshold_high=100.0).enabled


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"policy_loss_type": "grpo"}, "algorithm.policy_loss_type"),
        ({"loss_reduction": "seq_mean_token_sum_norm"}, "algorithm.max_response_length"),
        ({"clip_ratio_c": 1.0}, "algorithm.clip_ratio_c"),
        ({"clip_ratio_c": 3.0, "policy_loss_type": "gspo"}, "algorithm.clip_ratio_c"),
        ({"eps_clip_low": 1.0}, "algorithm.eps_clip_low"),
        ({"kl_estimator": "k4"}, "algorithm.kl_estimator"),
        ({"num_iterations": 0}, "algorithm.num_iterations"),
        ({"off_policy_correction": {"tis_ratio_type": "tokens"}}, "algorithm.off_policy_correction.tis_ratio_type"),
        ({"off_policy_correction": {"geo_mask_low": 1.2}}, "algorithm.off_policy_correction.geo_mask_low"),
        (
            {"off_policy_correction": {"outlier_token_is_threshold_low": 5.0, "outlier_token_is_threshold_high": 2.0}},
            "algorithm.off_policy_correction.outlier_token_is_threshold_low",
        ),
    ],
)
def test_invalid_values_fail_at_load_time(raw, key):
    with pytest.raises(ConfigError) as err:
        build_section(AlgorithmConfig, raw, "algorithm")
    assert err.value.where == key
    assert "\n" not in str(err.value)


def test_deprecated_use_tis_is_mapped_with_a_warning():
    with pytest.warns(DeprecationWarning, match="use_tis"):
        cfg = build_section(AlgorithmConfig, {"use_tis": True, "tis_imp_ratio_cap": 3.0}, "algorithm")
    assert cfg.off_policy_correction.tis_ratio_type == "token"
    assert cfg.off_policy_correction.token_tis_ratio_clip_high == 3.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(ConfigError, match="conflicts"):
            build_section(
                AlgorithmConfig,
                {"use_tis": True, "off_policy_correction": {"tis_ratio_type": "sequence"}},
                "algorithm",
            )


def test_entropy_coef_schedule_is_linear_from_first_to_last_step():
    """Hand-computed: 0.05 -> 0.0 over 5 steps is 0.05, 0.0375, 0.025, 0.0125, 0.0; null end
    (or a one-step run) keeps entropy_coef; a negative end is refused at load."""
    from megatron_grpo.config.algorithm import entropy_coef_at

    decaying = AlgorithmConfig(entropy_coef=0.05, entropy_coef_end=0.0)
    assert [entropy_coef_at(decaying, s, 5) for s in range(5)] == pytest.approx([0.05, 0.0375, 0.025, 0.0125, 0.0])
    assert entropy_coef_at(decaying, 9, 5) == 0.0  # past the last step: the end value
    rising = AlgorithmConfig(entropy_coef=0.0, entropy_coef_end=0.01)
    assert entropy_coef_at(rising, 2, 3) == pytest.approx(0.01)
    assert entropy_coef_at(AlgorithmConfig(entropy_coef=0.05), 3, 5) == 0.05
    assert entropy_coef_at(decaying, 0, 1) == 0.05
    with pytest.raises(ConfigError, match="entropy_coef_end"):
        build_section(AlgorithmConfig, {"entropy_coef_end": -0.1})
