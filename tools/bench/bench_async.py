"""Throughput of the rollout modes on the CPU demo: sync, one_step_off_policy, async k=1,2,4.

Each arm is one real `megatron-grpo train` run of the demo config (same seed, same steps),
the arms one after the other, repeated ``--rounds`` times in alternating order so that a
change in the machine's load hits every arm alike. Reported per arm: the median wall time per
step (steps 2.. : the first includes no overlap), trained sequences per second, its ratio to
sync within the same round, the mean and max token lag, and the load average around each run.

    python -m tools.make_demo_model --out runs/demo_cpu
    python -m tools.bench.bench_async --demo runs/demo_cpu --steps 12 --out runs/bench_async

Prints a Markdown table; exits non-zero if a run fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from tools.bench.common import ROOT, run_records

ARMS = {
    "sync": ["rollout.mode=sync"],
    "one_step_off_policy": ["rollout.mode=one_step_off_policy"],
    "async k=1": ["rollout.mode=async", "rollout.max_staleness=1"],
    "async k=2": ["rollout.mode=async", "rollout.max_staleness=2"],
    "async k=4": ["rollout.mode=async", "rollout.max_staleness=4"],
}


def train(demo: Path, run_dir: Path, steps: int, arm: list[str], extra: list[str]) -> list[dict]:
    """One run; its metrics.jsonl rows."""
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "train", "--config", "yaml_configs/demo_cpu.yaml",
           f"model.hf_dir={demo / 'model'}", f"data.train_file={demo / 'arithmetic.jsonl'}",
           f"trainer.run_dir={run_dir}", f"trainer.num_steps={steps}", "eval.every_n_steps=0", "eval.sets=[]",
           "checkpoint.save_every=0", "checkpoint.resume=never", "logging.progress_bar=false",
           "logging.plot=false", "engine.kind=embedded", *arm, *extra]  # async needs the launched engine
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise SystemExit(f"{run_dir}: run failed: {out.stderr.strip().splitlines()[-1:]}")
    return run_records(run_dir)


def summarise(rows: list[dict]) -> dict:
    later = rows[1:]
    step_s = statistics.median(r["time/step_s"] for r in later)
    seqs = rows[0].get("num_sequences") or 256
    lags = [r.get("rollout/token_lag_mean", r.get("rollout/policy_lag") or 0) for r in later]
    return {"step_s": step_s, "seq_per_s": seqs / step_s, "lag_mean": statistics.mean(lags),
            "lag_max": max(r.get("rollout/token_lag_max", r.get("rollout/policy_lag") or 0) for r in later),
            "reward_last": statistics.mean(r["reward_mean"] for r in rows[-5:])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, required=True, help="tools/make_demo_model.py's --out")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_async"))
    parser.add_argument("overrides", nargs="*", help="more KEY=VALUE overrides for every run")
    args = parser.parse_args(argv)
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for rnd in range(args.rounds):
        order = list(ARMS) if rnd % 2 == 0 else list(reversed(ARMS))
        for arm in order:
            load_before = os.getloadavg()[0]
            rows = train(args.demo, args.out / f"r{rnd}" / arm.replace(" ", "_").replace("=", ""), args.steps,
                         ARMS[arm], args.overrides)
            results[arm].append({**summarise(rows), "load": (load_before + os.getloadavg()[0]) / 2, "round": rnd})
    print(f"{args.steps} steps per run, {args.rounds} round(s); s/step = median over steps 2..{args.steps}; "
          f"load = 1-min load average on {os.cpu_count()} cores, mean of before and after the run\n")
    print("| mode | round | s / step | seq / s | vs sync (same round) | token lag mean / max | reward, last 5 steps | load |")
    print("|---|---|---|---|---|---|---|---|")
    for arm, runs in results.items():
        for r in runs:
            base = next(s for s in results["sync"] if s["round"] == r["round"])
            print(f"| {arm} | {r['round'] + 1} | {r['step_s']:.2f} | {r['seq_per_s']:.0f} | "
                  f"{base['step_s'] / r['step_s']:.2f}x | {r['lag_mean']:.2f} / {r['lag_max']:.0f} | "
                  f"{r['reward_last']:.3f} | {r['load']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
