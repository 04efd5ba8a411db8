"""No process outlives `megatron-grpo train`: kill -9 its process group (what a terminal or a
job scheduler does), or the launcher alone, at each moment of a run's life, and count what
is still alive seconds later.

The moments are recognised from the process tree, not from timers, so the test means the
same on a quiet and a loaded machine: torchrun just started; the ranks just started (still
importing the trainer, before any rendezvous); a rank has started a child (the engine server,
during the rendezvous and the engine's start-up); the first step has been logged; a rank has
forked its checkpoint writer (the first checkpoint is being written); the environment fork
server has forked a worker (a multi-turn run). Every process of the launcher's tree,
snapshotted at the kill, must be gone within ``GRACE_S``. The kill while launched real SGLang
servers serve (with their own children: scheduler, detokenizer), one of them relaunched, ends
tests/test_sglang_e2e.py's two-server run (one SGLang launch costs more than a run here).
Before runtime/process.die_with_parent ran first thing in a rank, a kill while the ranks were
importing left both alive (parent 1), blocked in the rendezvous for its whole timeout.
"""

from __future__ import annotations

import os
import uuid
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
import psutil
import pytest

from tests.support.demo_run import ENV, NUDGE, NUDGE_OVERRIDES, ROOT, read_metrics, train_cmd
from tests.support.kill_resume import GRACE_S, process_tree, rank_processes, survivors

DEADLINE_S = 300.0
"""Longest wait for a moment to come (a cold start on a loaded 2-core machine)."""


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _ranks(tree: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in tree if "megatron_grpo.train" in _cmdline(p)]


def _checkpoint_writer(tree: list[psutil.Process], run: Path) -> bool:
    """A rank has forked its checkpoint writer's result manager (runtime/cpu_shim.py): the
    first checkpoint is being written (the fork keeps the rank's command line)."""
    return any("megatron_grpo.train" in _cmdline(c) for r in _ranks(tree) for c in _children(r))


def _environment_worker(tree: list[psutil.Process], run: Path) -> bool:
    """The environment fork server (rollout/episodes/environment/worker.py) has forked a worker."""
    return any("episodes.environment.worker" in _cmdline(p) and _children(p) for p in tree)


MOMENTS: dict[str, Callable[[list[psutil.Process], Path], bool]] = {
    # the launcher's one child is torchrun's agent, forked (the launcher's command line)
    "torchrun started": lambda tree, run: len(tree) >= 2,
    "ranks importing": lambda tree, run: len(_ranks(tree)) >= 1,
    "engine starting": lambda tree, run: any(c for r in _ranks(tree) for c in _children(r)),
    "training": lambda tree, run: len(read_metrics(run)) >= 1,
    "checkpoint writing": _checkpoint_writer,
    "environment workers": _environment_worker,
}

MOMENT_OVERRIDES: dict[str, tuple[str, ...]] = {
    "checkpoint writing": ("checkpoint.save_every=1",),
    "environment workers": NUDGE_OVERRIDES,
}
"""What each moment's run adds to the demo's overrides."""


def _children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children()
    except psutil.NoSuchProcess:
        return []


