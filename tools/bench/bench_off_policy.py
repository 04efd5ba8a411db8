"""Off-policy corrections compared, several seeds per arm: one table and one plot per workload.

Two workloads:

* ``--workload reasoning`` (the main one): the CPU reasoning workload (docs/reasoning.md;
  chains of thought of tens of tokens, a long tail to ~160), where a per-token mismatch
  compounds over a response. Arms: the unquantized baseline; fp8 rollouts (``--fp8-format``,
  e5m2 by default: the larger mismatch) with no correction, token TIS, sequence TIS and the
  geometric mask; top-p 0.8 with and without sampling-mask replay; one-step off-policy with and
  without correction; asynchronous rollouts at k = 1, 2, 4 with correction and k = 4 without.
  Held-out pass@1 is evaluated every ``--eval-every`` steps (64 problems x 8 samples)::

      python -m tools.make_reasoning_model --out runs/reasoning_cpu
      python -m tools.bench.bench_off_policy --workload reasoning --steps 100 --seeds 1 2 3 4 5 --jobs 2

* ``--workload demo_bf16`` (the first comparison, docs/off_policy.md): the one-token CPU demo
  with the trainer in bf16 and the engine in float32::

      python -m tools.make_demo_model --out runs/demo_cpu_bf16
      python -m tools.bench.bench_off_policy --steps 30 --seeds 1 2 --out runs/bench_off_policy

Each (arm, seed) is one real ``megatron-grpo train`` run in ``OUT/<arm>_s<seed>/``, ``--jobs``
of them at a time (seed-major, so a cut-short bench has every arm at the first seeds). A
finished run (its metrics.jsonl has the last step) is not run again and an unfinished one
starts over, so the script can be restarted; ``--table-only`` only rebuilds the outputs:
``OUT/table.md`` (per arm the mean over seeds and the per-seed values) and, for the reasoning
workload, ``OUT/plot.png`` (held-out pass@1 and the fraction of tokens with rho outside
[0.9, 1.1] against the step, each arm's mean over seeds with its min-to-max band).

Reasoning columns: held-out pass@1 at the end, averaged over the last three evals (less eval
noise than one) and at its best; how many seeds reached pass@1 >= TARGET,
at which step and after how many seconds of training steps (evals excluded; means over those
that did); how many collapsed (final held-out pass@1 below
COLLAPSE); the mean training reward; the median seconds per step and the mean load average;
and, averaged over the steps, |log mu - log pi_old|, the fraction of tokens with rho outside
[0.9, 1.1], k3 KL, the extremes of rho, the mean token lag (the policy lag where the
mode logs no per-token lag; 0 in sync mode), the groups an async run found past the bound
(regenerated or dropped, per run), and what the correction cut: the fractions of
tokens or sequences whose TIS weight hit its cap and of sequences a mask dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from megatron_grpo.runtime.files import write_text_atomic


from tools.bench.common import ROOT, fmt, reward_rows, run_records

_OPC = "algorithm.off_policy_correction"
OFF = [f"{_OPC}.tis_ratio_type=null"]
TOKEN_TIS = [f"{_OPC}.tis_ratio_type=token", f"{_OPC}.token_tis_ratio_clip_high=2.0"]
SEQUENCE_TIS = [f"{_OPC}.tis_ratio_type=sequence", f"{_OPC}.sequence_tis_ratio_clip_high=5.0"]
GEO_MASK = [*OFF, f"{_OPC}.sequence_mask_metric=geometric", f"{_OPC}.geo_mask_low=0.99", f"{_OPC}.geo_mask_high=1.01"]
STALE = [*SEQUENCE_TIS, f"{_OPC}.outlier_token_is_threshold_low=1.0e-4",
         f"{_OPC}.outlier_token_is_threshold_high=100.0"]  # docs/off_policy.md's starter 3

TARGET = 0.30
"""Held-out pass@1 that counts as reached (the reasoning model starts near 0.23)."""
COLLAPSE = 0.10
"""A run whose final held-out pass@1 is below this collapsed (less than half the start)."""
PASS1 = "eval/heldout/pass@1"


def reasoning_arms(fp8_format: str) -> dict[str, list[str]]:
    """Arm name -> overrides on top of yaml_configs/reasoning_cpu.yaml."""
    fp8 = ["engine.quantization=fp8", f"engine.fp8_format={fp8_format}"]
    top_p = ["rollout.top_p=0.8"]
    return {
        "baseline": OFF,
        "fp8_off": [*fp8, *OFF],
        "fp8_token_tis": [*fp8, *TOKEN_TIS],
        "fp8_sequence_tis": [*fp8, *SEQUENCE_TIS],
        "fp8_geo_mask": [*fp8, *GEO_MASK],
        "top_p_replay": [*top_p, "rollout.sampling_mask_replay=true", *OFF],
        "top_p_no_replay": [*top_p, "rollout.sampling_mask_replay=false", *OFF],
        "one_step_off": ["rollout.mode=one_step_off_policy", *OFF],
        "one_step_corrected": ["rollout.mode=one_step_off_policy", *STALE],
        "async_k1": ["rollout.mode=async", "rollout.max_staleness=1", *STALE],
        "async_k2": ["rollout.mode=async", "rollout.max_staleness=2", *STALE],
        "async_k4": ["rollout.mode=async", "rollout.max_staleness=4", *STALE],
        "async_k4_off": ["rollout.mode=async", "rollout.max_staleness=4", *OFF],
    }


def demo_arms(_fp8_format: str) -> dict[str, list[str]]:
    """The bf16 demo's four arms (docs/off_policy.md, "Measured: bf16 trainer, fp32 engine")."""
    return {"off": OFF, "token_tis": TOKEN_TIS, "sequence_tis": SEQUENCE_TIS, "geo_mask": GEO_MASK}


