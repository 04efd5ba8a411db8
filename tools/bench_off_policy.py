"""The bf16 CPU demo with each off-policy correction, over a few seeds: one comparison table.

    python tools/make_demo_model.py --out runs/demo_cpu_bf16
    python tools/bench_off_policy.py --steps 30 --seeds 1 2 --out runs/bench_off_policy

runs ``megatron-grpo train --config yaml_configs/demo_cpu_bf16.yaml`` (trainer bf16 with fp32
main weights, engine sampling in float32: the mismatch is real) once per (variant, seed), one
after the other, each in ``OUT/<variant>_s<seed>/``, and writes ``OUT/table.md``: per variant the
mean over seeds (and the per-seed values) of the final and rolling reward, the mismatch
metrics and the spread of the IS ratio rho = pi_old / mu. A finished run (its metrics.jsonl
has the last step) is not run again, so the script can be restarted; ``--table-only`` only
rebuilds the table.

Variants (``algorithm.off_policy_correction``): ``off`` (no correction), ``token_tis``
(token TIS, clip 2), ``sequence_tis`` (sequence TIS, clip 5), ``geo_mask`` (the geometric
sequence mask, keep 0.99 <= geometric-mean rho <= 1.01); the rest of the config is the demo's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from megatron_grpo.runtime.files import write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "yaml_configs/demo_cpu_bf16.yaml"
_OPC = "algorithm.off_policy_correction"
VARIANTS: dict[str, list[str]] = {
    "off": [f"{_OPC}.tis_ratio_type=null"],
    "token_tis": [f"{_OPC}.tis_ratio_type=token", f"{_OPC}.token_tis_ratio_clip_high=2.0"],
    "sequence_tis": [f"{_OPC}.tis_ratio_type=sequence", f"{_OPC}.sequence_tis_ratio_clip_high=5.0"],
    "geo_mask": [f"{_OPC}.tis_ratio_type=null", f"{_OPC}.sequence_mask_metric=geometric",
                 f"{_OPC}.geo_mask_low=0.99", f"{_OPC}.geo_mask_high=1.01"],
}
# (column title, metric, how it is reduced over the steps of one run)
COLUMNS = [
    ("final reward", "reward_mean", "last"),
    ("reward, last 10 steps", "reward_mean", "tail10"),
    ("reward, all steps", "reward_mean", "mean"),
    ("abs diff mean", "rollout_train_logprobs_abs_diff_mean", "mean"),
    ("k3 KL", "k3_kl", "mean"),
    ("rho std", "is_ratio_std", "mean"),
    ("rho min", "is_ratio_min", "min"),
    ("rho max", "is_ratio_max", "max"),
    ("geo-masked seqs", "geo_sequence_mask_masked_ratio", "mean"),
]


def run_args(variant: str, seed: int, steps: int, run_dir: Path, extra: list[str]) -> list[str]:
    """The ``megatron-grpo train`` command of one run."""
    return ["megatron-grpo", "train", "--config", CONFIG, *VARIANTS[variant], f"trainer.seed={seed}",
            f"trainer.num_steps={steps}", f"trainer.run_dir={run_dir}", "checkpoint.save_every=0",
            "eval.every_n_steps=0", "logging.progress_bar=false", *extra]


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "reward_mean" in r]


def reduce(rows: list[dict], metric: str, how: str) -> float:
    values = [r[metric] for r in rows if metric in r]
    if not values:
        return float("nan")
    if how == "last":
        return values[-1]
    if how == "tail10":
        return statistics.fmean(values[-10:])
    if how == "min":
        return min(values)
    if how == "max":
        return max(values)
    return statistics.fmean(values)


def fmt(x: float) -> str:
    return "n/a" if x != x else f"{x:.3g}"


def table(out: Path, seeds: list[int], steps: int, command: str) -> str:
    """Markdown: one row per variant, each cell the mean over seeds (per-seed values after)."""
    head = "| variant | " + " | ".join(c[0] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for variant in VARIANTS:
        runs = [read_metrics(out / f"{variant}_s{s}") for s in seeds]
        done = [r for r in runs if len(r) >= steps]
        cells = []
        for _, metric, how in COLUMNS:
            per_seed = [reduce(r, metric, how) for r in done]
            mean = statistics.fmean(per_seed) if per_seed else float("nan")
            cells.append(fmt(mean) + (" (" + ", ".join(fmt(v) for v in per_seed) + ")" if len(per_seed) > 1 else ""))
        lines.append(f"| {variant} ({len(done)}/{len(seeds)} seeds) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nCells: mean over seeds (per-seed values). {steps} steps per run.\nCommand: `{command}`\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--out", default="runs/bench_off_policy")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("overrides", nargs="*", help="extra section.key=value overrides for every run")
    args = p.parse_args(argv)
    out = Path(args.out)
    command = "python tools/bench_off_policy.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if not args.table_only:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        for seed in args.seeds:  # seed-major: a cut-short bench still has every variant at seed 1
            for variant in args.variants:
                run_dir = out / f"{variant}_s{seed}"
                if len(read_metrics(run_dir)) >= args.steps:
                    continue
                run_dir.mkdir(parents=True, exist_ok=True)
                with open(run_dir.parent / f"{variant}_s{seed}.log", "w") as log:
                    rc = subprocess.call(run_args(variant, seed, args.steps, run_dir, args.overrides),
                                         cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
                print(f"{variant} seed {seed}: exit {rc}", flush=True)
                write_text_atomic(out / "table.md", table(out, args.seeds, args.steps, command))
    text = table(out, args.seeds, args.steps, command)
    write_text_atomic(out / "table.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
