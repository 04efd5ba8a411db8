"""Helpers for tests that run the real CPU demo pipeline as a user would (a subprocess of
`megatron-grpo train` on a tiny demo model built by tools/make_demo_model.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def make_demo(out: Path, warmup_steps: int) -> Path:
    """Build the demo model + dataset into ``out`` with ``warmup_steps`` steps of format warm-up
    (the README's demo: tools/make_demo_model.py's default, 60)."""
    subprocess.run([sys.executable, "-m", "tools.make_demo_model", "--out", str(out), "--warmup-steps",
                    str(warmup_steps)], cwd=ROOT, check=True, capture_output=True)
    return out


TOOL_DEMO_WARMUP = ("--warmup-steps", "500", "--tool-fraction", "0.5", "--lr", "1e-3")
"""The tool demo's warm-up in the tests (the tool's default: 1500 steps, 30% tool rows, lr 3e-3):
a third of the build, with half its rows tool rows, at lr 1e-3 (greedy: an exact call for 100%
of fresh problems and the result copied right 99-100% of the time, build seeds 0-2, 2026-11-28).
It was 800 steps at 3e-3 (99% and 95% then), until a later software stack (the same code) left
that build at 0% calls: 3e-3 sat at the edge where the copy is learned or not. It starts calling
the tool in about half its episodes, not a third. Its guess rows are question-blind as in the
demo: no row pairs a question with its answer without the tool."""


def make_tool_demo(out: Path) -> Path:
    """Build the tool demo's model + dataset (tools/make_tool_demo_model.py, ``TOOL_DEMO_WARMUP``)."""
    subprocess.run([sys.executable, "-m", "tools.make_tool_demo_model", "--out", str(out), *TOOL_DEMO_WARMUP],
                   cwd=ROOT, check=True, capture_output=True)
    return out


DEMO_ENGINE = "engine.kind=embedded"
"""The engine the tests run the demo config with: the launched embedded engine, whose process
the failure, lifetime and resume tests kill and count (the YAML's default is the in-process
engine; tests of it pass ``engine.kind=inprocess``, which comes later and wins)."""


DEMO_MICRO_BATCH = "parallel.micro_batch_size=64"
"""The tests' micro-batch: the demo's whole global batch of 64, as the YAML has it now, pinned
so that the tests' cost does not follow the demo's tuning. How a batch is cut into micro-batches
does not change the gradient beyond rounding (tests/test_losses_invariance.py,
tests/test_trainer_step_equivalence.py), and on 2 CPU cores at TP=2 each micro-batch costs its
own forward, backward and gloo all-reduces: a 20-step run measured 50 -> 34 CPU s at 64 against
16 (1.3 -> 0.5 per step)."""


def demo_overrides(demo: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    """Overrides of yaml_configs/demo_cpu.yaml pointing it at ``demo`` and ``run_dir``
    (with ``DEMO_ENGINE`` and ``DEMO_MICRO_BATCH`` first: ``extra`` may set another engine or
    batch)."""
    return [DEMO_ENGINE, DEMO_MICRO_BATCH, f"model.hf_dir={demo / 'model'}",
            f"data.train_file={demo / 'arithmetic.jsonl'}",
            f"eval.sets=[{{name: heldout, path: {demo / 'arithmetic_heldout.jsonl'}, n: 8, temperature: 1.0}}]",
            f"trainer.run_dir={run_dir}", f"trainer.num_steps={steps}", "logging.progress_bar=false", *extra]


def tool_demo_overrides(tool_demo: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    """Overrides of yaml_configs/demo_cpu_tools.yaml pointing it at ``tool_demo`` and ``run_dir``
    (no checkpoints, no plot)."""
    return [f"model.hf_dir={tool_demo / 'model'}", f"data.train_file={tool_demo / 'additions.jsonl'}",
            f"trainer.run_dir={run_dir}", f"trainer.num_steps={steps}", "checkpoint.save_every=0",
            "checkpoint.resume=never", "logging.progress_bar=false", "logging.plot=false", *extra]


def train_cmd(demo: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    """`megatron-grpo train` on yaml_configs/demo_cpu.yaml pointed at ``demo`` and ``run_dir``."""
    return [sys.executable, "-m", "megatron_grpo.cli", "train", "--config", "yaml_configs/demo_cpu.yaml",
            *demo_overrides(demo, run_dir, steps, *extra)]


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# An environment for the demo model (it answers one token): turn 1 asks again, so every episode
# has an observation between two model turns. The multi-turn end-to-end tests write it to a file.
NUDGE = '''
class Nudge:
    """Turn 1: asks again; turn 2: done, reward 1 when the last word is the answer."""
    def __init__(self, row):
        self.answer, self.turn = str(row["answer"]), 0

    def step(self, response):
        self.turn += 1
        if self.turn == 1:
            return {"observation": "please reply with only a number", "done": False}
        words = response.split()
        return {"observation": None, "done": True, "reward": float(bool(words) and words[-1] == self.answer)}
'''

NUDGE_OVERRIDES = ("episodes.observation_role=user", "episodes.max_episode_tokens=64",
                   "rollout.prompts_per_step=4", "rollout.num_generations=4", "parallel.global_batch_size=8",
                   "parallel.micro_batch_size=4", "eval.every_n_steps=0")
"""A small multi-turn demo run with NUDGE (plus ``episodes.kind=environment``, ``episodes.source=FILE:Nudge``)."""


def wait_for_steps(run_dir: Path, steps: int, procs, timeout_s: float = 300.0, poll_s: float = 0.1) -> None:
    """Return once ``run_dir``'s metrics hold ``steps`` records; fail if one of ``procs`` (the
    run's processes: a launcher, or one per node) ends first or ``timeout_s`` passes."""
    procs = procs if isinstance(procs, (list, tuple)) else [procs]
    deadline = time.monotonic() + timeout_s
    while len(read_metrics(run_dir)) < steps:
        assert all(p.poll() is None for p in procs), f"the run ended before step {steps}"
        assert time.monotonic() < deadline, f"step {steps} not logged within {timeout_s:.0f} s"
        time.sleep(poll_s)


def kill_engine_after(proc: subprocess.Popen, run_dir: Path, steps: int, settle_s: float = 0.0,
                      deadline_s: float = 300.0) -> str:
    """SIGKILL the engine server of the running ``megatron-grpo train`` ``proc`` once ``steps``
    steps are logged (and ``settle_s`` more seconds), then wait for the run; returns its stderr.
    The run is killed if the test fails first."""
    import psutil

    try:
        wait_for_steps(run_dir, steps, proc, deadline_s, poll_s=0.01)
        time.sleep(settle_s)
        (engine,) = [p for p in psutil.Process(proc.pid).children(recursive=True)
                     if "megatron_grpo.inference.serve" in " ".join(p.cmdline())]
        engine.kill()
        return proc.communicate(timeout=deadline_s)[1]
    finally:
        proc.kill()
