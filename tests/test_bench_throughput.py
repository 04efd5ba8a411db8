"""tools/bench/bench_throughput.py: the long-tailed length sampler and the table's reductions
(the benchmark itself runs minutes of training and is not a test)."""

from __future__ import annotations

import random
import statistics

import pytest

import tools.bench.bench_throughput as bench


def test_filler_lengths_are_long_tailed_within_the_response_budget():
    rng = random.Random(0)
    lengths = [bench.filler_length(rng) for _ in range(20000)]
    assert min(lengths) == bench.MIN_FILLER
    assert max(lengths) <= bench.MAX_NEW_TOKENS - 3  # + "####", the number and <eos>
    # MIN_FILLER + a geometric count of extra words with stop probability 1/FILLER_MEAN:
    # mean FILLER_MEAN - 1 extra words, median well below the mean (the long tail)
    assert statistics.fmean(lengths) == pytest.approx(bench.MIN_FILLER + bench.FILLER_MEAN - 1, abs=0.5)
    assert statistics.median(lengths) < statistics.fmean(lengths) - 3
    assert max(lengths) > 4 * statistics.median(lengths)


def test_warmup_response_ends_with_the_answer_after_hash():
    text = bench.warmup_response(random.Random(1), ["so", "then"], [7])
    filler, answer = text.split(" #### ")
    assert answer == "7" and set(filler.split()) <= {"so", "then"}


def _row(step, reward, tokens=100.0, step_s=2.0, elapsed=None):
    return {"step": step, "reward_mean": reward, "num_sequence_tokens": tokens, "time/step_s": step_s,
            "padding_fraction": 0.5, "response_length_mean": 20.0, "response_length_max": 90.0,
            "train_elapsed_s": elapsed if elapsed is not None else 10.0 * step}


def test_summarize_excludes_the_first_step_and_finds_the_rolling_target():
    rows = [_row(1, 0.0, step_s=50.0), _row(2, 0.1), _row(3, 0.3, tokens=300.0), _row(4, 0.5, step_s=1.0)]
    s = bench.summarize(rows, window=2, target=0.2)
    assert s["tokens_per_s"] == pytest.approx((50 + 150 + 100) / 3)  # step 1's 50 s left out
    assert s["step_s"] == pytest.approx(5.0 / 3)
    assert s["hit_step"] == 3 and s["s_to_target"] == 30.0  # (0.1 + 0.3) / 2 = 0.2 at step 3
    assert s["final_reward"] == pytest.approx(0.4)
    assert bench.summarize(rows, window=2, target=0.9)["hit_step"] is None


def test_mean_over_seeds_is_none_when_a_seed_missed_the_target():
    assert bench.mean_or_none([2.0, 4.0]) == 3.0
    assert bench.mean_or_none([2.0, None]) is None
