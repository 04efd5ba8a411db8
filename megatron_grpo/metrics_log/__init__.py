"""Run metrics: metrics.jsonl, TensorBoard, wandb, progress bar, final plot and summary.

(Named ``metrics_log`` rather than ``logging``: a package called ``logging`` would shadow the
standard library for any script run from inside ``megatron_grpo/``.)

    logger = MetricsLogger(run_dir, config.logging, config.trainer.num_steps, rank,
                           resumed_step=step_of_checkpoint)
    logger.log(step, {"reward_mean": ..., "loss": ..., ...})
    logger.finish()      # plot.png + printed summary table

``python -m megatron_grpo.metrics_log RUN_DIR`` redraws the plot and prints the table.
"""

from megatron_grpo.metrics_log.jsonl import read_metrics, truncate_metrics
from megatron_grpo.metrics_log.logger import METRICS_FILE, PLOT_FILE, MetricsLogger
from megatron_grpo.metrics_log.report import PLOT_PANELS, format_summary, write_plot

__all__ = [
    "METRICS_FILE",
    "MetricsLogger",
    "PLOT_FILE",
    "PLOT_PANELS",
    "format_summary",
    "read_metrics",
    "truncate_metrics",
    "write_plot",
]
