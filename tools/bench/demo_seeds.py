"""The CPU demo (yaml_configs/demo_cpu.yaml) over several seeds: what fraction keeps the README's promise.

    bash launch/demo_cpu.sh trainer.num_steps=0      # or: python -m tools.make_demo_model --out runs/demo_cpu
    python -m tools.bench.demo_seeds --seeds 101 102 103 104 105 --out runs/demo_seeds

Each seed is one ``megatron-grpo train --config yaml_configs/demo_cpu.yaml trainer.seed=S``
(everything else as the README's command runs it: the same model, built once by
``tools/make_demo_model.py`` with its fixed seed; ``trainer.seed`` draws the prompts and the
sampling seeds) in ``<out>/s<seed>``; a seed whose run finished is read, not run again. Then one
table: per seed the best 20-step mean training reward and the step it ended at, the first step
at which the 20-step mean reached ``--target`` (the README's promise), the mean of the last
100 steps, the held-out pass@1 of the last evaluation and the training time; and the fraction of
seeds that reached the target. Extra ``section.key=value`` arguments go to every run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tools.bench.common import ROOT, fmt, reward_rows, rolling, run_records, seed_dir


def summarize(rows: list[dict], target: float, window: int = 20) -> dict:
    """One seed's row of the table from its metrics records (steps in order)."""
    train = reward_rows(rows)
    steps = [r["step"] for r in train]
    mean = rolling([r["reward_mean"] for r in train], window)
    full = mean[window - 1:]  # only full windows count
    # the first window at the best value (cumulative sums differ in the last bits between equal windows)
    best = int(np.argmax(full >= full.max() - 1e-9)) + window - 1 if len(full) else None
    hit = next((steps[i] for i in range(window - 1, len(mean)) if mean[i] >= target), None)
    evals = [r for r in rows if "eval/heldout/pass@1" in r]
    return {"steps": len(train), "best": None if best is None else float(mean[best]),
            "best_step": None if best is None else steps[best], "hit_step": hit,
            "last100": float(np.mean([r["reward_mean"] for r in train[-100:]])) if train else None,
            "heldout": evals[-1]["eval/heldout/pass@1"] if evals else None,
            "seconds": train[-1].get("train_elapsed_s") if train else None}


def run_seed(seed: int, out: Path, demo: Path, extra: list[str]) -> Path:
    run_dir = seed_dir(out, seed)
    if (run_dir / "done").is_file():
        return run_dir
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "train", "--config", str(ROOT / "yaml_configs/demo_cpu.yaml"),
           f"model.hf_dir={demo / 'model'}", f"data.train_file={demo / 'arithmetic.jsonl'}",
           f"eval.sets=[{{name: heldout, path: {demo / 'arithmetic_heldout.jsonl'}, n: 8, temperature: 1.0}}]",
           f"trainer.seed={seed}", f"trainer.run_dir={run_dir}", "checkpoint.save_every=0",
           "checkpoint.resume=never", "logging.progress_bar=false", "logging.plot=false", *extra]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    (run_dir / "done").write_text(" ".join(cmd) + "\n")
    return run_dir


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--out", type=Path, default=ROOT / "runs/demo_seeds")
    p.add_argument("--demo", type=Path, default=ROOT / "runs/demo_cpu",
                   help="a tools/make_demo_model.py directory (built there if missing)")
    p.add_argument("--target", type=float, default=0.9, help="20-step mean training reward to reach")
    p.add_argument("overrides", nargs="*", help="section.key=value for every run")
    args = p.parse_args()
    if not (args.demo / "model" / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "tools.make_demo_model", "--out", str(args.demo)],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    table = []
    for seed in args.seeds:
        table.append((seed, summarize(run_records(run_seed(seed, args.out, args.demo, args.overrides)), args.target)))
        print(f"seed {seed} done", flush=True)
    print(f"\n| seed | steps | best 20-step mean (step) | first step with a 20-step mean >= {args.target} | "
          "last 100 steps | held-out pass@1, last eval | training s |")
    print("|---|---|---|---|---|---|---|")
    for seed, s in table:
        print(f"| {seed} | {s['steps']} | {fmt(s['best'], '.3f')} ({fmt(s['best_step'], 'd')}) | "
              f"{fmt(s['hit_step'], 'd') if s['hit_step'] is not None else 'never'} | {fmt(s['last100'], '.3f')} | "
              f"{fmt(s['heldout'], '.3f')} | {fmt(s['seconds'], '.0f')} |")
    reached = sum(s["hit_step"] is not None for _, s in table)
    print(f"\n{reached} of {len(table)} seeds reached a 20-step mean training reward >= {args.target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