@dataclass(frozen=True)
class Workload:
    config: str
    arms: Callable[[str], dict[str, list[str]]]
    fixed: Callable[[int], list[str]]
    """eval_every -> the overrides every run of the workload gets."""
    held_out: bool


WORKLOADS = {
    "reasoning": Workload(
        "yaml_configs/reasoning_cpu.yaml", reasoning_arms,
        # one rank per run (TP1): two runs side by side use the two cores better than one TP2
        # run, whose engine generates on one core while the other waits
        lambda every: ["parallel.tp=1", "parallel.world_size=1", f"eval.every_n_steps={every}",
                       "logging.plot=false"],
        held_out=True),
    "demo_bf16": Workload("yaml_configs/demo_cpu_bf16.yaml", demo_arms,
                          lambda every: ["eval.every_n_steps=0"], held_out=False),
}


def run_args(workload: Workload, arm: list[str], seed: int, steps: int, run_dir: Path, eval_every: int,
             extra: list[str]) -> list[str]:
    """The ``megatron-grpo train`` command of one run."""
    return [sys.executable, "-m", "megatron_grpo.cli", "train", "--config", workload.config, *arm,
            *workload.fixed(eval_every), f"trainer.seed={seed}", f"trainer.num_steps={steps}",
            f"trainer.run_dir={run_dir}", "checkpoint.save_every=0", "checkpoint.resume=never",
            "logging.progress_bar=false", *extra]


