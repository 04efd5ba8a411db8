"""reduce_metrics: pooling rules by hand, hierarchical pooling, and the DP all-reduce on 2
gloo ranks (must equal pooling every part on one process)."""

import math

import pytest
import torch

from megatron_grpo.config import AlgorithmConfig
from megatron_grpo.losses import compute_policy_loss, reduce_metrics
from tests.support.distributed import run_distributed

# Two micro-batches: tokens x = [1, 2] (part A) and [3, 4, 5, 6] (part B); 1 and 3 rows.
PART_A = {"num_valid_tokens": 2.0, "num_sequences": 1.0, "x_mean": 1.5, "x_std": 0.5, "x_max": 2.0,
          "x_min": 1.0, "clip_ratio": 0.5, "outlier_seq_masked_ratio": 1.0}
PART_B = {"num_valid_tokens": 4.0, "num_sequences": 3.0, "x_mean": 4.5, "x_std": math.sqrt(1.25), "x_max": 6.0,
          "x_min": 3.0, "clip_ratio": 0.25, "outlier_seq_masked_ratio": 0.0}
# Whole batch x = 1..6: mean 3.5, population std sqrt(35/12) = 1.7078251; clip tokens
# 1 + 1 = 2 of 6; masked rows 1 of 4.
EXPECTED = {"num_valid_tokens": 6.0, "num_sequences": 4.0, "x_mean": 3.5, "x_std": 1.707825127659933,
            "x_max": 6.0, "x_min": 1.0, "clip_ratio": 2 / 6, "outlier_seq_masked_ratio": 0.25}
EMPTY = {"num_valid_tokens": 0.0, "num_sequences": 1.0, "x_mean": 0.0, "x_std": 0.0, "x_max": 0.0,
         "x_min": 0.0, "clip_ratio": 0.0, "outlier_seq_masked_ratio": 0.0}


def assert_metrics_close(got, expected):
    assert list(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-12), k


def test_pooling_rules_by_hand():
    assert_metrics_close(reduce_metrics([PART_A, PART_B]), EXPECTED)


def test_empty_part_changes_nothing_but_the_row_count():
    # an all-masked micro-batch: its max/min placeholders (0) are ignored, its weight is 0
    # for token metrics, and its row counts in sequence metrics (SkyRL counts empty rows)
    got = reduce_metrics([PART_A, EMPTY, PART_B])
    assert_metrics_close(got, {**EXPECTED, "num_sequences": 5.0, "outlier_seq_masked_ratio": 0.2})
    assert reduce_metrics([EMPTY])["x_min"] == 0.0  # nothing valid at all: 0, not inf


def test_hierarchical_pooling_and_explicit_weights():
    assert_metrics_close(reduce_metrics([reduce_metrics([PART_A]), reduce_metrics([PART_B])]), EXPECTED)
    # (dict, weight) pairs for dicts without counts: token-weighted mean 0.75*2/3 + 0.0*1/3
    assert reduce_metrics([({"loss": 0.75}, 2), ({"loss": 0.0}, 1)]) == {"loss": 0.5}


def test_bad_parts_raise():
    with pytest.raises(ValueError, match="num_valid_tokens"):
        reduce_metrics([{"loss": 1.0}])
    with pytest.raises(ValueError, match="differ in keys"):
        reduce_metrics([PART_A, {**PART_B, "extra": 1.0}])
    with pytest.raises(ValueError, match="at least one"):
        reduce_metrics([])


def _loss_metrics(seed, empty=False):
    """Real compute_policy_loss metrics (all families of keys) of a small random batch;
    ``empty``: the same batch with every token masked (an all-padding micro-batch)."""
    from tests.support.losses_cases import make_batch

    batch = make_batch(B=4, seed=seed)
    if empty:
        batch["loss_mask"] = torch.zeros_like(batch["loss_mask"])
    cfg = AlgorithmConfig(
        kl_loss_coef=0.1,
        off_policy_correction={"tis_ratio_type": "token", "token_tis_ratio_clip_high": 1.2,
                               "sequence_mask_metric": "geometric", "geo_mask_low": 0.9, "geo_mask_high": 1.1},
    )
    return compute_policy_loss(config=cfg, **batch)[1]


def _dp_worker(rank, world_size, parts_per_rank):
    import torch.distributed as dist

    local = reduce_metrics(parts_per_rank[rank])  # (a) micro-batches of this rank
    pooled = reduce_metrics([local], group=dist.group.WORLD)  # (b) across DP ranks
    try:
        reduce_metrics([{"num_valid_tokens": 1.0, f"only_on_rank_{rank}": 1.0}], group=dist.group.WORLD)
        mismatch = None
    except RuntimeError as e:
        mismatch = str(e)
    return pooled, mismatch


@pytest.mark.slow
def test_all_reduce_across_two_gloo_ranks_equals_single_process_pooling():
    parts = [[_loss_metrics(0), _loss_metrics(1)], [_loss_metrics(2), _loss_metrics(3, empty=True)]]
    expected = reduce_metrics(parts[0] + parts[1])
    assert expected["is_ratio_min"] > 0  # the empty part's placeholder 0 was ignored
    assert expected["geo_sequence_mask_masked_ratio"] > 0
    results = run_distributed(_dp_worker, 2, parts, timeout_s=300)
    for pooled, mismatch in results:
        assert_metrics_close(pooled, expected)
        assert mismatch is not None and "differ across ranks" in mismatch
