"""The launch scripts of docs/launching.md, run as a user runs them.

* every script parses (`bash -n`);
* fast: what each script hands to `megatron-grpo train` (stand-ins for it, and for `srun` and
  `scontrol`, record the arguments): node rank, master address, ranks per node, overrides
  with spaces and quotes intact;
* slow, the real thing on the CPU demo (TP=2 spanning two emulated nodes of one rank each,
  the engine launched by global rank 0, weights synced every step): two `multi_node.sh` on
  loopback train and write a checkpoint; a node killed with -9 makes the
  other exit within a deadline with one line, and relaunching both resumes from the last
  complete checkpoint (with an external engine, started separately, that outlives the
  trainer); a node alone gives up on the rendezvous in time; `single_node.sh`; and
  `sbatch launch/slurm.sbatch` under a real Slurm of two slurmd on this machine.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_grpo.runtime.parallel import peer_failure
from megatron_grpo.runtime.process import free_port
from megatron_grpo.trainer.checkpoint import complete_checkpoints
from megatron_grpo.launcher.agent import launcher_exception
from megatron_grpo.launcher.nodes import NodeError, NodeSpec
from tests.support.demo_run import ROOT, demo_overrides, read_metrics, wait_for_steps
from tests.support.launch_nodes import (CONFIG, SLURM_PROGRAMS, EmulatedSlurm, log, running_with, script_env,
                                        slurm_installed, start_node, start_nodes, stop_nodes, wait_nodes)
from tests.support.kill_resume import kill_tree, rank_processes

SCRIPTS = sorted(p for p in (ROOT / "launch").iterdir() if p.suffix in (".sh", ".sbatch"))
# Variables of the user's shell that the scripts read: a test sets the ones it means.
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE", "NPROC")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    # A quote inside ${VAR:?message} once made multi_node.sh unparseable: every multi-node
    # launch failed before torchrun started.
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr


# ---- what the scripts pass on (stand-ins record it) --------------------------------------------

STAND_INS = {
    "megatron-grpo": """#!/usr/bin/env bash
printf '%s\n' "$PWD" "$@" > "$RECORD_DIR/node${NODE_RANK:-}.args"
""",
    # one task per node of the allocation, SLURM_NODEID set per task, like srun in a job
    "srun": """#!/usr/bin/env bash
printf '%s\n' "$@" > "$RECORD_DIR/srun.args"
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
code=0; for p in "${pids[@]}"; do wait "$p" || code=$?; done; exit $code
""",
    "scontrol": """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] || exit 64
tr ',' '\n' <<< "$3"
""",
}
OVERRIDES = ["trainer.run_dir=/runs/a b", "data.system_prompt=it's \"quoted\""]


@pytest.fixture
def stand_ins(tmp_path):
    """(env, records): the scripts' environment with the stand-ins first on PATH."""
    bin_dir, records = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    records.mkdir()
    for name, text in STAND_INS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in script_env().items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", RECORD_DIR=str(records))
    return env, records


