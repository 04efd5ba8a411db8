"""tools/bench/lora_vs_full.py's table: per arm and seed, the mean with its spread, and each arm's
held-out accuracy at the other's end time (by wall time), from metrics records."""

from tools.bench.lora_vs_full import at_time, curve, table

KEY = "eval/heldout/pass@1"


def _run(step_s: float, heldout: list[float], reward: float) -> list[dict]:
    rows = [{"step": 0, KEY: heldout[0]}]
    for step in range(1, 41):
        row = {"step": step, "reward_mean": reward, "train_elapsed_s": step * step_s, "time/step_s": step_s}
        if step % 20 == 0:
            row[KEY] = heldout[step // 20]
        rows.append(row)
    return rows


def test_curve_and_time_lookup():
    points = curve(_run(2.0, [0.1, 0.3, 0.5], 0.4), KEY)
    assert points == [(0, 0.0, 0.1), (20, 40.0, 0.3), (40, 80.0, 0.5)]
    assert at_time(points, 39.0) == 0.1 and at_time(points, 40.0) == 0.3 and at_time(points, 1e9) == 0.5


def test_table_compares_by_step_and_by_wall_time():
    arms = {"full": {1: _run(2.0, [0.1, 0.3, 0.5], 0.4), 2: _run(2.0, [0.1, 0.2, 0.4], 0.2)},
            "lora": {1: _run(1.0, [0.1, 0.2, 0.3], 0.3), 2: _run(1.0, [0.1, 0.2, 0.3], 0.3)}}
    text = table(arms, KEY)
    assert "| full | mean (min-max) | 0.100 (0.100-0.100) | 0.450 (0.400-0.500) | 0.300 (0.200-0.400) |" in text
    assert "| lora | 1 | 0.100 | 0.300 | 0.300 | 40 | 1.00 |" in text
    # LoRA ends at 40 s, when full had reached 0.3 and 0.2; at full's 80 s LoRA has ended at 0.3
    assert "full at lora's mean end time (40 s of training): held-out 0.250 (0.200-0.300)" in text
    assert "lora at full's mean end time (80 s of training): held-out 0.300 (0.300-0.300)" in text


def test_the_full_arms_lr_is_the_workloads_config():
    """The full arm's lr (and the default LoRA arm's 10x) is read from the config the runs use:
    a hard-coded copy had stayed at 2e-5 after the SmolLM2 config moved to 1e-5."""
    from megatron_grpo.preflight import load_experiment
    from tools.bench.lora_vs_full import ROOT, WORKLOADS, config_lr

    for _key, config, _extra in WORKLOADS.values():
        assert config_lr(config) == load_experiment(ROOT / config).optimizer.lr


def test_a_sweep_is_a_grid_of_named_lora_arms_each_compared_with_full():
    from tools.bench.lora_vs_full import lora_arms

    assert lora_arms(1e-5, None, [], []) == {
        "lora": ["model.lora.rank=16", "model.lora.alpha=32", "optimizer.lr=0.0001"]}
    grid = lora_arms(1e-5, None, [16, 64], [5, 20])
    assert list(grid) == ["lora_r16_lr5x", "lora_r16_lr20x", "lora_r64_lr5x", "lora_r64_lr20x"]
    assert grid["lora_r64_lr20x"] == ["model.lora.rank=64", "model.lora.alpha=128", "optimizer.lr=0.0002"]
    arms = {"full": {1: _run(2.0, [0.1, 0.3, 0.5], 0.4)}, "lora_a": {1: _run(1.0, [0.1, 0.2, 0.3], 0.3)},
            "lora_b": {1: _run(1.0, [0.1, 0.4, 0.6], 0.3)}}
    text = table(arms, KEY)
    assert "lora_a at full's mean end time (80 s of training): held-out 0.300" in text
    assert "lora_b at full's mean end time (80 s of training): held-out 0.600" in text
    assert "full at lora_b's mean end time (40 s of training): held-out 0.300" in text
    assert "lora_a at lora_b's" not in text  # LoRA arms are compared with full, not with each other


def test_the_plot_draws_every_arm(tmp_path):
    from tools.bench.lora_vs_full import plot

    arms = {"full": {1: _run(2.0, [0.1, 0.3, 0.5], 0.4)}, "lora_a": {1: _run(1.0, [0.1, 0.2, 0.3], 0.3)},
            "lora_b": {1: _run(1.0, [0.1, 0.4, 0.6], 0.3)}}
    plot(arms, KEY, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
