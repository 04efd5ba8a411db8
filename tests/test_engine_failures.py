"""The rollout engine dies under a real run: a launched engine is restarted and the run goes
on (same steps, weights re-synced); an external engine that stays down ends the run within a
bounded time with one line naming the engine and exit code 1."""

import subprocess
import sys
import time

import psutil
import pytest

from tests.support.distributed import free_port
from tests.support.demo_run import ENV, ROOT, read_metrics, train_cmd, wait_for_steps


def cmd(demo, run_dir, steps, *extra):
    return train_cmd(demo, run_dir, steps, "logging.plot=false", "checkpoint.save_every=0",
                     "engine.request_timeout_s=20", "engine.max_retries=2", *extra)


def serve_processes(root_pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(root_pid).children(recursive=True)
            if "megatron_grpo.inference.serve" in " ".join(p.cmdline())]


@pytest.mark.slow
def test_launched_engine_killed_mid_run_is_restarted(demo, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(cmd(demo, run_dir, 8), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)
    wait_for_steps(run_dir, 3, proc)
    (engine,) = serve_processes(proc.pid)
    engine.kill()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["engine_restarts"] == 1
    # after the restart the engine serves the trained weights again: no train/rollout mismatch
    assert max(r["rollout_train_logprobs_abs_diff_mean"] for r in rows) < 1e-4
    assert (run_dir / "rollout" / "server.log").read_text().count("launch:") == 2


@pytest.mark.slow
def test_external_engine_down_is_a_bounded_one_line_error(demo, tmp_path):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "megatron_grpo.inference.serve", "--model-dir",
                               str(demo / "model"), "--host", "127.0.0.1", "--port", str(port)],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = tmp_path / "run"
    try:
        proc = subprocess.Popen(cmd(demo, run_dir, 50, f"engine.urls=[http://127.0.0.1:{port}]",
                                    "engine.max_restarts=1"),
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=ENV)
        wait_for_steps(run_dir, 2, proc)
        server.kill()
        killed = time.monotonic()
        out, err = proc.communicate(timeout=300)
        elapsed = time.monotonic() - killed
    finally:
        server.kill()
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rollout engine:") and f"127.0.0.1:{port}" in last, last
    assert "giving up" in last
    assert elapsed < 120, elapsed  # bounded by the client's retries, not a hang
