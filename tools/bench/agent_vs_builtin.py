"""The tool demo trained two ways on the same seeds: the built-in calculator environment
(yaml_configs/demo_cpu_tools.yaml) and the same calculator as an OpenAI-SDK agent
(yaml_configs/demo_cpu_tools_agent.yaml, examples/agents/calculator_sdk.py). One table.

    python -m tools.make_tool_demo_model --out runs/demo_cpu_tools
    for s in 1 2 3; do for arm in builtin agent; do
      cfg=yaml_configs/demo_cpu_tools.yaml; [ $arm = agent ] && cfg=yaml_configs/demo_cpu_tools_agent.yaml
      megatron-grpo train --config $cfg trainer.seed=$s trainer.num_steps=30 \\
          trainer.run_dir=runs/agent_vs_builtin/$arm/s$s checkpoint.save_every=0 checkpoint.resume=never \\
          logging.progress_bar=false
    done; done
    python -m tools.bench.agent_vs_builtin runs/agent_vs_builtin --seeds 1 2 3

Per seed: each arm's reward (``reward_mean``) over the first 10 steps and the last 10, its
model turns per episode, and the largest difference between the two arms over every logged
number that is not a time (the episodes are the same tokens, so only floating-point
differences of the loss are expected: none, on one machine). The agent arm's extra metrics
(``agent/*``, ``multi_turn/diverged``, ``multi_turn/tool_call_errors``) are listed apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tools.bench.common import run_records, seed_dir

TIME_PREFIXES = ("time/", "perf/", "throughput/", "mem/")
TIME_KEYS = {"train_elapsed_s", "elapsed_s", "tokens_per_s", "multi_turn/env_s", "multi_turn/generate_s"}


def is_time(key: str) -> bool:
    return key.startswith(TIME_PREFIXES) or key in TIME_KEYS or key.endswith("_s") or "per_s" in key


def compare(a: list[dict], b: list[dict]) -> tuple[float, str, int]:
    """(largest |a - b| over shared numeric non-time keys and steps, its key, keys compared)."""
    worst, where, keys = 0.0, "", set()
    for ra, rb in zip(a, b):
        for k, va in ra.items():
            vb = rb.get(k)
            if is_time(k) or not isinstance(va, (int, float)) or not isinstance(vb, (int, float)):
                continue
            keys.add(k)
            d = abs(float(va) - float(vb))
            if d > worst:
                worst, where = d, f"{k} (step {ra.get('step')})"
    return worst, where, len(keys)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", type=Path)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = p.parse_args(argv)
    print("| seed | arm | steps | reward, steps 1-10 | last 10 | turns per episode, last 10 | "
          "largest difference to the other arm (non-time metrics) |")
    print("|---|---|---|---|---|---|---|")
    last = {"builtin": [], "agent": []}
    for s in args.seeds:
        runs = {arm: run_records(seed_dir(args.runs / arm, s)) for arm in ("builtin", "agent")}
        if not all(runs.values()):
            print(f"| {s} | missing run(s) | | | | | |")
            continue
        worst, where, keys = compare(runs["builtin"], runs["agent"])
        for arm, rows in runs.items():
            reward = [r["reward_mean"] for r in rows]
            turns = [r.get("multi_turn/turns_mean", float("nan")) for r in rows]
            last[arm].append(np.mean(reward[-10:]))
            diff = f"{worst:.3g} ({where}; {keys} keys)" if arm == "agent" else ""
            print(f"| {s} | {arm} | {len(rows)} | {np.mean(reward[:10]):.3f} | {np.mean(reward[-10:]):.3f} | "
                  f"{np.mean(turns[-10:]):.2f} | {diff} |")
        extra = {k: v for k, v in runs["agent"][-1].items() if k.startswith("agent/") or k in
                 ("multi_turn/diverged", "multi_turn/tool_call_errors")}
        print(f"|  | agent, last step | | {json.dumps(extra)} | | | |")
    for arm, values in last.items():
        if values:
            print(f"| mean ± std | {arm} | | | {np.mean(values):.3f} ± {np.std(values):.3f} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
