"""The real-model run (launch/smollm2_cpu.sh) over several seeds, and its table.

    python -m tools.bench.smollm2_seeds --seeds 1 2 3 [--out runs/smollm2_seeds] [section.key=value ...]

Each seed is one ``RUN_DIR=<out>/s<seed> bash launch/smollm2_cpu.sh trainer.seed=<seed>``
(the same model and data files for every seed; ``trainer.seed`` draws the prompts and the
sampling seeds); a seed whose run has its transformers re-score already is read, not run
again (``--table-only`` never runs). Then one markdown table: per seed the held-out greedy
accuracy before training (the step-0 evaluation) and after (the last evaluation, and the
exported checkpoint re-scored by plain transformers), the sampled pass@1 and pass@4 before and
after, the gain, the steps and training seconds; then the mean, the spread (min-max) and how
many seeds reached ``--target`` (the gain in greedy accuracy asked for).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


from tools.bench.common import ROOT, fmt, reward_rows, run_records, seed_dir


RESCORE_FILE = "transformers_greedy.json"


def summarize(rows: list[dict], rescore: dict | None) -> dict:
    """One seed's row: first and last evaluation of each set, the re-score, steps and seconds."""
    evals = [r for r in rows if "eval/greedy/pass@1" in r]
    train = reward_rows(rows)
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    phases = ("generate", "reward", "logprob", "train", "sync")
    return {
        "greedy_start": first.get("eval/greedy/pass@1"), "greedy_end": last.get("eval/greedy/pass@1"),
        "sampled_start": first.get("eval/sampled/pass@1"), "sampled_end": last.get("eval/sampled/pass@1"),
        "pass4_start": first.get("eval/sampled/pass@4"), "pass4_end": last.get("eval/sampled/pass@4"),
        "transformers_end": rescore["accuracy"] if rescore else None,
        "first_eval_step": first.get("step"), "last_eval_step": last.get("step"),
        "steps": len(train), "seconds": train[-1].get("train_elapsed_s") if train else None,
        "skipped": sum(int(r.get("skipped_zero_advantage", 0)) for r in train),
        "step_s": {p: statistics.median(r.get(f"time/{p}_s", 0.0) for r in train) for p in phases} if train else {},
    }


def run_seed(seed: int, out: Path, extra: list[str]) -> Path:
    run_dir = seed_dir(out, seed)
    if (run_dir / RESCORE_FILE).is_file():
        return run_dir
    env = dict(os.environ, RUN_DIR=str(run_dir))
    subprocess.run(["bash", str(ROOT / "launch/smollm2_cpu.sh"), f"trainer.seed={seed}", "logging.progress_bar=false",
                    *extra], cwd=ROOT, env=env, check=True)
    return run_dir


def table(rows: dict[int, dict], target: float) -> str:
    """The markdown table of ``rows`` (seed -> summarize's dict) with its summary lines."""
    lines = ["| seed | greedy before | greedy after (engine) | greedy after (transformers) | gain | sampled pass@1 "
             "before -> after | pass@4 before -> after | steps (skipped) | training s |",
             "|---|---|---|---|---|---|---|---|---|"]
    gains = {}
    for seed, r in rows.items():
        if r["greedy_start"] is not None and r["greedy_end"] is not None:
            gains[seed] = r["greedy_end"] - r["greedy_start"]
        lines.append(f"| {seed} | {fmt(r['greedy_start'])} | {fmt(r['greedy_end'])} | {fmt(r['transformers_end'])} | "
                     f"{fmt(gains.get(seed), '+.3f')} | {fmt(r['sampled_start'])} -> {fmt(r['sampled_end'])} | "
                     f"{fmt(r['pass4_start'])} -> {fmt(r['pass4_end'])} | {r['steps']} ({r['skipped']}) | "
                     f"{fmt(r['seconds'], '.0f')} |")
    if gains:
        g = list(gains.values())
        lines.append("")
        lines.append(f"greedy gain: mean {statistics.mean(g):+.3f}, min {min(g):+.3f}, max {max(g):+.3f}; "
                     f"{sum(x >= target for x in g)} of {len(g)} seeds >= {target:+.2f}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--out", type=Path, default=ROOT / "runs/smollm2_seeds")
    p.add_argument("--target", type=float, default=0.25, help="gain in held-out greedy accuracy asked for")
    p.add_argument("--table-only", action="store_true", help="read the runs there are; run nothing")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    p.add_argument("overrides", nargs="*", help="section.key=value for every run")
    args = p.parse_args()
    rows = {}
    for seed in args.seeds:
        run_dir = seed_dir(args.out, seed) if args.table_only else run_seed(seed, args.out, args.overrides)
        rescore = run_dir / RESCORE_FILE
        rows[seed] = summarize(run_records(run_dir), json.loads(rescore.read_text()) if rescore.is_file() else None)
    print(table(rows, args.target))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
