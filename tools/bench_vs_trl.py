"""megatron-grpo vs TRL's GRPOTrainer: wall time per rollout batch and time to a reward.

    bash tools/setup_trl_venv.sh                     # once: .venv-trl with torch 2.13.0 + trl
    python tools/bench_vs_trl.py [--batches 150] [--seeds 1234 1235] [--tp 1 2] [--engines embedded inprocess]

Both sides train the CPU demo's model (``tools/make_demo_model.py``: a tiny Qwen2 at chance
on single-token addition) on the same prompts with the same hyper-parameters: 16 prompts x
16 generations per rollout batch, 4 optimizer steps of 64 sequences per batch, Adam lr 5e-4
(5 warm-up steps, cosine to 5e-5), clip 0.2/0.28, token-mean loss, entropy bonus 0.02, no KL,
group-normalised advantages. megatron-grpo runs ``yaml_configs/demo_cpu.yaml`` (TP ranks over
gloo) at each ``--tp`` with each ``--engines`` (embedded: the engine in its own process, the
default; inprocess: in trainer rank 0's process); TRL runs in one process
with both cores (``--trl-threads``; ``tools/bench_trl_worker.py``, in ``.venv-trl``), generating with
``model.generate`` between optimizer steps.

Reported per run (median over ``--seeds``): wall seconds per rollout batch (the median gap
between consecutive batches, start-up and the first batch excluded), the batch at which the
``--window``-batch rolling mean reward first reaches ``--target``, and the wall time from the
first batch to that one; then the ratio of each megatron-grpo run to TRL. Where our step's
time goes is printed from the trainer's own ``time/*_s`` metrics. Every departure between the
two setups is listed in docs/benchmarks.md next to the table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rolling_hit(rewards: list[float], window: int, target: float) -> int | None:
    """Index (0-based) of the first batch whose trailing ``window``-batch mean reward is >=
    ``target``; None when never."""
    for i in range(window - 1, len(rewards)):
        if sum(rewards[i - window + 1:i + 1]) / window >= target:
            return i
    return None


def summarize(walls: list[float], rewards: list[float], window: int, target: float) -> dict:
    """walls[i]: wall clock (s) at batch i's rollout; rewards[i]: its mean reward."""
    gaps = [b - a for a, b in zip(walls[1:], walls[2:])]  # batch 1 pays one-off start-up costs
    hit = rolling_hit(rewards, window, target)
    return {
        "s_per_batch": statistics.median(gaps) if gaps else float("nan"),
        "hit_batch": None if hit is None else hit + 1,
        "s_to_target": None if hit is None else walls[hit] - walls[0],
        "final_reward": sum(rewards[-window:]) / min(window, len(rewards)),
    }


def _reward_rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl that carry a step's reward ([] when the file is missing)."""
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "reward_mean" in r]


def run_ours(tp: int, mbs: int, seed: int, batches: int, demo: Path, out: Path,
             reuse: bool = False, shuffled: bool = False, engine: str = "embedded") -> tuple[dict, dict]:
    tag = "" if engine == "embedded" else f"_{engine}"  # the embedded runs keep their directories (--reuse)
    run_dir = out / f"ours_tp{tp}_mbs{mbs}_seed{seed}{'_shuffled' if shuffled else ''}{tag}"
    overrides = [
        f"model.hf_dir={demo}/model", f"data.train_file={demo}/arithmetic.jsonl",
        f"trainer.run_dir={run_dir}", f"trainer.num_steps={batches}", f"trainer.seed={seed}",
        f"parallel.tp={tp}", f"parallel.world_size={tp}", f"parallel.micro_batch_size={mbs}", "eval.sets=[]", "checkpoint.save_every=0",
        "checkpoint.resume=never", "logging.progress_bar=false", "logging.plot=false",
        f"algorithm.shuffle_mini_batches={str(shuffled).lower()}", f"rollout.engine={engine}",
        # the TRL worker's schedule (its --lr / --min-lr defaults); the demo itself now runs
        # 2e-4 (yaml_configs/demo_cpu.yaml), and both sides must share one
        "optimizer.lr=5.0e-4", "optimizer.min_lr=5.0e-5",
        # the TRL worker's entropy bonus (its --entropy-coef default); the demo's is 0.05 now
        "algorithm.entropy_coef=0.02",
    ]
    rows = _reward_rows(run_dir / "metrics.jsonl") if reuse else []
    if not rows or rows[-1]["step"] != batches:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "train", "--config",
                        str(ROOT / "yaml_configs/demo_cpu.yaml"), *overrides],
                       check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        rows = _reward_rows(run_dir / "metrics.jsonl")
    times = {k: statistics.median(r[k] for r in rows[1:]) for k in rows[-1]
             if k.startswith("time") and k.endswith("_s") and all(k in r for r in rows[1:])}
    return {"walls": [r["train_elapsed_s"] for r in rows], "rewards": [r["reward_mean"] for r in rows]}, times


