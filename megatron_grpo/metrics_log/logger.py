"""``MetricsLogger``: every per-step metric goes through here to its sinks, on rank 0 only.

Sinks: ``metrics.jsonl`` (always), TensorBoard (``logging.tensorboard`` and the package is
installed; otherwise one info line), Weights & Biases (``logging.wandb_project`` set; an
error if wandb is missing, because a user who asked for it would otherwise lose the run's
record), and a tqdm progress bar with ETA. ``finish()`` writes ``plot.png`` and returns the
summary table. Other ranks get a logger whose methods do nothing, so the driver calls it
unconditionally.

Two clocks are logged with every entry: ``elapsed_s``, wall time since the logger started
(engine start-up and model build included), and, once the driver calls
``begin_training()``, ``train_elapsed_s``: time spent in training steps since the first
step began, without start-up and without held-out evaluations (the ``excluded_s`` the
driver passes), so runs with different engines or eval cadences compare. Both continue
across resumes from the last kept entry.

Steps are 1-based. ``resumed_step`` is the step of the checkpoint the run continues from
(0 = fresh start): entries after it are dropped from metrics.jsonl and hidden in
TensorBoard (``purge_step``), since the resumed run logs them again.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

from megatron_grpo.config.base import ConfigError
from megatron_grpo.metrics_log.jsonl import MetricsFile, json_value, read_metrics, truncate_metrics
from megatron_grpo.metrics_log.report import format_summary, write_plot

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "plot.png"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"
PROGRESS_KEYS = [("reward_mean", "reward"), ("loss", "loss"), ("ppo_kl", "kl"), ("multi_turn/turns_mean", "turns")]
"""(metric, label) shown next to the progress bar (when the record has it)."""
ENV_FAILURE_KEYS = ("multi_turn/env_errors", "multi_turn/env_timeouts", "multi_turn/observations_refused",
                    "multi_turn/diverged")
"""Multi-turn runs: their sum is shown as ``env_err`` next to the progress bar."""
TIME_KEYS = [("time/step_s", "step"), ("time/generate_s", "gen"), ("time/reward_s", "rew"),
             ("time/logprob_s", "lp"), ("time/train_s", "train"), ("time/idle_s", "idle"),
             ("time/sync_s", "sync"), ("time/eval_s", "eval")]
"""(metric, label) of the step-time breakdown shown as ``time=step 3.1s: gen 1.2 rew 0.1 ...``
(phases under 5 ms are left out)."""
EVAL_PASS_SUFFIX = "/pass@1"
"""The progress bar also shows the latest ``eval/<set>/pass@1`` of each set (as ``eval:<set>``)."""


def _numeric(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoardSink:
    """Scalars under ``run_dir/tensorboard``; flushed every step."""

    def __init__(self, run_dir: Path, resumed_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR),
                                    purge_step=resumed_step + 1 if resumed_step > 0 else None)

    def log(self, step: int, record: dict) -> None:
        for key, value in _numeric(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A wandb run whose id is kept in ``run_dir/wandb_run_id`` so a resumed run continues it."""

    def __init__(self, run_dir: Path, project: str, run_name: str | None, config: dict | None):
        import wandb

        id_file = run_dir / WANDB_ID_FILE
        if id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = wandb.util.generate_id()
            tmp = id_file.with_name(f".{id_file.name}.tmp")
            tmp.write_text(run_id)
            os.replace(tmp, id_file)
        self.run = wandb.init(project=project, name=run_name or run_dir.name, id=run_id, resume="allow",
                              dir=str(run_dir), config=config)

    def log(self, step: int, record: dict) -> None:
        self.run.log(_numeric(record), step=step)

    def close(self) -> None:
        self.run.finish()


def time_breakdown(record: dict) -> str:
    """``step 3.1s: gen 1.2 rew 0.1 train 1.6 sync 0.2`` from a step's ``time/*_s`` metrics."""
    parts = [(label, record[key]) for key, label in TIME_KEYS if isinstance(record.get(key), (int, float))]
    if not parts or parts[0][0] != "step":
        return ""
    (_, total), phases = parts[0], parts[1:]
    return f"step {total:.2g}s: " + " ".join(f"{label} {v:.2g}" for label, v in phases if v >= 0.005)


