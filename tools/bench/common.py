"""What the benchmarks and seed runners share: the checkout's root, a run's records, reward rows,
seed directories, table cells, the tiny benchmark model, and ranks spawned on gloo.

Everything under ``tools/`` runs from the repository root as a module
(``python -m tools.bench.NAME``), so ``tools.bench.common`` imports like any package module; no
tool edits ``sys.path`` and none imports the tests' helpers (``tests/support/``: the suite's
rank pool, fixtures) — what a benchmark needs of them is here, written for one fresh run.
"""

from __future__ import annotations

import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from megatron_grpo.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[2]
"""The checkout: configs, launch scripts and ``runs/`` are named from here."""


# ---- runs, reward rows, seeds ----------------------------------------------------------------


def seed_dir(out: Path, seed: int) -> Path:
    """The run directory of one seed under ``out``: ``<out>/s<seed>``."""
    return out / f"s{seed}"


def run_records(run_dir: Path) -> list[dict]:
    """A run directory's metrics records in file order (its ``metrics.jsonl``; [] when missing,
    and a line cut by a crash ends the read: the trainer's own reader)."""
    return read_metrics(Path(run_dir) / "metrics.jsonl")


def reward_rows(records: list[dict]) -> list[dict]:
    """The records of training steps: those that carry the step's ``reward_mean``."""
    return [r for r in records if "reward_mean" in r]


def rolling(values: list[float], width: int) -> np.ndarray:
    """float[len(values)]: the mean of the up-to-``width`` values ending at each position."""
    x = np.asarray(values, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - width, 0)
    return (c[idx] - c[lo]) / (idx - lo)


# ---- table cells ------------------------------------------------------------------------------


def fmt(v: Any, spec: str = ".3f", missing: str = "-") -> str:
    """One table cell: ``missing`` for None, yes/no for a bool, ``n/a`` for NaN, else ``spec``."""
    if v is None:
        return missing
    if isinstance(v, bool):
        return "yes" if v else "no"
    if v != v:  # NaN, whatever its float type
        return "n/a"
    return format(v, spec)


def spread(values: list, spec: str = ".3f") -> str:
    """``mean (min-max)`` of the values that are not None; ``-`` when none is."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.mean(values):{spec}} ({min(values):{spec}}-{max(values):{spec}})"


# ---- models and configs for the micro-benchmarks ----------------------------------------------


def bench_model_dir(name: str, work: Path) -> str:
    """The HF folder a micro-benchmark runs on: ``smollm2`` (the real model, fetched once into
    the cache) or ``tiny`` (a 128-wide qwen2 written into ``work``)."""
    if name == "smollm2":
        from tools.fetch_smollm2 import default_cache_dir, fetch_smollm2

        return str(fetch_smollm2(default_cache_dir() / "hf"))
    from tools.tiny import save_tiny_model

    return str(save_tiny_model(work / "demo", "qwen2", seed=0, hidden_size=128, intermediate_size=256))


def policy_of(model, optimizer):
    """The trainer's own policy (``build_policy``: megatron chunks and optimizer) from a
    ``ModelConfig`` and an ``OptimizerConfig`` with the default ``parallel`` section (the CPU
    path); run inside a rank of ``spawn_ranks``."""
    from megatron_grpo.config.model import ParallelConfig
    from megatron_grpo.trainer.components import build_policy

    return build_policy(SimpleNamespace(model=model, optimizer=optimizer, parallel=ParallelConfig()))


def sections_config(**sections):
    """An ExperimentConfig of the given sections with placeholders for the required ones and a
    global batch of 1: what the server manager and the weight sync read when no run is built."""
    from megatron_grpo.config import DataConfig, ExperimentConfig, ModelConfig, ParallelConfig, TrainerConfig

    placeholders = dict(model=ModelConfig(hf_dir="unused"), data=DataConfig(train_file="unused.jsonl"),
                        trainer=TrainerConfig(run_dir="unused"), parallel=ParallelConfig(global_batch_size=1))
    return ExperimentConfig(**{**placeholders, **sections})


# ---- ranks ------------------------------------------------------------------------------------


def _rank_main(rank: int, fn: Callable, world_size: int, port: int, tp: int | None, pp: int | None,
               cp: int | None, args: tuple, kwargs: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    from megatron_grpo.runtime import cpu_shim, parallel

    torch.set_num_threads(int(os.environ.setdefault("OMP_NUM_THREADS", "1")))
    if tp is not None or pp is not None or cp is not None:
        parallel.initialize(tp or 1, pp or 1, cp=cp or 1)
    else:
        cpu_shim.install()
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args, **kwargs)
        # a file, not a queue: a large result never blocks the rank's exit on a full pipe
        Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        parallel.destroy()


def spawn_ranks(fn: Callable, world_size: int, *args: Any, tp: int | None = None, pp: int | None = None,
                cp: int | None = None, timeout_s: float = 600.0, **kwargs: Any) -> list[Any]:
    """``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` fresh gloo ranks (megatron's
    parallel state too when ``tp``, ``pp`` or ``cp`` is given); the per-rank results in rank order.
    A failing rank raises with its traceback (torch's ``ProcessRaisedException``); ranks still
    running after ``timeout_s`` are killed and ``TimeoutError`` is raised. Fresh processes
    each call: a benchmark measures a first import and a clean peak memory."""
    import torch.multiprocessing as mp

    from megatron_grpo.runtime.process import free_port

    with tempfile.TemporaryDirectory(prefix="ranks-") as out_dir:
        ctx = mp.start_processes(_rank_main, args=(fn, world_size, free_port(), tp, pp, cp, args, kwargs, out_dir),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise TimeoutError(f"{getattr(fn, '__name__', fn)}: ranks still running after {timeout_s:.0f} s")
        return [pickle.loads(Path(out_dir, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]