def run_script(args, env, cwd=ROOT):
    return subprocess.run(["bash", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def recorded(records, name):
    return (records / name).read_text().splitlines()


def test_single_node_sh_hands_nproc_and_overrides_to_train(stand_ins):
    env, records = stand_ins
    assert run_script(["launch/single_node.sh", CONFIG, *OVERRIDES], {**env, "NPROC": "3"}).returncode == 0
    assert recorded(records, "node.args") == [str(ROOT), "train", "--config", CONFIG, "--nproc", "3", *OVERRIDES]
    assert run_script(["launch/single_node.sh", CONFIG], env).returncode == 0  # NPROC from the config
    assert recorded(records, "node.args") == [str(ROOT), "train", "--config", CONFIG]


def test_multi_node_sh_names_a_missing_variable_in_one_line(stand_ins):
    env, _ = stand_ins
    out = run_script(["launch/multi_node.sh", CONFIG], {**env, "NNODES": "2", "NODE_RANK": "0"})
    assert out.returncode != 0 and out.stderr.count("\n") == 1 and "MASTER_ADDR" in out.stderr, out.stderr


def test_slurm_sbatch_maps_the_slurm_environment_to_nodes(stand_ins, tmp_path):
    """As sbatch runs it: from a spool copy (not in the repository), with the allocation in
    SLURM_* variables; each srun task is one node of multi_node.sh."""
    env, records = stand_ins
    env.update(SLURM_JOB_NODELIST="gpu-a,gpu-b", SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(ROOT), SLURM_GPUS_ON_NODE="4")
    spool_copy = tmp_path / "slurm_script"
    spool_copy.write_text((ROOT / "launch" / "slurm.sbatch").read_text())
    out = run_script([str(spool_copy), CONFIG, *OVERRIDES], env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "--kill-on-bad-exit=1" in recorded(records, "srun.args")
    for rank in (0, 1):
        assert recorded(records, f"node{rank}.args") == [
            str(ROOT), "train", "--config", CONFIG, "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", "gpu-a", "--master-port", "29500", "--nproc", "4", *OVERRIDES]


# ---- a lost peer in one line -----------------------------------------------------------------

# What gloo and NCCL raise when a peer is gone, and the one line the ranks print for it.
PEER_ERRORS = [
    (RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                  "[10.0.0.2]:33440. This is typically caused by a remote worker crashing. GLHF!"),
     "Connection closed by peer [10.0.0.2]:33440"),
    (RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                  "600000ms for recv operation to complete"),
     "Timed out waiting 600000ms for recv operation to complete"),
    (dist.DistBackendError("NCCL communicator was aborted on rank 3. Original reason: watchdog"),
     "NCCL communicator was aborted on rank 3"),
]


@pytest.mark.parametrize("error,line", PEER_ERRORS, ids=["gloo-closed", "gloo-timeout", "nccl"])
def test_peer_failure_is_one_line(error, line):
    try:
        try:
            raise error
        except Exception as e:
            raise KeyError("a wrapper (dist_checkpointing, ...)") from e
    except KeyError as wrapped:
        assert peer_failure(wrapped) == line


def test_other_errors_are_not_peer_failures():
    assert peer_failure(RuntimeError("shape mismatch [2, 3] vs [3, 2]")) is None
    assert peer_failure(ValueError("gloo/transport/ in a value error")) is None


# ---- megatron-grpo train as one node of several ---------------------------------------------

def test_one_node_is_standalone_and_several_meet_at_node_0():
    assert NodeSpec().torchrun_args(600) == ["--standalone"]
    assert NodeSpec(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400).torchrun_args(59.5) == [
        "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29400", "--rdzv_conf=timeout=60"]


@pytest.mark.parametrize("kwargs,fragment", [
    ({"nnodes": 0}, "--nnodes must be >= 1"),
    ({"nnodes": 2, "node_rank": 2, "master_addr": "h"}, "--node-rank must be in 0..1"),
    ({"nnodes": 2}, "--master-addr (the address of node 0) is required"),
    ({"master_port": 70000}, "--master-port must be in 1..65535"),
])
def test_bad_node_arguments_are_one_line(kwargs, fragment):
    with pytest.raises(NodeError, match=re.escape(fragment)):
        NodeSpec(**kwargs)


def test_torchrun_failure_of_its_own_is_repeated_as_one_line():
    store_timeout = (b"Traceback (most recent call last):\n  File \"run.py\"\n"
                     b"torch.distributed.DistStoreError: Timed out after 11 seconds waiting for clients. "
                     b"1/2 clients joined.\n")
    assert launcher_exception(store_timeout) == ("DistStoreError: Timed out after 11 seconds waiting for "
                                                 "clients. 1/2 clients joined.")
    rank_failed = (b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n====\n"
                   b"megatron_grpo.train FAILED\n----\n  exitcode  : 1 (pid: 12)\n====\n")
    assert launcher_exception(rank_failed) is None  # the rank's own output said why


# ---- the real runs: emulated nodes on the CPU demo ---------------------------------------------

RUN_S = 420  # deadline of one launch (measured: 45-120 s each, 2 cores shared with other jobs at load ~14)


@pytest.fixture
def no_leftovers(demo):
    """After the test, no process of the demo is left (ranks, agents and engines all name
    the demo's model directory on their command line)."""
    yield
    assert running_with(str(demo)) == []


def overrides(demo, run_dir, steps, *extra):
    return demo_overrides(demo, run_dir, steps, "logging.plot=false", *extra)


def steps_logged(run_dir):
    return [r["step"] for r in read_metrics(run_dir)]


def assert_engine_served_the_trained_weights(run_dir):
    # log-probs of the engine == the trainer's (whose TP shards live on both nodes): the
    # weights were synced into the engine after every step
    assert max(r["rollout_train_logprobs_abs_diff_mean"] for r in read_metrics(run_dir)) < 1e-4


@pytest.mark.slow
def test_two_nodes_train(demo, tmp_path, no_leftovers):
    """Two `multi_node.sh`, the engine launched by global rank 0. (A relaunch of two nodes
    resuming is test_node_killed_ends_the_other_in_time_and_relaunch_resumes's.)"""
    run_dir = tmp_path / "run"
    nodes = start_nodes(2, overrides(demo, run_dir, 2), tmp_path, "first")
    try:
        assert wait_nodes(nodes, RUN_S) == [0, 0], log(tmp_path, "first", 0)[-3000:] + log(tmp_path, "first", 1)[-3000:]
    finally:
        stop_nodes(nodes)
    assert steps_logged(run_dir) == [1, 2]  # written once, by global rank 0
    assert (run_dir / "checkpoints" / "step_000002" / "COMPLETE").is_file()
    assert (run_dir / "rollout" / "server.log").read_text().count("launch:") == 1  # one engine, rank 0's
    assert "reward_mean" in log(tmp_path, "first", 0, "out") and "reward_mean" not in log(tmp_path, "first", 1, "out")
    assert_engine_served_the_trained_weights(run_dir)


@pytest.fixture
def external_engine(demo):
    """`megatron-grpo serve` started on its own, as on a separate rollout node; its URL."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "megatron_grpo.inference.serve", "--model-dir", str(demo / "model"),
                               "--host", "127.0.0.1", "--port", str(port)], cwd=ROOT, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    yield f"http://127.0.0.1:{port}"
    kill_tree(server)


@pytest.mark.slow
def test_node_killed_ends_the_other_in_time_and_relaunch_resumes(demo, tmp_path, no_leftovers, external_engine):
    """Layout of multi_node.sh's header: the engine runs apart (engine.urls) and outlives
    the trainer; node 1 is killed -9 (its torchrun and rank) after step 3."""
    run_dir = tmp_path / "run"
    args = overrides(demo, run_dir, 8, "checkpoint.save_every=2", f"engine.urls=[{external_engine}]")
    nodes = start_nodes(2, args, tmp_path, "killed")
    try:
        wait_for_steps(run_dir, 3, nodes, RUN_S)
        kill_tree(nodes[1])
        killed = time.monotonic()
        assert wait_nodes(nodes[:1], 120) == [1]
        took = time.monotonic() - killed
    finally:
        stop_nodes(nodes)
    errors = [line for line in log(tmp_path, "killed", 0).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 on node 0 lost contact with the other ranks: ")
    assert took < 60, took  # measured: 5-6 s (the rank's socket to the dead one closes)
    newest = complete_checkpoints(run_dir)[-1][0]

    nodes = start_nodes(2, args, tmp_path, "relaunched")
    try:
        assert wait_nodes(nodes, RUN_S) == [0, 0], log(tmp_path, "relaunched", 0)[-3000:]
    finally:
        stop_nodes(nodes)
    assert f"resumed from checkpoint step {newest}" in log(tmp_path, "relaunched", 0, "out")
    assert steps_logged(run_dir) == list(range(1, 9))
    assert_engine_served_the_trained_weights(run_dir)


@pytest.mark.slow
def test_node_alone_gives_up_on_the_rendezvous_in_time(demo, tmp_path, no_leftovers):
    # node 0 of 2; node 1 never comes
    node = start_node(0, 2, free_port(), overrides(demo, tmp_path / "run", 2, "parallel.distributed_timeout_s=5"),
                      tmp_path, "alone")
    assert wait_nodes([node], 90) == [1]
    last = log(tmp_path, "alone", 0).strip().splitlines()[-1]
    assert last.startswith("error: torchrun stopped (exit code 1): DistStoreError: Timed out after"), last


@pytest.mark.slow
def test_single_node_sh_trains(demo, tmp_path, no_leftovers):
    run_dir = tmp_path / "run"
    args = overrides(demo, run_dir, 1, "engine.kind=inprocess")  # the YAML's engine: the script is the point
    out = subprocess.run(["bash", "launch/single_node.sh", CONFIG, *args], cwd=ROOT,
                         env={k: v for k, v in script_env().items() if k not in LAUNCH_VARS},
                         capture_output=True, text=True, timeout=RUN_S)
    assert out.returncode == 0, out.stderr[-3000:]
    assert steps_logged(run_dir) == [1]


@pytest.fixture
def slurm(tmp_path, request):
    """The emulated 2-node cluster; ``indirect`` parametrization sets its KillWait (s)."""
    if not slurm_installed():
        if os.environ.get("MEGATRON_GRPO_REQUIRE_SLURM"):  # set by .ci/run, which installs it
            pytest.fail(f"MEGATRON_GRPO_REQUIRE_SLURM is set but Slurm is not installed ({', '.join(SLURM_PROGRAMS)})")
        pytest.skip("Slurm is not installed (Debian: apt-get install slurmd slurmctld slurm-client; .ci/run does)")
    cluster = EmulatedSlurm(tmp_path / "slurm", kill_wait_s=getattr(request, "param", 30))
    cluster.start()
    yield cluster
    cluster.stop()


# KillWait: Slurm sends SIGKILL this long after a cancel's SIGTERM. Its default is 30 s, and
# clusters set their own; a stop must finish the step and save within it, and
# checkpoint.stop_timeout_s is kept below it (docs/fault_tolerance.md). On the 2-core CI machine
# with two test workers a step plus its save took over 30 s once (the SIGKILL came first: no
# line, the job's log held srun's alone), so this cluster gives 120 s and the run 90 s.
KILL_WAIT_S = 120
STOP_TIMEOUT_S = 90
SLOW_STOP_S = 20  # a stop takes ~2 s here (quiet or beside 4 busy processes): past this, dump its stacks


@pytest.mark.slow
@pytest.mark.parametrize("slurm", [KILL_WAIT_S], indirect=True)
def test_scancel_stops_the_job_in_one_line_per_node_and_sbatch_resumes_it(demo, tmp_path, no_leftovers, slurm):
    """`sbatch launch/slurm.sbatch` on two emulated nodes, then Slurm's own cancel, as a user's
    `scancel JOBID` or a preemption sends it: SIGTERM to every process of the job's steps on
    both nodes, SIGKILL ``KillWait`` later. Each node's launcher prints one line, the ranks
    finish their step and save it, all before the SIGKILL; nothing is left. The same `sbatch`
    then resumes from that checkpoint and finishes the run (exit 0), the engine serving the
    weights trained across both jobs. (Under the emulated cluster's proctrack/pgid the engine,
    in a session of its own, gets no signal: its rank stops it. The signal reaching the engine
    too is tests/test_process_lifetime.py's Slurm test.)"""
    run_dir = tmp_path / "run dir"  # a space: the overrides reach every node intact
    job_log = tmp_path / "job.out"
    job = slurm.submit(_job_args(job_log, overrides(demo, run_dir, 500, "checkpoint.save_every=0",
                                                    f"checkpoint.stop_timeout_s={STOP_TIMEOUT_S}")),
                       MASTER_PORT=str(free_port()))
    try:
        deadline = time.monotonic() + RUN_S
        while len(read_metrics(run_dir)) < 2:
            assert job.poll() is None, job_log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "2 steps not logged in time"
            time.sleep(0.2)
        (job_id,) = slurm.job_ids()
        subprocess.run(["scancel", job_id], env=slurm.env, timeout=30, check=True)
        cancelled = time.monotonic()
        # The nodes' lines reach the log when their launchers exit, and they are what is timed.
        # `sbatch --wait` is no clock: it polls the job's state, which turns CANCELLED at once,
        # so it may exit a second after the cancel while the steps still finish (CI once read
        # the log then, before either line). The job leaves squeue only once its steps ended.
        stacks = ""
        while len(_launcher_lines(job_log)) < 2 and (job.poll() is None or slurm.job_ids()):
            assert time.monotonic() - cancelled < KILL_WAIT_S + 60, "the job outlived its SIGKILL"
            if not stacks and time.monotonic() - cancelled > SLOW_STOP_S:
                stacks = _dump_stacks(run_dir)  # for the failure message, should this stop be too slow
            time.sleep(0.2)
        took = time.monotonic() - cancelled
        slurm.finish(job, KILL_WAIT_S + 60)
    finally:
        if job.poll() is None:
            slurm.cancel(job)
    said = job_log.read_text(errors="replace")
    ours = _launcher_lines(job_log)
    assert len(ours) == 2, (f"{took:.0f} s after scancel", said[-3000:], stacks)  # one per node
    assert all(line.startswith("error: stopped by SIGTERM after step ") for line in ours), ours
    stopped_at = max(int(line.split("after step ")[1].split()[0]) for line in ours)
    assert stopped_at >= 2 and complete_checkpoints(run_dir)[-1][0] == stopped_at, (complete_checkpoints(run_dir), ours)
    assert steps_logged(run_dir) == list(range(1, stopped_at + 1))
    assert took < KILL_WAIT_S, (took, said[-3000:], stacks)  # stopped by us, not by Slurm's SIGKILL
    print(f"the nodes' lines came {took:.1f} s after scancel: {ours}")

    resumed_log = tmp_path / "resumed.out"
    out = slurm.sbatch(_job_args(resumed_log, overrides(demo, run_dir, stopped_at + 1)), timeout_s=RUN_S,
                       MASTER_PORT=str(free_port()))
    assert out.returncode == 0, out.stderr + resumed_log.read_text(errors="replace")[-3000:]
    assert f"resumed from checkpoint step {stopped_at}" in resumed_log.read_text(errors="replace")
    assert steps_logged(run_dir) == list(range(1, stopped_at + 2))
    assert_engine_served_the_trained_weights(run_dir)


def _job_args(job_log: Path, run_overrides: list[str]) -> list[str]:
    """sbatch's arguments for launch/slurm.sbatch on the demo: the CPU-only cluster has no GPUs,
    so the script's GPU/CPU request is overridden, as sbatch allows."""
    return ["--gpus-per-node=0", "--cpus-per-task=1", f"--output={job_log}", "launch/slurm.sbatch", CONFIG,
            *run_overrides]


def _dump_stacks(run_dir: Path) -> str:
    """The run's processes and every rank's Python stacks (``kill -USR1``, runtime/stacks.py)."""
    import psutil

    from megatron_grpo.runtime.stacks import stacks_file

    procs = [p for p in psutil.process_iter(["pid", "ppid", "status", "cmdline"])
             if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    for rank in rank_processes(run_dir):
        try:
            rank.send_signal(signal.SIGUSR1)
        except psutil.Error:
            pass
    time.sleep(2)
    listing = "\n".join(f"{p.info['pid']} {p.info['ppid']} {p.info['status']} {' '.join(p.info['cmdline'])[:150]}"
                         for p in procs)
    dumps = "\n".join(f"--- {f}\n{f.read_text()[-4000:]}" for f in sorted(stacks_file(run_dir, 0).parent.glob("*.txt")))
    return f"\nthe run's processes {SLOW_STOP_S} s after scancel:\n{listing}\n{dumps}"


def _launcher_lines(job_log: Path) -> list[str]:
    """The launchers' lines in a Slurm job's log (srun's and slurmstepd's have their prefixes)."""
    text = job_log.read_text(errors="replace") if job_log.exists() else ""
    return [line for line in text.splitlines() if line.startswith("error:")]
