"""LoRA against full fine-tuning on the same task over several seeds: reward and held-out
accuracy by step and by wall time, in one table and one plot.

    python -m tools.bench.lora_vs_full --workload demo --seeds 1 2 3 [--steps 300] [--out runs/lora_vs_full]
    python -m tools.bench.lora_vs_full --workload smollm2 --seeds 1 2 3
    python -m tools.bench.lora_vs_full --workload smollm2 --seeds 1 --sweep-ranks 16 64 --sweep-lr-x 5 10 20

Each arm runs every seed through the workload's own seed tool, with ``--full`` / ``--lora``
overrides on top of the workload's config (a finished run is read, not run again):

* ``demo``: ``tools/bench/demo_seeds.py``'s run (yaml_configs/demo_cpu.yaml on the demo model built by
  ``tools/make_demo_model.py`` in ``--demo``), ``trainer.num_steps=--steps``;
* ``smollm2``: ``tools/bench/smollm2_seeds.py``'s run (``launch/smollm2_cpu.sh``: the main job, its
  exported checkpoint re-scored by transformers; a LoRA run's adapters are merged for that).

The default LoRA arm is rank 16, alpha 32 on all four linears at 10x the full run's learning
rate (the usual ratio for LoRA; ``--lora`` replaces it). ``--sweep-ranks`` and ``--sweep-lr-x``
run a grid of LoRA arms instead (alpha = 2 x rank, lr = the multiple x the full run's), each
named ``lora_r<rank>_lr<multiple>x``: which rank and lr match full fine-tuning. Printed: per arm, per seed and the
mean with the spread (min-max): the held-out accuracy at the first and the last evaluation, the mean
training reward of the last 20 steps, the training seconds and the median step; then the
held-out accuracy of each arm at the other's end time (by wall time). The plot
(``<out>/<workload>.png``) draws reward (20-step mean) and held-out accuracy against step and
against training seconds, one line per run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from tools.bench import demo_seeds, smollm2_seeds
from tools.bench.common import ROOT, fmt, reward_rows, rolling, run_records, seed_dir, spread

WORKLOADS = {
    # name: (held-out accuracy key, the config both arms start from, extra overrides of both arms)
    "demo": ("eval/heldout/pass@1", "yaml_configs/demo_cpu.yaml", []),
    "smollm2": ("eval/greedy/pass@1", "yaml_configs/smollm2_135m_chain_sum_cpu.yaml", []),
}
LORA_DEFAULT = ["model.lora.rank=16", "model.lora.alpha=32"]


def config_lr(config: str) -> float:
    """The learning rate of the workload's config: the full arm's, and a tenth of the default
    LoRA arm's (read, not copied here, so that a config change cannot leave it behind)."""
    import yaml

    return float(yaml.safe_load((ROOT / config).read_text())["optimizer"]["lr"])


def run_arm(workload: str, seeds: list[int], out: Path, overrides: list[str], demo: Path) -> dict[int, list[dict]]:
    """Every seed's metrics records of one arm (running the seeds not finished yet)."""
    runs = {}
    for seed in seeds:
        if workload == "demo":
            run_dir = demo_seeds.run_seed(seed, out, demo, overrides)
        else:
            run_dir = smollm2_seeds.run_seed(seed, out, overrides)
        runs[seed] = run_records(run_dir)
    return runs


def curve(rows: list[dict], key: str) -> list[tuple[int, float, float]]:
    """(step, training seconds, value) of every record holding ``key`` (step 0: 0 s)."""
    return [(r["step"], r.get("train_elapsed_s", 0.0) if r["step"] else 0.0, r[key]) for r in rows if key in r]


def at_time(points: list[tuple[int, float, float]], seconds: float) -> float | None:
    """The last value measured at or before ``seconds`` of training."""
    before = [v for _, t, v in points if t <= seconds]
    return before[-1] if before else None


def summarize(rows: list[dict], heldout_key: str) -> dict:
    train = reward_rows(rows)
    evals = curve(rows, heldout_key)
    return {"heldout_start": evals[0][2] if evals else None, "heldout_end": evals[-1][2] if evals else None,
            "reward_last20": statistics.mean(r["reward_mean"] for r in train[-20:]) if train else None,
            "seconds": train[-1].get("train_elapsed_s") if train else None,
            "step_s": statistics.median(r["time/step_s"] for r in train) if train else None,
            "steps": len(train)}


def lora_arms(full_lr: float, lora: list[str] | None, ranks: list[int], multiples: list[float]) -> dict[str, list[str]]:
    """The LoRA arms' overrides by name: the grid of ``ranks`` x lr ``multiples`` of the full
    run's (alpha 2 x rank), or the one arm ``lora`` (default: rank 16, alpha 32, 10x)."""
    if not ranks and not multiples:
        return {"lora": lora if lora is not None else [*LORA_DEFAULT, f"optimizer.lr={10 * full_lr:g}"]}
    return {f"lora_r{r}_lr{m:g}x": [f"model.lora.rank={r}", f"model.lora.alpha={2 * r}", f"optimizer.lr={m * full_lr:g}"]
            for r in ranks or [16] for m in multiples or [10.0]}


