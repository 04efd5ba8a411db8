"""The tool demo (yaml_configs/demo_cpu_tools.yaml) over several seeds: one table and one plot.

    python -m tools.make_tool_demo_model --out runs/demo_cpu_tools
    for s in 1 2 3 4; do
      megatron-grpo train --config yaml_configs/demo_cpu_tools.yaml trainer.seed=$s \\
          trainer.run_dir=runs/tools_seeds/s$s checkpoint.save_every=0 checkpoint.resume=never \\
          logging.progress_bar=false
    done
    python -m tools.bench.tool_demo_seeds runs/tools_seeds --seeds 1 2 3 4 --plot docs/images/tool_demo_seeds.png

Every seed starts from the same warm-up model (``make_tool_demo_model.py --seed 0``);
``trainer.seed`` draws the prompts and the sampling seeds. Per seed (run dir ``<runs>/s<seed>``),
the table gives the training reward (``reward_mean``, 128 episodes per step) averaged over the
first 10 steps, the last 20 and the last 5, the best 5-step mean, the model turns per episode
over the last 20 steps, and the run's training time (``train_elapsed_s``). The plot draws each
seed's 5-step rolling mean of the reward against the step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib
import numpy as np


from tools.bench.common import rolling, run_records, seed_dir


def seed_row(seed: int, rows: list[dict]) -> dict:
    """The table's numbers of one run (``rows``: its metrics.jsonl records, step order)."""
    reward = [r["reward_mean"] for r in rows]
    turns = [r["multi_turn/turns_mean"] for r in rows]
    return {"seed": seed, "steps": len(rows), "first10": float(np.mean(reward[:10])),
            "last20": float(np.mean(reward[-20:])), "last5": float(np.mean(reward[-5:])),
            "best5": float(rolling(reward, 5).max()), "turns_last20": float(np.mean(turns[-20:])),
            "train_s": float(rows[-1].get("train_elapsed_s", float("nan")))}


def table(rows: list[dict]) -> str:
    lines = ["| seed | steps | reward, steps 1-10 | last 20 steps | last 5 steps | best 5-step mean | "
             "turns per episode, last 20 | training time (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['steps']} | {r['first10']:.3f} | {r['last20']:.3f} | {r['last5']:.3f} | "
                     f"{r['best5']:.3f} | {r['turns_last20']:.2f} | {r['train_s']:.0f} |")
    if len(rows) > 1:
        def ms(key):
            v = np.array([r[key] for r in rows])
            return f"{v.mean():.3f} ± {v.std(ddof=1):.3f}"
        lines.append(f"| mean ± std | | {ms('first10')} | {ms('last20')} | {ms('last5')} | {ms('best5')} | | |")
    return "\n".join(lines)


def plot(runs: dict[int, list[dict]], out: Path) -> None:
    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt  # after the backend is chosen

    fig, ax = plt.subplots(figsize=(7, 4))
    for seed, rows in runs.items():
        steps = [r["step"] for r in rows]
        ax.plot(steps, rolling([r["reward_mean"] for r in rows], 5), label=f"seed {seed}")
    ax.axhline(1 / 199, color="grey", linestyle=":", label="a guess (1/199)")
    ax.set_xlabel("step (128 episodes each)")
    ax.set_ylabel("reward, 5-step rolling mean")
    ax.set_ylim(0, 1)
    ax.set_title("tool demo (calculator), CPU, embedded engine")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, help="directory holding s<seed>/metrics.jsonl")
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--plot", type=Path, default=None, help="write the reward curves here (PNG)")
    args = p.parse_args(argv)
    runs = {s: run_records(seed_dir(args.runs, s)) for s in args.seeds}
    missing = [s for s, rows in runs.items() if not rows]
    if missing:
        print(f"error: no metrics.jsonl for seed(s) {missing} under {args.runs}", file=sys.stderr)
        return 2
    print(table([seed_row(s, rows) for s, rows in runs.items()]))
    if args.plot:
        plot(runs, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
