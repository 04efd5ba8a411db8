"""tools/bench/demo_seeds.py's summary of one seed's metrics, against a hand computation."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    return importlib.import_module("tools.bench.demo_seeds")


def test_summary_of_a_seed():
    tool = _tool()
    # steps 1-30 at 0.5, 31-60 at 0.95; an eval row (no reward) after step 60
    rows = [{"step": i, "reward_mean": 0.5 if i <= 30 else 0.95, "train_elapsed_s": float(i)} for i in range(1, 61)]
    rows.append({"step": 60, "eval/heldout/pass@1": 0.625})
    s = tool.summarize(rows, target=0.9)
    # the 20-step mean ending at step 48 holds steps 29-48: (2 * 0.5 + 18 * 0.95) / 20 = 0.905
    assert s["hit_step"] == 48
    assert s["best_step"] == 50 and abs(s["best"] - 0.95) < 1e-12  # the first all-0.95 window
    assert abs(s["last100"] - (30 * 0.5 + 30 * 0.95) / 60) < 1e-12
    assert s["heldout"] == 0.625 and s["seconds"] == 60.0 and s["steps"] == 60
    # never reached; fewer steps than a window: no best
    assert tool.summarize(rows[:60], target=0.99)["hit_step"] is None
    assert tool.summarize(rows[:10], target=0.1)["best"] is None