def table(arms: dict[str, dict[int, list[dict]]], heldout_key: str) -> str:
    lines = ["| arm | seed | held-out, first eval | held-out, last eval | reward, last 20 steps | training s | "
             "median step s |",
             "|---|---|---|---|---|---|---|"]
    summaries = {arm: {seed: summarize(rows, heldout_key) for seed, rows in runs.items()} for arm, runs in arms.items()}
    for arm, by_seed in summaries.items():
        for seed, s in by_seed.items():
            lines.append(f"| {arm} | {seed} | {fmt(s['heldout_start'])} | {fmt(s['heldout_end'])} | "
                         f"{fmt(s['reward_last20'])} | {fmt(s['seconds'], '.0f')} | {fmt(s['step_s'], '.2f')} |")
        col = lambda k: [s[k] for s in by_seed.values()]  # noqa: E731
        lines.append(f"| {arm} | mean (min-max) | {spread(col('heldout_start'))} | {spread(col('heldout_end'))} | "
                     f"{spread(col('reward_last20'))} | {spread(col('seconds'), '.0f')} | {spread(col('step_s'), '.2f')} |")
    names = list(arms)
    pairs = [(a, b) for a in names for b in names if a != b and "full" in (a, b)]  # each LoRA arm against full
    if pairs:
        lines.append("")
        for a, b in pairs:
            ends = [s["seconds"] for s in summaries[b].values() if s["seconds"]]
            if not ends:
                continue
            t = statistics.mean(ends)
            values = [at_time(curve(rows, heldout_key), t) for rows in arms[a].values()]
            lines.append(f"{a} at {b}'s mean end time ({t:.0f} s of training): held-out {spread(values)}")
    return "\n".join(lines)


def plot(arms: dict[str, dict[int, list[dict]]], heldout_key: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    palette = ["tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]
    colors = {arm: "tab:blue" if arm == "full" else palette[i % len(palette)]
              for i, arm in enumerate(a for a in arms if a != "full")} | {"full": "tab:blue"}
    for arm, runs in arms.items():
        for i, (seed, rows) in enumerate(runs.items()):
            train = reward_rows(rows)
            reward = rolling([r["reward_mean"] for r in train], 20)
            label = arm if i == 0 else None
            axes[0][0].plot([r["step"] for r in train], reward, color=colors.get(arm), alpha=0.7, label=label)
            axes[0][1].plot([r["train_elapsed_s"] for r in train], reward, color=colors.get(arm), alpha=0.7, label=label)
            points = curve(rows, heldout_key)
            axes[1][0].plot([p[0] for p in points], [p[2] for p in points], "o-", color=colors.get(arm), alpha=0.7)
            axes[1][1].plot([p[1] for p in points], [p[2] for p in points], "o-", color=colors.get(arm), alpha=0.7)
    axes[0][0].set(title="training reward (20-step mean)", xlabel="step")
    axes[0][1].set(title="training reward (20-step mean)", xlabel="training seconds")
    axes[1][0].set(title=f"held-out ({heldout_key})", xlabel="step")
    axes[1][1].set(title=f"held-out ({heldout_key})", xlabel="training seconds")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=list(WORKLOADS), required=True)
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--out", type=Path, default=ROOT / "runs/lora_vs_full")
    p.add_argument("--steps", type=int, default=None, help="trainer.num_steps of every run (default: the config's)")
    p.add_argument("--demo", type=Path, default=ROOT / "runs/demo_cpu", help="the demo model (demo workload)")
    p.add_argument("--full", nargs="*", default=[], help="section.key=value of the full arm")
    p.add_argument("--lora", nargs="*", default=None,
                   help="section.key=value of the LoRA arm (default: rank 16, alpha 32, 10x the full lr)")
    p.add_argument("--sweep-ranks", type=int, nargs="*", default=[], help="a grid of LoRA arms: these ranks")
    p.add_argument("--sweep-lr-x", type=float, nargs="*", default=[],
                   help="a grid of LoRA arms: these multiples of the full run's lr")
    p.add_argument("--no-full", action="store_true", help="run the LoRA arms only (the full arm's runs are read "
                   "when they are in --out already)")
    p.add_argument("--table-only", action="store_true", help="read the finished runs; run nothing")
    args = p.parse_args(argv)
    heldout_key, config, common = WORKLOADS[args.workload]
    full_lr = config_lr(config)
    common = common + ([f"trainer.num_steps={args.steps}"] if args.steps else [])
    if args.lora is not None and (args.sweep_ranks or args.sweep_lr_x):
        p.error("--lora and --sweep-ranks/--sweep-lr-x: one LoRA arm or a grid, not both")
    arms_overrides = {"full": common + args.full} | {
        name: common + overrides for name, overrides in lora_arms(full_lr, args.lora, args.sweep_ranks,
                                                                   args.sweep_lr_x).items()}
    arms = {}
    for arm, overrides in arms_overrides.items():
        out = args.out / args.workload / arm
        if args.table_only or (arm == "full" and args.no_full):
            runs = {s: run_records(seed_dir(out, s)) for s in args.seeds}
        else:
            runs = run_arm(args.workload, args.seeds, out, overrides, args.demo)
        arms[arm] = {s: rows for s, rows in runs.items() if rows}
        print(f"{arm}: {' '.join(overrides)}")
    print(table(arms, heldout_key))
    path = args.out / f"{args.workload}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    plot(arms, heldout_key, path)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