def _kill_at(moment: str, whole_group: bool, demo: Path, tmp_path: Path) -> list[str]:
    """Start a run, SIGKILL it (its process group, or only the launcher) once ``moment`` is
    reached, and return the command lines of its processes still alive after ``GRACE_S``."""
    run_dir = tmp_path / "run"
    extra = MOMENT_OVERRIDES.get(moment, ())
    if moment == "environment workers":
        (tmp_path / "nudge_env.py").write_text(NUDGE)
        extra = ("episodes.kind=environment", f"episodes.source={tmp_path / 'nudge_env.py'}:Nudge", *extra)
    log = open(tmp_path / "train.log", "wb")
    proc = subprocess.Popen(train_cmd(demo, run_dir, 20, "logging.plot=false", *extra), cwd=ROOT, env=ENV,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not MOMENTS[moment](tree := process_tree(proc.pid), run_dir):
            assert proc.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"{moment!r} not reached in {DEADLINE_S:.0f} s"
            time.sleep(0.05)
        tree = process_tree(proc.pid)  # everything that exists at the kill
        if whole_group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return survivors(tree)
    finally:
        for p in process_tree(proc.pid) + [q for q in psutil.process_iter() if str(run_dir) in _cmdline(q)]:
            try:
                p.kill()
            except psutil.Error:
                pass
        log.close()


@pytest.mark.slow
@pytest.mark.parametrize("moment, whole_group", [
    ("torchrun started", True),
    ("ranks importing", True),
    ("ranks importing", False),
    ("engine starting", True),
    ("training", False),
    ("checkpoint writing", True),
    ("environment workers", False),
])
def test_nothing_outlives_a_killed_launcher(moment, whole_group, demo, tmp_path):
    survivors = _kill_at(moment, whole_group, demo, tmp_path)
    assert survivors == [], f"alive {GRACE_S:.0f} s after a kill -9 at {moment!r}: {survivors}"


def _signal_every_process(tree: list[psutil.Process], signum: int) -> None:
    """``signum`` to each process of ``tree`` at once, as Slurm delivers a job step's signal."""
    for p in tree:
        try:
            p.send_signal(signum)
        except psutil.Error:
            pass


ENGINE_KEY = "lifetime-test-key"
"""``engine.api_key`` of the runs whose engine the test asks (a run's own key is random)."""


def _engine_info(run_dir: Path) -> dict:
    """The launched embedded engine's /get_server_info (its port from the launch line of
    its log), for a run started with ``engine.api_key=ENGINE_KEY``."""
    launch = [line for line in (run_dir / "rollout" / "server.log").read_text().splitlines() if " launch: " in line]
    port = int(launch[-1].split("--port ")[1].split()[0])
    return httpx.get(f"http://127.0.0.1:{port}/get_server_info", timeout=10.0,
                     headers={"Authorization": f"Bearer {ENGINE_KEY}"}).json()


def _two_steps_logged(run_dir: Path) -> bool:
    return len(read_metrics(run_dir)) >= 2


def _two_steps_logged_and_the_ranks_stacks_dumped(run_dir: Path) -> bool:
    """Two steps logged; then ``kill -USR1`` of each rank writes its threads' stacks to the run's
    debug/ (runtime/stacks.py), and the run goes on (the caller's signal comes next)."""
    from megatron_grpo.runtime.stacks import stacks_file

    if not _two_steps_logged(run_dir):
        return False
    ranks = rank_processes(run_dir)
    assert len(ranks) == 2, [_cmdline(p)[:120] for p in ranks]  # the demo's TP=2
    for rank in ranks:
        rank.send_signal(signal.SIGUSR1)
    files = [stacks_file(run_dir, r) for r in range(2)]
    # faulthandler appends a dump as its signal handler runs: the file exists, partly written,
    # before the main thread's last frame (runpy's) is in it
    deadline = time.monotonic() + 30
    while not all(f.is_file() and "_run_module_as_main" in f.read_text() for f in files):
        assert time.monotonic() < deadline, [f.read_text() if f.is_file() else f"{f}: missing" for f in files]
        time.sleep(0.1)
    for f in files:  # the main thread is in the trainer's loop: the view a hung run needs
        text = f.read_text()
        assert "megatron_grpo/trainer/driver.py" in text and "Thread 0x" in text, text
    return True


def _stop_with(signum: int, to: str, demo: Path, tmp_path: Path, *,
               ready: Callable[[Path], bool] = _two_steps_logged,
               overrides: tuple[str, ...] = ("checkpoint.save_every=0",)) -> tuple[int, str, Path, float]:
    """Start a 20-step run, send ``signum`` once ``ready(run_dir)`` (two steps logged): to the
    launcher (``to="launcher"``), to its process group as a terminal's Ctrl-C does
    (``"group"``), or to every process of its tree, the engine server included (``"job
    step"``, as Slurm does); returns (exit code, what the launcher wrote on stderr after the
    signal, run dir, seconds from the signal to the launcher's exit), after checking every
    process is gone."""
    run_dir = tmp_path / "run"
    out, err = open(tmp_path / "stdout", "wb"), open(tmp_path / "stderr", "wb")
    proc = subprocess.Popen(train_cmd(demo, run_dir, 20, "logging.plot=false", *overrides),
                            cwd=ROOT, env=ENV, stdout=out, stderr=err, start_new_session=True)
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ready(run_dir):
            assert proc.poll() is None, (tmp_path / "stderr").read_text()[-3000:]
            assert time.monotonic() < deadline, f"{ready.__name__} not reached in time"
            time.sleep(0.1)
        tree = process_tree(proc.pid)
        err.flush()
        offset = (tmp_path / "stderr").stat().st_size
        signalled = time.monotonic()
        if to == "job step":
            _signal_every_process(tree, signum)
        else:
            (os.killpg if to == "group" else os.kill)(proc.pid, signum)
        code = proc.wait(timeout=DEADLINE_S)
        seconds = time.monotonic() - signalled
        assert survivors(tree) == []
        return code, (tmp_path / "stderr").read_bytes()[offset:].decode(), run_dir, seconds
    finally:
        for p in process_tree(proc.pid):
            try:
                p.kill()
            except psutil.Error:
                pass
        out.close()
        err.close()


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_the_finished_step_in_one_line(demo, tmp_path):
    """SIGTERM to `megatron-grpo train` alone (a supervisor's stop): one line, a checkpoint of
    the last finished step, and the ranks' stacks on kill -USR1 while it ran. (That the same
    command resumes from a stop's checkpoint: tests/test_launch_scripts.py's scancel test.)"""
    from megatron_grpo.trainer.checkpoint import complete_checkpoints

    code, said, run_dir, _ = _stop_with(signal.SIGTERM, "launcher", demo, tmp_path,
                                        ready=_two_steps_logged_and_the_ranks_stacks_dumped)
    lines = said.strip().splitlines()
    assert code == 143 and len(lines) == 1, said
    assert lines[0].startswith("error: stopped by SIGTERM after step ") and "saved a checkpoint of step" in lines[0]
    stopped_at = int(lines[0].split("after step ")[1].split()[0])
    assert stopped_at >= 2 and complete_checkpoints(run_dir)[-1][0] == stopped_at
    assert len(read_metrics(run_dir)) == stopped_at


@pytest.mark.slow
def test_ctrl_c_with_save_on_stop_false_stops_in_one_line_and_saves_nothing(demo, tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) with
    ``checkpoint.save_on_stop: false``: the run stops in one line after a finished step and
    writes no checkpoint (none was due: ``save_every=0``). (The SIGTERM tests save on stop.)"""
    from megatron_grpo.trainer.checkpoint import checkpoints_dir, complete_checkpoints

    code, said, run_dir, _ = _stop_with(signal.SIGINT, "group", demo, tmp_path,
                                        overrides=("checkpoint.save_every=0", "checkpoint.save_on_stop=false"))
    lines = said.strip().splitlines()
    assert code == 130 and len(lines) == 1, said
    assert lines[0].startswith("error: stopped by SIGINT after step ") and \
        "saved nothing (checkpoint.save_on_stop is false)" in lines[0], lines[0]
    assert lines[0].endswith("; there is none yet: the same command starts over"), lines[0]
    assert complete_checkpoints(run_dir) == []
    written = Path(checkpoints_dir(run_dir))
    assert not written.exists() or not any(written.iterdir()), sorted(written.rglob("*"))


@pytest.mark.slow
def test_slurms_sigterm_to_every_process_stops_in_one_line_and_saves_the_finished_step(demo, tmp_path):
    """Slurm's stop (``scancel --signal=TERM``, preemption): SIGTERM to every process of the job
    step at about the same time: the launcher, torchrun, the ranks AND the engine server, which
    exits of it while the ranks finish their step. Emulated here by signalling each process of
    the launcher's tree at once, not with real Slurm: the emulated cluster of
    tests/test_launch_scripts.py tracks a job's processes by process group (proctrack/pgid),
    which would miss the engine (its own session), while clusters track them by cgroup and
    reach it. The run must stop within seconds in one line with every process gone, keep the
    previous complete checkpoint, and save the last finished step without the engine. (The same
    command resuming from a stop's checkpoint: tests/test_launch_scripts.py's scancel test,
    under a real Slurm.)"""
    from megatron_grpo.trainer.checkpoint import complete_checkpoints

    def step_3_generated(run_dir: Path) -> bool:
        """Step 2's checkpoint is complete and the engine, idle, has answered a generation on
        step 2's weights (version 2) or later ones: the signal comes after step 3's generation
        (or a later step's, when this poll came late), while the ranks train or sync. A signal
        during the generation itself stops the run after the step before (the engine cannot
        answer), which a timer could not rule out: CI saw it once."""
        if not any(step == 2 for step, _ in complete_checkpoints(run_dir)):
            return False
        info = _engine_info(run_dir)
        requests = info["generate_requests"]
        version = info["weight_version"]  # "default" before the first sync
        return (version.isdigit() and int(version) >= 2 and requests["answered_on_weight_version"] >= 1
                and requests["in_flight"] == 0)

    code, said, run_dir, seconds = _stop_with(signal.SIGTERM, "job step", demo, tmp_path, ready=step_3_generated,
                                              overrides=("checkpoint.save_every=2", f"engine.api_key={ENGINE_KEY}"))
    lines = said.strip().splitlines()
    assert code == 143 and len(lines) == 1 and lines[0].startswith("error: stopped by SIGTERM after step "), said
    stopped_at = int(lines[0].split("after step ")[1].split()[0])
    checkpoints = [step for step, _ in complete_checkpoints(run_dir)]
    assert stopped_at >= 3 and checkpoints[-1] == stopped_at, (checkpoints, said)
    assert len(checkpoints) == 2 and checkpoints[0] % 2 == 0, checkpoints  # the previous one, intact
    if stopped_at % 2:  # usually step 3, saved on stop (an even step's checkpoint was due anyway)
        assert f"saved a checkpoint of step {stopped_at}" in lines[0], lines[0]
    assert len(read_metrics(run_dir)) == stopped_at
    launches = (run_dir / "rollout" / "server.log").read_text().count(" launch: ")
    assert launches == 1, f"the engine was relaunched {launches - 1} times while the run stopped"
    # the step in progress, a checkpoint and the shutdown: seconds, far from stop_timeout_s
    assert seconds < 60, (seconds, said)
    print(f"stopped {seconds:.1f} s after the signal: {lines[0]}")


def test_torchruns_report_of_a_signal_read_before_our_own_is_the_stop(tmp_path, capfd):
    """Ctrl-C reaches torchrun and the launcher together: torchrun's "Received 2 death signal"
    warning can be read before the launcher's KeyboardInterrupt is raised (the full suite once
    printed it and the worker lines after it). It is taken as the stop: nothing from it on is
    forwarded, and the output before it still is."""
    import sys

    from megatron_grpo.launcher.agent import forward_stderr as _forward_stderr

    torchrun = (
        "import sys, time\n"
        "sys.stderr.write('a rank line\\n'); sys.stderr.flush(); time.sleep(0.2)\n"
        "sys.stderr.write('W1124 12:25:09.709000 22831 site-packages/torch/distributed/elastic/agent/server/"
        "api.py:753] Received 2 death signal, shutting down workers\\nW1124 Sending process 7 closing signal "
        "SIGINT\\n'); sys.stderr.flush(); time.sleep(0.2)\n"
        "sys.stderr.write('a traceback line\\n')\n")
    proc = subprocess.Popen([sys.executable, "-c", torchrun], stderr=subprocess.PIPE)
    stopping: list = []
    _forward_stderr(proc, tmp_path / "no_error", stopping)
    proc.wait(timeout=30)
    assert capfd.readouterr().err == "a rank line\n"
    assert stopping == [signal.SIGINT]


def test_the_launcher_stops_reading_once_torchrun_has_exited(tmp_path, capfd):
    """Issue 48: a process a rank left behind (an environment's ``sleep 600``) held the ranks'
    stderr pipe open, and ``megatron-grpo train`` waited for its end for ever after the run had
    finished. The launcher now stops reading once torchrun's agent has exited (cli.DRAIN_S later)."""
    import sys

    from megatron_grpo.launcher.agent import forward_stderr as _forward_stderr

    marker = f"600.{uuid.uuid4().int % 10**12}"  # unique: a stale sleep of another run never matches
    agent = ("import subprocess, sys\n"
             f"subprocess.Popen(['sleep', '{marker}'])\n"  # inherits stderr, outlives this process
             "sys.stderr.write('the summary\\n')\n")
    proc = subprocess.Popen([sys.executable, "-c", agent], stderr=subprocess.PIPE)
    reader = threading.Thread(target=_forward_stderr, args=(proc, tmp_path / "no_error", []), daemon=True)
    try:
        reader.start()
        reader.join(timeout=15)
        assert not reader.is_alive(), "still reading the stderr the orphan holds open"
        assert proc.returncode == 0 and capfd.readouterr().err == "the summary\n"
    finally:
        for p in psutil.process_iter():
            if marker in _cmdline(p):
                p.kill()


def _ranks_started(run_dir: Path) -> bool:
    """Start-up: a rank of this run exists (importing, or in its rendezvous), no step logged."""
    return not read_metrics(run_dir) and any("megatron_grpo.train" in _cmdline(p) and str(run_dir) in _cmdline(p)
                                             for p in psutil.process_iter())


@pytest.mark.slow
def test_sigterm_during_start_up_stops_in_one_line_and_leaves_nothing(demo, tmp_path):
    """SIGTERM (Slurm's preemption warning) as soon as torchrun and its ranks exist, before the
    first step: the launcher exits with 143 and one line, within seconds, and no process of the
    run survives (checked by _stop_with); nothing was finished, so nothing is saved. (Before the
    launcher held SIGTERM while starting torchrun, a signal in that window killed the launcher
    alone: exit -15, no line.)"""
    from megatron_grpo.trainer.checkpoint import complete_checkpoints

    code, said, run_dir, seconds = _stop_with(signal.SIGTERM, "launcher", demo, tmp_path, ready=_ranks_started)
    lines = said.strip().splitlines()
    assert code == 143 and len(lines) == 1 and lines[0].startswith("error: stopped by SIGTERM"), said
    assert seconds < 60, (seconds, said)
    assert complete_checkpoints(run_dir) == []


def test_a_stop_signal_ends_the_wait_for_a_starting_server(monkeypatch):
    """A rank waiting for its rollout server to become healthy stops at once on SIGTERM (one line,
    exit code 143 through RunStopped) instead of waiting out the launch timeout."""
    from megatron_grpo.generation.manager import wait_healthy
    from megatron_grpo.runtime import stop
    from megatron_grpo.runtime.process import free_port

    monkeypatch.setattr(stop, "_received", int(signal.SIGTERM))
    started = time.monotonic()
    with pytest.raises(stop.RunStopped, match="stopped by SIGTERM while the rollout server at .* was starting") as e:
        wait_healthy(f"http://127.0.0.1:{free_port()}", time.monotonic() + 60)
    assert e.value.signum == signal.SIGTERM and time.monotonic() - started < 5


SUBREAPER_SCRIPT = r"""
import os, signal, subprocess, sys, time
from megatron_grpo.runtime.process import (become_subreaper, children_of, end_adopted_children,
                                           reap_exited_children)
assert become_subreaper()
mine = subprocess.Popen(["sleep", "30"])  # a child of this process's own: kept
# a child that starts two daemons in sessions of their own and exits: both are adopted here
starter = subprocess.Popen([sys.executable, "-c",
    "import subprocess; [subprocess.Popen(c, start_new_session=True) for c in (['sleep', '0.2'], ['sleep', '30'])]"])
starter.wait()
time.sleep(1.0)  # the short one has exited: a zombie of this process until reaped
adopted = set(children_of(os.getpid())) - {mine.pid}
zombies = children_of(os.getpid(), state="Z")
assert len(adopted) == 2 and len(zombies) == 1, (adopted, zombies)
assert reap_exited_children(frozenset({mine.pid})) == zombies
ended = end_adopted_children(keep=frozenset({mine.pid}))
assert len(ended) == 1 and set(ended) < adopted, (ended, adopted)
assert children_of(os.getpid()) == [mine.pid], children_of(os.getpid())
assert mine.poll() is None
mine.kill()
print("ok")
"""


def test_the_subreaper_reaps_its_exited_orphans_and_ends_the_others_but_its_own_children():
    """``runtime.process``, which ``megatron-grpo train`` uses (``launcher/agent.py``): as the
    subreaper, a process adopts the daemons a child started before exiting; the one that exits
    is reaped (``reap_exited_children``; a zombie otherwise: init reaped it before), the other is
    ended with its group (``end_adopted_children``), and a child in ``keep`` is left alone. In a
    subprocess: the subreaper setting is the process's own."""
    out = subprocess.run([sys.executable, "-c", SUBREAPER_SCRIPT], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


FORK_DIED_SCRIPT = """
import multiprocessing as mp, os, signal, sys, time
from megatron_grpo.runtime.process import DeadlinePassed, ForkDied, fail_when_a_fork_dies

ctx = mp.get_context("fork")


def killed(q):
    os.kill(os.getpid(), signal.SIGKILL)


def exits_3(q):
    os._exit(3)


def works(q):
    q.task_done()


for target, how in ((killed, "killed by SIGKILL"), (exits_3, "exited with status 3")):
    q = ctx.JoinableQueue()
    q.put(1)
    started = time.monotonic()
    try:
        with fail_when_a_fork_dies("a writer"):
            ctx.Process(target=target, args=(q,)).start()
            q.join()  # megatron-core's wait for its writers: no deadline
        sys.exit("no ForkDied for " + how)
    except ForkDied as e:
        assert str(e).startswith("a writer process (pid ") and str(e).endswith(how + " before it finished"), e
    assert time.monotonic() - started < 10, time.monotonic() - started

early = ctx.Process(target=killed, args=(None,))
early.start()  # before the block: not one of its children
q = ctx.JoinableQueue()
q.put(1)
with fail_when_a_fork_dies("a writer"):
    p = ctx.Process(target=works, args=(q,))
    p.start()
    q.join()
    early.join()
    time.sleep(1.0)  # the watch looked at both
p.join()
assert p.exitcode == 0 and early.exitcode == -9  # their owner still gets their status
assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # the handler is put back


def hangs(q):
    time.sleep(3600)  # a writer on a stalled filesystem: alive, never done


q = ctx.JoinableQueue()
q.put(1)
started = time.monotonic()
try:
    with fail_when_a_fork_dies("a writer", 1.0, "x.timeout_s"):
        hung = ctx.Process(target=hangs, args=(q,))
        hung.start()
        q.join()
    sys.exit("no DeadlinePassed for a hung child")
except DeadlinePassed as e:
    assert str(e) == "not finished within x.timeout_s (1 s); 1 writer process still running killed", e
assert 0.9 < time.monotonic() - started < 5, time.monotonic() - started
hung.join(10)
assert hung.exitcode == -9, hung.exitcode  # killed, not left writing

started = time.monotonic()
try:
    with fail_when_a_fork_dies("a writer", 0.5, "x.timeout_s"):
        time.sleep(60)  # the main thread itself stuck, nothing forked
    sys.exit("no DeadlinePassed for the main thread")
except DeadlinePassed as e:
    assert str(e) == "not finished within x.timeout_s (0.5 s)", e
assert time.monotonic() - started < 5, time.monotonic() - started

with fail_when_a_fork_dies("a writer", 0.5, "x.timeout_s"):
    pass  # a block that ends in time raises nothing later
time.sleep(1.0)
assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL
print("ok")
"""


def test_a_fork_that_dies_in_the_block_interrupts_the_main_threads_wait():
    """``runtime.process.fail_when_a_fork_dies``, around megatron-core's checkpoint save (whose
    forked shard writers it waits for in ``JoinableQueue.join()``, no deadline): a child started
    in the block killed with -9, or exiting non-zero, raises ``ForkDied`` in the main thread
    within a second; a child that finishes, or one started before the block, raises nothing, and
    its status is still its owner's. With a deadline: a child that hangs is killed and
    ``DeadlinePassed`` raised at the deadline, as for a main thread stuck with no child; a block
    that ends in time raises nothing after. In a subprocess: the block installs a signal handler."""
    out = subprocess.run([sys.executable, "-c", FORK_DIED_SCRIPT], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
