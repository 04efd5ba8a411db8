"""The trainer end to end on the real SGLang 0.5.23 (CPU build from launch/setup_sglang_cpu.sh):
two launched servers for the demo task at TP=2 with a distributed weight sync every step,
verified by the log-prob probe, one server killed mid-run and relaunched, then the launcher
killed -9 with nothing of it left; an external server given in engine.urls (the session's
shared server, tests/support/sglang_shared.py).

Each run is a few steps of `megatron-grpo train` in a subprocess, as a user starts it. The
launched-server checks (the dtype resolved from the checkpoint, a sync every step) are made on
the two-server run rather than on a run of their own: one SGLang launch on 2 CPU cores costs
~1.5 min, and the two-server run exercises the same launch and sync path for each server. For
the same reason it is also tests/test_process_lifetime.py's kill at the moment the launched
SGLang serves."""

import re
import subprocess
import threading
import time

import psutil
import pytest

from megatron_grpo.generation import RolloutClient, RolloutError
from megatron_grpo.generation.http_engine import start_servers
from tests.support.sglang import require_sglang
from tests.support.demo_run import ENV, ROOT, read_metrics, train_cmd
from tests.support.kill_resume import GRACE_S, process_tree, survivors
from tests.support.sglang_shared import API_KEY, SGLANG_OVERRIDES
from megatron_grpo.config import EngineConfig
from tests.support.configs import experiment

SGLANG = ["engine.kind=sglang", *SGLANG_OVERRIDES, "engine.launch_timeout_s=600"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _sglang_installed():
    require_sglang()


def run_train(cmd, timeout=600):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def assert_healthy_steps(rows, steps):
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        # fp32 trainer and fp32 SGLang: the rollout log-probs are the trainer's up to rounding
        assert r["rollout_train_logprobs_abs_diff_mean"] < 1e-4, r
        assert r["weight_sync_verified"] == 1
        assert r["weight_sync_probe_logprob_abs_diff"] <= 1e-5, r
        assert all(v == v for v in (r["reward_mean"], r["loss"], r["k3_kl"] if "k3_kl" in r else 0.0))


def test_external_sglang_in_rollout_urls(demo, tmp_path, sglang_servers):
    """The session's shared SGLang server (tests/support/sglang_shared.py), reset to the demo model, is
    a server started elsewhere: the run uses it, launches none, and leaves it running."""
    url = sglang_servers.serve(demo / "model")
    run_dir = tmp_path / "run"
    run_train(train_cmd(demo, run_dir, 3, *sglang_servers.train_overrides(url)))
    assert_healthy_steps(read_metrics(run_dir), 3)
    assert not (run_dir / "rollout" / "server.log").exists()  # nothing launched
    with RolloutClient([url], api_key=API_KEY) as client:
        assert client.weight_version(url) == "3"  # the server serves the last step's weights
    # the wrong kind named for an external server is an error naming it, before any sync: what
    # rank 0 does first with engine.urls (a RolloutError from a rank is one line on the
    # command's stderr: tests/test_engine_failures.py's external engine that is down)
    wrong = experiment(engine=EngineConfig(kind="embedded", urls=[url], api_key=API_KEY, launch_timeout_s=60))
    with pytest.raises(RolloutError, match=f"{re.escape(url)}.*is not a megatron-grpo embedded engine"):
        start_servers(wrong, model_dir=str(demo / "model"), run_dir=str(tmp_path / "wrong"))


def test_two_launched_servers_train_at_tp2_share_the_work_survive_a_death_and_die_with_the_launcher(demo, tmp_path):
    """Two launched servers at TP=2; server 1 is killed after step 2 and relaunched; once the
    relaunched one has served, the launcher is killed -9 (as tests/test_process_lifetime.py
    kills it at other moments) and every process of its tree, both SGLang servers' schedulers
    and detokenizers included, must be gone within ``GRACE_S``. (The servers' orderly stop is
    the same ``RolloutServerManager.stop`` the session's shared servers end with, whose
    teardown fails on a survivor.)"""
    run_dir = tmp_path / "run"
    killed = {}

    def kill_second_server_after_step_2():
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and len(read_metrics(run_dir)) < 2:
            time.sleep(0.5)
        log = run_dir / "rollout" / "server_1.log"
        port = re.search(r"--port (\d+)", log.read_text()).group(1)
        for p in _sglang_processes_now():
            if f"--port {port}" in " ".join(p.cmdline()):
                killed["pid"] = p.pid
                p.kill()

    killer = threading.Thread(target=kill_second_server_after_step_2, daemon=True)
    killer.start()
    with open(tmp_path / "train.log", "wb") as log:
        command = train_cmd(demo, run_dir, 30, *SGLANG, "engine.num_servers=2", "engine.max_restarts=2")
        proc = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        # two steps after the one that saw the restart: the relaunched server has served
        while not ((rows := read_metrics(run_dir)) and rows[-1]["engine_restarts"] >= 1
                   and sum(r["engine_restarts"] >= 1 for r in rows) >= 2):
            assert proc.poll() is None, (tmp_path / "train.log").read_text()[-4000:]
            assert time.monotonic() < deadline, f"no restart served within 600 s: {len(rows)} steps"
            time.sleep(0.2)
        tree = process_tree(proc.pid)
        servers = [p for p in tree if "sglang.launch_server" in " ".join(p.cmdline())]
        roots = [p for p in servers if p.ppid() not in {q.pid for q in servers}]  # not their forked children
        assert len(roots) == 2, [p.cmdline() for p in tree]
        proc.kill()
        proc.wait()
        left = survivors(tree)
        assert left == [], f"alive {GRACE_S:.0f} s after a kill -9 of the launcher: {left}"
    finally:  # whatever a failure above left: the launcher's tree and anything naming the run
        for p in psutil.process_iter(["cmdline"]):
            if p.pid == proc.pid or str(run_dir) in " ".join(p.info["cmdline"] or []):
                try:
                    p.kill()
                except psutil.Error:
                    pass
    killer.join(timeout=10)
    rows = read_metrics(run_dir)
    assert_healthy_steps(rows, len(rows))
    assert killed and len(rows) >= 4
    logs = [(run_dir / "rollout" / name).read_text() for name in ("server.log", "server_1.log")]
    for log in logs:  # requests spread over both, and both received every update
        assert "POST /generate" in log and "POST /update_weights_from_distributed" in log
        assert "sglang.launch_server" in log and "--dtype float32" in log  # auto -> the checkpoint's dtype
    # the server never killed got every sync, 1+ bucket each: at the start and after each
    # logged step (the last one's may have been cut by the launcher's kill)
    assert logs[0].count("POST /update_weights_from_distributed") >= len(rows)
    assert logs[1].count("=== ") == 2  # launched, then relaunched after the kill
    ports = {m for log in logs for m in re.findall(r"--port (\d+)", log)}
    assert not _sglang_processes(ports)


def _sglang_processes(ports: set[str], grace_s: float = 10.0) -> list[psutil.Process]:
    """SGLang processes on ``ports`` still running after ``grace_s`` (the kernel reaps killed
    ones async); the session's shared servers run on other ports."""
    deadline = time.monotonic() + grace_s
    while True:
        found = [p for p in _sglang_processes_now() if any(f"--port {port} " in " ".join(p.cmdline()) + " "
                                                           for port in ports)]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def _sglang_processes_now() -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "sglang.launch_server" in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            pass
    return out