class ProgressSink:
    """tqdm bar over the run's steps (ETA from the steps done since start/resume)."""

    def __init__(self, total_steps: int, resumed_step: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total_steps, initial=resumed_step, unit="step", desc="grpo",
                        dynamic_ncols=True, file=sys.stderr)
        self.evals: dict[str, str] = {}

    def log(self, step: int, record: dict) -> None:
        shown = {label: f"{record[k]:.3g}" for k, label in PROGRESS_KEYS if isinstance(record.get(k), float)}
        failures = [record[k] for k in ENV_FAILURE_KEYS if isinstance(record.get(k), (int, float))]
        if failures:  # a multi-turn run (records of older runs have no multi_turn/diverged)
            shown["env_err"] = str(int(sum(failures)))
        for key, value in record.items():  # held-out accuracy stays shown until the next eval
            if key.startswith("eval/") and key.endswith(EVAL_PASS_SUFFIX) and isinstance(value, (int, float)):
                self.evals[f"eval:{key[len('eval/'):-len(EVAL_PASS_SUFFIX)]}"] = f"{value:.3g}"
        breakdown = time_breakdown(record)
        if breakdown:
            shown["time"] = breakdown
        self.bar.set_postfix({**shown, **self.evals}, refresh=False)
        self.bar.update(max(0, step - self.bar.n))

    def close(self) -> None:
        self.bar.close()


class MetricsLogger:
    """Per-step metrics to JSONL / TensorBoard / wandb / progress bar; plot + summary at the end."""

    def __init__(self, run_dir: str | Path, logging_cfg, total_steps: int, rank: int = 0, *,
                 resumed_step: int = 0, config_dict: dict | None = None):
        self.run_dir = Path(run_dir)
        self.cfg = logging_cfg
        self.total_steps = total_steps
        self.enabled = rank == 0
        self.sinks: list[Any] = []
        self._closed = False
        # Checked on every rank, before anything is written: all ranks fail alike, and a
        # rejected run leaves no files behind.
        if logging_cfg.wandb_project and importlib.util.find_spec("wandb") is None:
            raise ConfigError("logging.wandb_project",
                              "is set but wandb is not installed; pip install wandb or set it to null")
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        kept = truncate_metrics(self.run_dir / METRICS_FILE, resumed_step)
        self._elapsed_before = float(kept[-1].get("elapsed_s") or 0.0) if kept else 0.0
        self._train_before = float(kept[-1].get("train_elapsed_s") or 0.0) if kept else 0.0
        self._train_start: float | None = None
        self._excluded_s = 0.0
        self.file = MetricsFile(self.run_dir / METRICS_FILE)
        if logging_cfg.tensorboard:
            if importlib.util.find_spec("tensorboard") is None:
                print("[metrics] tensorboard is not installed: skipping TensorBoard (pip install tensorboard)",
                      flush=True)
            else:
                self.sinks.append(TensorBoardSink(self.run_dir, resumed_step))
        if logging_cfg.wandb_project:
            self.sinks.append(WandbSink(self.run_dir, logging_cfg.wandb_project, logging_cfg.wandb_run_name,
                                        config_dict))
        if logging_cfg.progress_bar:
            self.sinks.append(ProgressSink(total_steps, resumed_step))
        self._start = time.monotonic()  # after the sinks: TensorBoard's import alone takes ~1 s

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / METRICS_FILE

    def begin_training(self) -> None:
        """The first step starts now: ``train_elapsed_s`` counts from here (see the module docstring)."""
        if self.enabled:
            self._train_start = time.monotonic()

    def log(self, step: int, metrics: dict[str, Any], excluded_s: float = 0.0) -> dict | None:
        """Record ``metrics`` of ``step`` (scalars; tensors are converted); returns the written
        entry. ``excluded_s``: seconds of this step that are not training (an evaluation)."""
        if not self.enabled:
            return None
        now = time.monotonic()
        record = {"step": int(step)}
        record.update({k: json_value(k, v) for k, v in metrics.items() if k != "step"})
        record.setdefault("elapsed_s", round(self._elapsed_before + now - self._start, 3))
        if self._train_start is not None:
            self._excluded_s += excluded_s
            record.setdefault("train_elapsed_s",
                              round(self._train_before + now - self._train_start - self._excluded_s, 3))
        self.file.append(record)
        for sink in self.sinks:
            sink.log(step, record)
        return record

    def close(self) -> None:
        """Close the sinks (idempotent); no plot. For an aborted run."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        self.file.close()
        for sink in self.sinks:
            sink.close()

    def finish(self, print_summary: bool = True) -> str:
        """Close the sinks, write plot.png (if enabled) and return (and print) the summary table."""
        if not self.enabled:
            return ""
        self.close()
        records = read_metrics(self.metrics_path)
        summary = format_summary(records)
        if self.cfg.plot and records:
            path = write_plot(records, self.run_dir / PLOT_FILE, title=self.run_dir.name)
            summary += f"\nplot: {path}"
        if print_summary:
            print(summary, flush=True)
        return summary

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