def step_rows(run_dir: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl that carry a training step's reward."""
    return reward_rows(run_records(run_dir))


def _values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and r[key] == r[key]]


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def run_summary(rows: list[dict], target: float = TARGET, collapse: float = COLLAPSE) -> dict:
    """One run's numbers (module docstring); NaN where the run has no such metric."""
    evals = [(r["step"], float(r[PASS1])) for r in rows if PASS1 in r]
    reached = next((step for step, v in evals if v >= target), None)
    final = evals[-1][1] if evals else float("nan")
    lag = _values(rows, "rollout/token_lag_mean") or _values(rows, "rollout/policy_lag")  # async, else one-step
    # the steps' wall time without the held-out evals, up to the step that reached the target
    to_target = None if reached is None else sum(
        r.get("time/step_s", 0.0) - r.get("time/eval_s", 0.0) for r in rows if r["step"] <= reached)
    return {
        "final": final,
        "best": max((v for _, v in evals), default=float("nan")),
        "last3": _mean([v for _, v in evals[-3:]]),
        "reached": reached,
        "to_target_s": to_target,
        "collapsed": bool(evals) and final < collapse,
        "reward": _mean(_values(rows, "reward_mean")),
        "reward_final": rows[-1]["reward_mean"] if rows else float("nan"),
        "reward_tail10": _mean(_values(rows[-10:], "reward_mean")),
        "step_s": statistics.median(_values(rows[1:], "time/step_s") or [float("nan")]),
        "abs_diff": _mean(_values(rows, "rollout_train_logprobs_abs_diff_mean")),
        "outside": _mean(_values(rows, "is_ratio_outside_10pct")),
        "k3": _mean(_values(rows, "k3_kl")),
        "rho_min": min(_values(rows, "is_ratio_min"), default=float("nan")),
        "rho_max": max(_values(rows, "is_ratio_max"), default=float("nan")),
        "lag": _mean(lag) if lag else 0.0,
        "stale": rows[-1].get("async/groups_stale_total", 0.0) if rows else 0.0,
        "geo_masked": _mean(_values(rows, "geo_sequence_mask_masked_ratio")),
        "binds": {label: _mean(v) for label, key in BINDS if (v := _values(rows, key))},
        "kept_mass": _mean(_values(rows, "rollout/log_kept_mass_mean")),
    }


BINDS = [("tokens clipped", "tis_token_clip_high_ratio"), ("seqs clipped", "tis_seq_clip_high_ratio"),
         ("seqs masked", "geo_sequence_mask_masked_ratio"), ("outlier seqs", "outlier_seq_masked_ratio")]
"""(label, metric) of what a correction cut, each averaged over the steps: where the caps bind."""


def _binds(summaries: list[dict]) -> str:
    """``label value`` for each cut the arm's runs logged (mean over seeds), or ``-``."""
    labels = [label for label, _ in BINDS if any(label in x["binds"] for x in summaries)]
    return ", ".join(f"{label} {sig3(_mean([x['binds'][label] for x in summaries if label in x['binds']]))}"
                     for label in labels) or "-"


def sig3(x) -> str:
    """A table cell of three significant digits (``fmt``'s None, bool and NaN cells)."""
    return fmt(x, ".3g")


def _cell(per_seed: list, how=_mean) -> str:
    """``mean (v1, v2, ...)`` over seeds."""
    head = sig3(how([v for v in per_seed if v == v])) if per_seed else "n/a"
    return head + (" (" + ", ".join(sig3(v) for v in per_seed) + ")" if len(per_seed) > 1 else "")


REASONING_COLUMNS: list[tuple[str, Callable[[list[dict]], str]]] = [
    ("final held-out pass@1", lambda s: _cell([x["final"] for x in s])),
    ("pass@1, last 3 evals", lambda s: _cell([x["last3"] for x in s])),
    ("best pass@1", lambda s: _cell([x["best"] for x in s])),
    (f"reached {TARGET}: seeds, mean step", lambda s: f"{sum(x['reached'] is not None for x in s)}/{len(s)}, "
     + (sig3(_mean(steps)) if (steps := [x["reached"] for x in s if x["reached"] is not None]) else "-")),
    ("s to reach it", lambda s: sig3(_mean(t)) if (t := [x["to_target_s"] for x in s if x["reached"] is not None])
     else "-"),
    ("collapsed", lambda s: f"{sum(x['collapsed'] for x in s)}/{len(s)}"),
    ("train reward, all steps", lambda s: _cell([x["reward"] for x in s])),
    ("s / step", lambda s: sig3(_mean([x["step_s"] for x in s]))),
    ("\\|Δlogp\\| mean", lambda s: sig3(_mean([x["abs_diff"] for x in s]))),
    ("rho outside [0.9, 1.1]", lambda s: sig3(_mean([x["outside"] for x in s]))),
    ("k3 KL", lambda s: sig3(_mean([x["k3"] for x in s]))),
    ("rho min / max", lambda s: f"{sig3(min((x['rho_min'] for x in s), default=float('nan')))} / "
     f"{sig3(max((x['rho_max'] for x in s), default=float('nan')))}"),
    ("token lag", lambda s: sig3(_mean([x["lag"] for x in s]))),
    ("stale groups", lambda s: sig3(_mean([x["stale"] for x in s]))),
    ("what the correction cut", _binds),
]

