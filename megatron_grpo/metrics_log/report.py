"""End-of-run report: the PNG plot and the printed summary table, both from metrics.jsonl.

The plot is drawn with matplotlib's object API on an Agg canvas (no pyplot, so no global
backend switch and no display needed) and written to a temp file renamed over ``plot.png``.
"""

from __future__ import annotations

import math
import os
import fnmatch
from pathlib import Path

PLOT_PANELS: list[tuple[str, str]] = [
    ("reward_mean", "reward (mean over responses)"),
    ("eval/*/pass@*", "held-out eval: pass@k"),
    ("entropy", "entropy (mean over response tokens)"),
    ("time/generate_s|time/reward_s|time/logprob_s|time/train_s|time/sync_s|time/eval_s|time/idle_s",
     "step time split (s)"),
    ("rollout_train_logprobs_abs_diff_mean", "train/rollout |logprob diff| (mean)"),
    ("response_length_mean", "response length (tokens, mean)"),
]
"""(metric key, panel title) of the six panels of plot.png; a key with ``*`` draws every
matching metric as its own line (one per eval set and k); ``a|b`` draws each of the keys as its
own line."""

MOVING_PANELS: list[tuple[str, str]] = [
    ("ppo_kl", "KL old->new policy (ppo_kl)"),
    ("clip_ratio", "clip ratio"),
    ("skipped_updates|skipped_zero_advantage", "skipped optimizer updates"),
]
"""Panels drawn only for a run where their metric moves (a non-zero value at some step):
``ppo_kl`` and ``clip_ratio`` are zero by construction on an on-policy run (one optimizer step
per rollout batch: ``num_iterations: 1``, one mini-batch), skipped updates on a healthy one."""

MULTI_TURN_PANELS: list[tuple[str, str]] = [
    ("multi_turn/turns_mean|multi_turn/turns_max", "model turns per episode"),
    ("multi_turn/env_errors|multi_turn/env_timeouts|multi_turn/observations_refused",
     "failed episodes per step (environment)"),
]
"""Two more panels when the run has multi-turn episodes (``multi_turn/turns_mean`` logged)."""

SUMMARY_COLUMNS: list[tuple[str, str]] = [
    ("step", "step"),
    ("reward_mean", "reward"),
    ("reward_std", "reward_std"),
    ("loss", "loss"),
    ("ppo_kl", "ppo_kl"),
    ("clip_ratio", "clip"),
    ("entropy", "entropy"),
    ("rollout_train_logprobs_abs_diff_mean", "mismatch"),
    ("response_length_mean", "resp_len"),
    ("multi_turn/turns_mean", "turns"),
    ("elapsed_s", "elapsed_s"),
    ("train_elapsed_s", "train_s"),
]
"""(metric key, column header) of the summary table; columns no entry has are left out."""


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over the records that hold a finite number for it."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(r["step"])
            values.append(float(v))
    return steps, values


def matching_keys(records: list[dict], pattern: str) -> list[str]:
    """Metric keys of ``records`` matching ``pattern`` (``*`` wildcards; ``a|b``: each of them), in
    first-seen order."""
    if "|" in pattern:
        return [key for alternative in pattern.split("|") for key in matching_keys(records, alternative)]
    if "*" not in pattern:
        return [pattern]
    seen: dict[str, None] = {}
    for r in records:
        seen.update({k: None for k in r if fnmatch.fnmatchcase(k, pattern)})
    return list(seen)


def moves(records: list[dict], pattern: str) -> bool:
    """Whether any metric ``pattern`` names has a non-zero value at some step."""
    return any(v != 0.0 for key in matching_keys(records, pattern) for v in series(records, key)[1])


def plot_panels(records: list[dict]) -> list[tuple[str, str]]:
    """The panels of a run's plot: PLOT_PANELS, then those of MOVING_PANELS that move, then the
    multi-turn ones when it has multi-turn episodes."""
    moving = [panel for panel in MOVING_PANELS if moves(records, panel[0])]
    return PLOT_PANELS + moving + (MULTI_TURN_PANELS if series(records, "multi_turn/turns_mean")[0] else [])


def plot_figure(records: list[dict], title: str = ""):
    """The matplotlib Figure of the ``plot_panels`` metrics vs step (an Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = plot_panels(records)
    rows = (len(panels) + 1) // 2
    fig = Figure(figsize=(12, 10 * rows / 3), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 2).ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, (pattern, panel_title) in zip(axes, panels):
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        lines = [(key, *series(records, key)) for key in matching_keys(records, pattern)]
        lines = [line for line in lines if line[1]]
        if not lines:
            ax.text(0.5, 0.5, f"{pattern}: not logged", ha="center", va="center", transform=ax.transAxes)
            continue
        several = "*" in pattern or "|" in pattern
        for key, steps, values in lines:
            ax.plot(steps, values, marker="." if len(steps) < 50 else None,
                    label=key.removeprefix("eval/").removeprefix("multi_turn/").removeprefix("time/")
                    if several else None)
        if several:
            ax.legend(loc="lower right", fontsize=8)
            continue
        key, steps, values = lines[0]
        if key == "reward_mean":
            std_steps, stds = series(records, "reward_std")
            if std_steps == steps:
                ax.fill_between(steps, [m - s for m, s in zip(values, stds)],
                                [m + s for m, s in zip(values, stds)], alpha=0.2, label="± std")
                ax.legend(loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def write_plot(records: list[dict], path: str | Path, title: str = "") -> Path:
    """Draw ``plot_figure`` into ``path`` (PNG, atomic); returns the path."""
    fig = plot_figure(records, title)
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp.{os.getpid()}.png")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)
    return path


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}" if value != 0 else "0"
    return str(value)


def summary_rows(num_records: int, max_rows: int) -> list[int]:
    """Indices of the rows shown: all if few, else evenly spaced including first and last."""
    if num_records <= max_rows:
        return list(range(num_records))
    return sorted({round(i * (num_records - 1) / (max_rows - 1)) for i in range(max_rows)})


def format_summary(records: list[dict], max_rows: int = 20) -> str:
    """A fixed-width table of the run (a subset of steps if long) and a reward line."""
    if not records:
        return "no metrics logged"
    columns = [(k, h) for k, h in SUMMARY_COLUMNS if any(k in r for r in records)]
    rows = [[_fmt(records[i].get(k)) for k, _ in columns] for i in summary_rows(len(records), max_rows)]
    widths = [max(len(h), *(len(row[c]) for row in rows)) for c, (_, h) in enumerate(columns)]
    lines = ["  ".join(h.rjust(w) for (_, h), w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    for key in ["reward_mean", *matching_keys(records, "eval/*/pass@*")]:
        steps, values = series(records, key)
        if values:
            best = max(range(len(values)), key=values.__getitem__)
            lines.append(
                f"{key}: {values[0]:.4g} at step {steps[0]} -> {values[-1]:.4g} at step {steps[-1]} "
                f"(best {values[best]:.4g} at step {steps[best]})"
            )
    return "\n".join(lines)
