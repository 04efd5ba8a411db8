"""``python -m megatron_grpo.metrics_log RUN_DIR``: redraw plot.png and print the summary table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_grpo.metrics_log.jsonl import read_metrics
from megatron_grpo.metrics_log.logger import METRICS_FILE, PLOT_FILE
from megatron_grpo.metrics_log.report import format_summary, write_plot


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m megatron_grpo.metrics_log",
        description=f"Print the summary table of a training run and redraw its {PLOT_FILE} from "
                    f"{METRICS_FILE} (works on a finished run or one still writing).")
    p.add_argument("run_dir", type=Path, help=f"the run directory (trainer.run_dir), holding {METRICS_FILE}")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    records = read_metrics(args.run_dir / METRICS_FILE)
    if not records:
        print(f"error: {args.run_dir / METRICS_FILE}: no metrics (missing or empty)", file=sys.stderr)
        return 2
    print(format_summary(records))
    print(f"plot: {write_plot(records, args.run_dir / PLOT_FILE, title=args.run_dir.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