DEMO_COLUMNS: list[tuple[str, Callable[[list[dict]], str]]] = [
    ("final reward", lambda s: _cell([x["reward_final"] for x in s])),
    ("reward, last 10 steps", lambda s: _cell([x["reward_tail10"] for x in s])),
    ("reward, all steps", lambda s: _cell([x["reward"] for x in s])),
    ("abs diff mean", lambda s: sig3(_mean([x["abs_diff"] for x in s]))),
    ("k3 KL", lambda s: sig3(_mean([x["k3"] for x in s]))),
    ("rho min / max", lambda s: f"{sig3(min((x['rho_min'] for x in s), default=float('nan')))} / "
     f"{sig3(max((x['rho_max'] for x in s), default=float('nan')))}"),
    ("geo-masked seqs", lambda s: sig3(_mean([x["geo_masked"] for x in s]))),
]


def table(out: Path, workload: Workload, arms: list[str], seeds: list[int], steps: int, command: str,
          loads: dict[str, float]) -> str:
    """Markdown: one row per arm over the seeds whose run finished."""
    columns = REASONING_COLUMNS if workload.held_out else DEMO_COLUMNS
    lines = ["| arm | " + " | ".join(c[0] for c in columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for arm in arms:
        summaries = [run_summary(rows) for rows in (step_rows(out / f"{arm}_s{s}") for s in seeds)
                     if len(rows) >= steps]
        cells = [render(summaries) if summaries else "n/a" for _, render in columns]
        lines.append(f"| {arm} ({len(summaries)}/{len(seeds)} seeds) | " + " | ".join(cells) + " |")
    load = f"; mean 1-min load average over the runs {_mean(list(loads.values())):.1f} on {os.cpu_count()} cores" \
        if loads else ""
    return ("\n".join(lines) + f"\n\nCells: mean over seeds (per-seed values). {steps} steps per run{load}.\n"
            f"Command: `{command}`\n")


def _mean_curve(runs: list[list[dict]], key: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, min, max) over ``runs`` of ``key`` at the steps every run logged it."""
    by_run = [{r["step"]: float(r[key]) for r in rows if key in r} for rows in runs]
    steps = sorted(set.intersection(*(set(d) for d in by_run))) if by_run else []
    values = [[d[step] for d in by_run] for step in steps]
    return steps, [statistics.fmean(v) for v in values], [min(v) for v in values], [max(v) for v in values]


def write_plot(out: Path, arms: list[str], seeds: list[int], steps: int) -> Path:
    """``OUT/plot.png``: per arm, the mean over its finished seeds (band: min to max) of held-out
    pass@1 and of the fraction of tokens with rho outside [0.9, 1.1], against the step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 5.5))
    FigureCanvasAgg(fig)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for i, arm in enumerate(arms):
        runs = [rows for rows in (step_rows(out / f"{arm}_s{seed}") for seed in seeds) if len(rows) >= steps]
        if not runs:
            continue
        style = dict(color=f"C{i % 10}", linestyle=["-", "--", ":"][(i // 10) % 3])
        label = f"{arm} ({len(runs)} seeds)"
        for ax, key in ((left, PASS1), (right, "is_ratio_outside_10pct")):
            x, mean, low, high = _mean_curve(runs, key)
            if x:
                ax.plot(x, mean, label=label, **style)
                if ax is left and len(runs) > 1:
                    ax.fill_between(x, low, high, color=style["color"], alpha=0.08)
    left.set(title="held-out pass@1: mean over seeds (band: min to max)", xlabel="step")
    left.axhline(TARGET, color="grey", linewidth=0.8)
    right.set(title="fraction of tokens with rho outside [0.9, 1.1] (mean over seeds)", xlabel="step")
    right.set_yscale("symlog", linthresh=1e-4)
    right.set_ylim(0, 1)
    left.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out / "plot.png"
    tmp = out / "plot.png.tmp"
    fig.savefig(tmp, format="png", dpi=90)
    os.replace(tmp, path)
    return path


def _run(cmd: list[str], run_dir: Path, env: dict) -> subprocess.Popen:
    """Start one run (an unfinished earlier attempt is removed first); output to ``<run_dir>.log``."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=list(WORKLOADS), default="demo_bf16")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--arms", nargs="+", help="a subset of the workload's arms, in this order (default: all)")
    p.add_argument("--fp8-format", default="e5m2", choices=["e4m3", "e5m2"],
                   help="engine.fp8_format of the reasoning workload's fp8 arms")
    p.add_argument("--eval-every", type=int, default=20, help="held-out eval every N steps (reasoning)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    p.add_argument("--out", default=None, help="default: runs/bench_off_policy[_reasoning]")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("overrides", nargs="*", help="extra section.key=value overrides for every run")
    args = p.parse_args(argv)
    workload = WORKLOADS[args.workload]
    all_arms = workload.arms(args.fp8_format)
    arms = args.arms or list(all_arms)
    unknown = [a for a in arms if a not in all_arms]
    if unknown:
        p.error(f"--arms: unknown {unknown} for --workload {args.workload} (choose from {', '.join(all_arms)})")
    if args.jobs < 1 or args.steps < 1:
        p.error("--jobs and --steps must be >= 1")
    out = Path(args.out or ("runs/bench_off_policy" + ("_reasoning" if workload.held_out else "")))
    command = "python -m tools.bench.bench_off_policy " + " ".join(sys.argv[1:] if argv is None else argv)
    loads_path = out / "loads.json"
    loads: dict[str, float] = json.loads(loads_path.read_text()) if loads_path.exists() else {}

    def outputs() -> str:
        text = table(out, workload, arms, args.seeds, args.steps, command, loads)
        write_text_atomic(out / "table.md", text)
        if workload.held_out:
            write_plot(out, arms, args.seeds, args.steps)
        return text

    failed = 0
    if not args.table_only:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        todo = [(arm, seed) for seed in args.seeds for arm in arms  # seed-major
                if len(step_rows(out / f"{arm}_s{seed}")) < args.steps]
        running: dict[str, tuple[subprocess.Popen, float, list[float]]] = {}
        while todo or running:
            while todo and len(running) < args.jobs:
                arm, seed = todo.pop(0)
                name = f"{arm}_s{seed}"
                cmd = run_args(workload, all_arms[arm], seed, args.steps, out / name, args.eval_every, args.overrides)
                running[name] = (_run(cmd, out / name, env), time.monotonic(), [])
            time.sleep(2.0)
            for name, (proc, started, samples) in list(running.items()):
                samples.append(os.getloadavg()[0])
                if proc.poll() is None and time.monotonic() - started < args.timeout:
                    continue
                if proc.poll() is None:  # past its deadline: the whole run's process group goes
                    os.killpg(proc.pid, 9)
                    proc.wait()
                del running[name]
                loads[name] = _mean(samples)
                write_text_atomic(loads_path, json.dumps(loads, indent=1))
                failed += proc.returncode != 0
                print(f"{name}: exit {proc.returncode} after {time.monotonic() - started:.0f} s", flush=True)
                outputs()
    print(outputs())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
