"""``python -m megatron_grpo.metrics_log RUN_DIR``: redraw plot.png and print the summary table."""

from __future__ import annotations

import sys
from pathlib import Path

from megatron_grpo.metrics_log.jsonl import read_metrics
from megatron_grpo.metrics_log.logger import METRICS_FILE, PLOT_FILE
from megatron_grpo.metrics_log.report import format_summary, write_plot


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    run_dir = Path(argv[0])
    records = read_metrics(run_dir / METRICS_FILE)
    if not records:
        print(f"error: {run_dir / METRICS_FILE}: no metrics (missing or empty)", file=sys.stderr)
        return 2
    print(format_summary(records))
    print(f"plot: {write_plot(records, run_dir / PLOT_FILE, title=run_dir.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
