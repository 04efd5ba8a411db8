"""On-policy distillation against GRPO on the real model: three arms, several seeds, one table.

    python -m tools.bench.distill_arms --teacher-run runs/smollm2_cpu --seeds 1 2 3 \
        [--arms grpo distill both] [--out runs/smollm2_distill] [--table-only] [section.key=value ...]

The teacher is the main job's trained model (``<teacher-run>/hf``, launch/smollm2_cpu.sh's
export; its held-out greedy accuracy is that run's last evaluation). Every arm trains the
untrained SmolLM2-135M-Instruct on yaml_configs/smollm2_135m_chain_sum_cpu.yaml, the main job's
config, changed only where the arm says (``ARMS``), with the held-out greedy set evaluated every
``eval_every`` steps (the sampled set left out: it costs twice the greedy one and is not
compared). The untrained model's greedy accuracy (the same for every arm and seed: greedy
decoding of the same weights) is the teacher run's step-0 evaluation.

The table: per arm and seed, the greedy accuracy at each evaluation (and the training seconds
there), and the first evaluated step (and seconds) at which it reaches ``--fraction`` (0.9) of
the teacher's; then each arm's mean and spread, and the steps ratio of each distillation arm to
GRPO. A run whose last evaluation is in its metrics is read, not run again; checkpoints are
deleted after each run (they are not compared, and nine runs would hold ~15 GB).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from tools.bench.common import ROOT, fmt, run_records, seed_dir

CONFIG = "yaml_configs/smollm2_135m_chain_sum_cpu.yaml"
HELDOUT = "runs/smollm2/chain_sum_2term/heldout.jsonl"


@dataclass(frozen=True)
class Arm:
    steps: int
    eval_every: int
    overrides: tuple[str, ...]
    """With ``{teacher}`` for the teacher's folder."""


ARMS = {
    "grpo": Arm(40, 5, ()),
    "distill": Arm(15, 3, ("distillation.teacher={teacher}", "distillation.task_reward=false")),
    "both": Arm(15, 3, ("distillation.teacher={teacher}",)),
}
"""(a) GRPO alone: the main job; (b) distillation alone (no reward trains it); (c) both (the
GRPO advantage plus the teacher's per-token term)."""


def greedy_curve(records: list[dict]) -> list[tuple[int, float, Optional[float]]]:
    """(step, held-out greedy accuracy, training seconds at that step) of each evaluation."""
    return [(r["step"], r["eval/greedy/pass@1"], r.get("train_elapsed_s")) for r in records
            if "eval/greedy/pass@1" in r]


def first_reaching(curve: list[tuple[int, float, Optional[float]]], target: float) -> tuple[Optional[int],
                                                                                           Optional[float]]:
    """(step, seconds) of the first evaluation at or above ``target``; (None, None) if none."""
    return next(((step, s) for step, acc, s in curve if acc >= target - 1e-9), (None, None))


def run_arm(name: str, seed: int, out: Path, teacher: str, extra: list[str]) -> Path:
    arm, run_dir = ARMS[name], seed_dir(out / name, seed)
    curve = greedy_curve(run_records(run_dir))
    if curve and curve[-1][0] == arm.steps:
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    greedy = f"[{{name: greedy, path: {HELDOUT}, n: 1, temperature: 0.0}}]"
    cmd = ["megatron-grpo", "train", "--config", CONFIG, f"trainer.run_dir={run_dir}", f"trainer.seed={seed}",
           f"trainer.num_steps={arm.steps}", f"eval.every_n_steps={arm.eval_every}", "eval.at_start=false",
           f"eval.sets={greedy}", "eval.pass_k=[1]", "logging.progress_bar=false", "logging.plot=false",
           "checkpoint.resume=never", *(o.format(teacher=teacher) for o in arm.overrides), *extra]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return run_dir


def table(curves: dict[str, dict[int, list]], start: float, teacher_acc: float, fraction: float) -> str:
    """The markdown report of ``curves`` (arm -> seed -> ``greedy_curve``)."""
    target = fraction * teacher_acc
    lines = [f"untrained greedy {start:.3f}; teacher greedy {teacher_acc:.3f}; target {fraction:.0%} of it = "
             f"{target:.3f}", "",
             "| arm | seed | greedy at each evaluated step (training s) | reaches the target at step (s) |",
             "|---|---|---|---|"]
    reached: dict[str, list[Optional[int]]] = {}
    for name, seeds in curves.items():
        for seed, curve in seeds.items():
            step, seconds = first_reaching(curve, target)
            reached.setdefault(name, []).append(step)
            points = " / ".join(f"{s}: {fmt(a)} ({fmt(t, '.0f')})" for s, a, t in curve)
            lines.append(f"| {name} | {seed} | {points} | {fmt(step, 'd')} ({fmt(seconds, '.0f')}) |")
    lines.append("")
    for name, seeds in curves.items():
        last = [c[-1][1] for c in seeds.values() if c]
        steps = [s for s in reached[name] if s is not None]
        summary = (f"{name}: last greedy mean {statistics.mean(last):.3f} (min {min(last):.3f}, max {max(last):.3f}); "
                   f"{len(steps)} of {len(reached[name])} seeds reach the target")
        if steps:
            summary += f", at step {statistics.mean(steps):.1f} on average (min {min(steps)}, max {max(steps)})"
        lines.append(summary + ("" if not last else "."))
    if "grpo" in reached and all(s is not None for s in reached["grpo"]):
        grpo = statistics.mean(reached["grpo"])
        for name in curves:
            if name != "grpo" and all(s is not None for s in reached[name]):
                lines.append(f"{name} / grpo steps to the target: {statistics.mean(reached[name]) / grpo:.2f}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.distill_arms", description=__doc__.split("\n")[0])
    parser.add_argument("--teacher-run", type=Path, required=True,
                        help="the main job's run directory (its hf/ export is the teacher)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=["grpo", "distill", "both"])
    parser.add_argument("--out", type=Path, default=Path("runs/smollm2_distill"))
    parser.add_argument("--fraction", type=float, default=0.9, help="of the teacher's greedy accuracy (0.9)")
    parser.add_argument("--table-only", action="store_true", help="read the runs there are; run nothing")
    args, extra = parser.parse_known_args(argv)
    teacher = args.teacher_run / "hf"
    evals = greedy_curve(run_records(args.teacher_run))
    if not (teacher / "config.json").is_file() or not evals:
        print(f"distill_arms: {args.teacher_run} has no hf/ export or no greedy evaluation: run "
              f"RUN_DIR={args.teacher_run} bash launch/smollm2_cpu.sh first", file=sys.stderr)
        return 2
    start = next((acc for step, acc, _ in evals if step == 0), None)
    curves: dict[str, dict[int, list]] = {}
    for name in args.arms:
        for seed in args.seeds:
            run_dir = seed_dir(args.out / name, seed)
            if not args.table_only:
                run_arm(name, seed, args.out, str(teacher.resolve()), extra)
            curves.setdefault(name, {})[seed] = greedy_curve(run_records(run_dir))
    print(table(curves, start if start is not None else float("nan"), evals[-1][1], args.fraction))
    return 0


if __name__ == "__main__":
    sys.exit(main())