def run_trl(python: str, threads: int, seed: int, batches: int, demo: Path, out: Path,
            in_order: bool = False, reuse: bool = False, stop_after: int | None = None) -> dict:
    log = out / f"trl{'_inorder' if in_order else ''}_seed{seed}" / "batches.jsonl"
    done = reuse and log.exists() and any('"done"' in line for line in log.read_text().splitlines())
    if not done:
        subprocess.run([python, str(ROOT / "tools/bench_trl_worker.py"), "--model", f"{demo}/model",
                        "--data", f"{demo}/arithmetic.jsonl", "--batches", str(batches), "--seed", str(seed),
                        "--out", str(log), *(["--in-order"] if in_order else []),
                        *([] if stop_after is None else ["--stop-after", str(stop_after)])], check=True, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    rows = [r for r in rows if "batch" in r]
    return {"walls": [r["wall_s"] for r in rows], "rewards": [r["reward_mean"] for r in rows]}


def first(raw: dict, n: int | None) -> dict:
    """The first ``n`` batches of a run's walls and rewards (all when ``n`` is None)."""
    return {k: v[:n] for k, v in raw.items()}


def median_of(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r[key] is not None]
    if len(vals) < len(runs):
        return None  # a seed never reached the target: no honest median
    return statistics.median(vals)


def fmt(v, spec: str) -> str:
    return "never" if v is None else format(v, spec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=150, help="rollout batches per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="megatron-grpo TP sizes to run")
    p.add_argument("--micro-batch-size", type=int, nargs="+", default=[64],
                   help="megatron-grpo micro-batch sizes to run (64: one micro-batch per optimizer step, as "
                        "TRL's per-device batch; the demo config uses 16)")
    p.add_argument("--engines", nargs="+", default=["embedded"], choices=["embedded", "inprocess", "sglang"],
                   help="megatron-grpo rollout engines to run (rollout.engine): embedded in its own process, "
                        "inprocess in trainer rank 0's")
    p.add_argument("--target", type=float, default=0.5, help="rolling mean reward to reach")
    p.add_argument("--window", type=int, default=10, help="batches in the rolling mean")
    p.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"),
                   help="python of the TRL venv (tools/setup_trl_venv.sh)")
    p.add_argument("--trl-threads", type=int, default=2,
                   help="torch threads of the TRL process (default: the machine's 2 cores, as the "
                        "trainer's rank + engine processes use one each)")
    p.add_argument("--trl-in-order", action="store_true",
                   help="also run TRL with each rollout batch split into optimizer steps in generation "
                        "order (whole prompt groups per step, as megatron-grpo) instead of shuffled")
    p.add_argument("--ours-shuffled", action="store_true",
                   help="also run megatron-grpo with algorithm.shuffle_mini_batches=true (each rollout batch "
                        "shuffled across its optimizer steps, as TRL does)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="compare only the first N batches (TRL stops there; the lr schedules of both "
                        "sides still span --batches)")
    p.add_argument("--reuse", action="store_true",
                   help="read a run whose output in --out is complete (metrics up to the last batch; TRL's "
                        "log marked done) instead of running it again")
    p.add_argument("--out", default=str(ROOT / "runs/bench_vs_trl"))
    args = p.parse_args()
    if not Path(args.trl_python).exists():
        print(f"--trl-python {args.trl_python}: not found; run `bash tools/setup_trl_venv.sh` first",
              file=sys.stderr)
        return 2

    out = Path(args.out)
    demo = out / "demo"
    subprocess.run([sys.executable, str(ROOT / "tools/make_demo_model.py"), "--out", str(demo)],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results: dict[str, list[dict]] = {}
    breakdown: dict[str, dict] = {}
    for seed in args.seeds:  # interleaved, so drifting machine load hits every setup alike
        raw = first(run_trl(args.trl_python, args.trl_threads, seed, args.batches, demo, out, reuse=args.reuse,
                            stop_after=args.stop_after), args.stop_after)
        results.setdefault("TRL GRPOTrainer (1 process)", []).append(
            summarize(raw["walls"], raw["rewards"], args.window, args.target))
        if args.trl_in_order:
            raw = first(run_trl(args.trl_python, args.trl_threads, seed, args.batches, demo, out, in_order=True,
                                reuse=args.reuse, stop_after=args.stop_after), args.stop_after)
            results.setdefault("TRL, optimizer steps in generation order", []).append(
                summarize(raw["walls"], raw["rewards"], args.window, args.target))
        for engine, tp, mbs, shuffled in itertools.product(args.engines, args.tp, args.micro_batch_size,
                                                           [False, True] if args.ours_shuffled else [False]):
            raw, times = run_ours(tp, mbs, seed, args.batches, demo, out, args.reuse, shuffled, engine)
            raw = first(raw, args.stop_after)
            name = (f"megatron-grpo {engine}, TP={tp}, micro-batch {mbs}"
                    + (", shuffled mini-batches" if shuffled else ""))
            results.setdefault(name, []).append(summarize(raw["walls"], raw["rewards"], args.window, args.target))
            breakdown[name] = times
        print(f"seed {seed} done", flush=True)

    trl = results["TRL GRPOTrainer (1 process)"]
    trl_s, trl_hit = median_of(trl, "s_per_batch"), median_of(trl, "s_to_target")
    shown = args.batches if args.stop_after is None else f"first {args.stop_after} of {args.batches}"
    print(f"\n{shown} rollout batches x {len(args.seeds)} seed(s); target: {args.window}-batch "
          f"rolling mean reward >= {args.target}\n")
    print("| setup | s / batch | speed-up vs TRL | batch reaching target | s to target | reward, last "
          f"{args.window} |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        s, hit_s = median_of(runs, "s_per_batch"), median_of(runs, "s_to_target")
        speed = trl_s / s if s else float("nan")
        print(f"| {name} | {s:.2f} | {speed:.2f}x | {fmt(median_of(runs, 'hit_batch'), '.0f')} | "
              f"{fmt(hit_s, '.0f')} | {statistics.median(r['final_reward'] for r in runs):.2f} |")
    if trl_hit is None:
        print("\nTRL never reached the target.")
    print(f"\nPer seed (s / batch, batch reaching target, reward last {args.window}):\n")
    print("| setup | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean |")
    print("|---|" + "---|" * (len(args.seeds) + 1))
    for name, runs in results.items():
        cells = [f"{r['s_per_batch']:.2f}, {fmt(r['hit_batch'], '.0f')}, {r['final_reward']:.2f}" for r in runs]
        hits = [r["hit_batch"] for r in runs]
        mean_hit = fmt(None if None in hits else statistics.fmean(hits), ".0f")
        mean = (f"{statistics.fmean(r['s_per_batch'] for r in runs):.2f}, {mean_hit}, "
                f"{statistics.fmean(r['final_reward'] for r in runs):.2f}")
        print(f"| {name} | " + " | ".join(cells) + f" | {mean} |")
    for name, times in breakdown.items():
        print(f"\n{name}, median seconds per step: " + ", ".join(f"{k}={v:.2f}" for k, v in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
