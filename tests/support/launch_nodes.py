"""Several "nodes" on one machine for the launch-script tests: each node is one
`bash launch/multi_node.sh` (own NODE_RANK, loopback MASTER_ADDR) in its own session, or one
task of launch/slurm.sbatch under a real Slurm whose two slurmd run here (`EmulatedSlurm`).
Every wait has a deadline, and whatever a test starts it stops."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from megatron_grpo.runtime.process import free_port
from tests.support.demo_run import ENV, ROOT
from tests.support.kill_resume import kill_tree

CONFIG = "yaml_configs/demo_cpu.yaml"


def script_env(**extra: str) -> dict[str, str]:
    """The environment a user's shell would give the scripts: this interpreter's `megatron-grpo`
    first on PATH (the scripts call it by name)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), ENV.get("PATH", "")])
    return {**ENV, "PATH": path, **extra}


def start_node(rank: int, nnodes: int, port: int, overrides: list[str], log_dir: Path, tag: str) -> subprocess.Popen:
    """`launch/multi_node.sh` as node ``rank`` of ``nnodes`` with one rank, in a new session;
    its stdout/stderr go to ``log_dir/{tag}-node{rank}.out|.err``."""
    env = script_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NNODES=str(nnodes), NODE_RANK=str(rank),
                     NPROC_PER_NODE="1")
    with open(log_dir / f"{tag}-node{rank}.out", "wb") as out, open(log_dir / f"{tag}-node{rank}.err", "wb") as err:
        return subprocess.Popen(["bash", "launch/multi_node.sh", CONFIG, *overrides], cwd=ROOT, env=env,
                                stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)


def start_nodes(nnodes: int, overrides: list[str], log_dir: Path, tag: str) -> list[subprocess.Popen]:
    port = free_port()
    return [start_node(rank, nnodes, port, overrides, log_dir, tag) for rank in range(nnodes)]


def wait_nodes(nodes: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """Exit codes of every node; all of them are killed and the test fails past the deadline."""
    deadline = time.monotonic() + timeout_s
    for node in nodes:
        try:
            node.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_nodes(nodes)
            raise AssertionError(f"the nodes did not finish within {timeout_s:.0f} s") from None
    return [node.returncode for node in nodes]


def stop_nodes(nodes: list[subprocess.Popen]) -> None:
    for node in nodes:
        if node.poll() is None:
            kill_tree(node)


def log(log_dir: Path, tag: str, rank: int, stream: str = "err") -> str:
    return (log_dir / f"{tag}-node{rank}.{stream}").read_text(errors="replace")


def running_with(marker: str, timeout_s: float = 20.0) -> list[str]:
    """Command lines of live processes mentioning ``marker``, once the deadline passed or
    none is left (a stopped engine may take a moment to go)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = []
        for p in psutil.process_iter(["cmdline", "status"]):
            try:
                line = " ".join(p.info["cmdline"] or [])
            except (psutil.Error, TypeError):
                continue
            if marker in line and p.info["status"] != psutil.STATUS_ZOMBIE and p.pid != os.getpid():
                found.append(line)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


# ---- a real Slurm of two nodes on this machine ------------------------------------------------

SLURM_PROGRAMS = ("slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "srun", "scancel", "squeue")
SBIN = ("/usr/sbin", "/sbin")  # where the daemons are: not on a normal user's PATH


def slurm_installed() -> bool:
    path = os.pathsep.join([os.environ.get("PATH", ""), *SBIN])
    return all(shutil.which(p, path=path) for p in SLURM_PROGRAMS)


class EmulatedSlurm:
    """slurmctld and one slurmd per node (``slurmd -N``), all in the foreground as this
    process's children, talking over loopback, no munge (auth/none), no cgroups.

    The node names are loopback addresses (127.0.0.1, 127.0.0.2, ...) because slurm.sbatch
    takes MASTER_ADDR from the first host name of the allocation, as on a real cluster,
    and these resolve without touching /etc/hosts. Every slurmd listens on 127.0.0.1
    (own port)."""

    def __init__(self, work: Path, num_nodes: int = 2, kill_wait_s: int = 30):
        self.work = work
        self.kill_wait_s = kill_wait_s  # KillWait: a cancel's SIGKILL follows its SIGTERM this long after
        # slurmstepd makes Unix sockets in the spool directory, whose paths must stay under 108
        # bytes: a pytest-xdist worker's tmp_path is too deep (the step failed to start and the
        # job was requeued until the test's deadline), so the spool lives in a short /tmp dir
        self.spool = Path(tempfile.mkdtemp(prefix="slurm-"))
        self.names = [f"127.0.0.{i + 1}" for i in range(num_nodes)]
        self.conf = work / "slurm.conf"
        env = script_env(SLURM_CONF=str(self.conf))
        self.env = {**env, "PATH": os.pathsep.join([env["PATH"], *SBIN])}
        self.daemons: list[subprocess.Popen] = []

    def _write_conf(self) -> None:
        for sub in ("state", "log"):
            (self.work / sub).mkdir(parents=True, exist_ok=True)
        user = psutil.Process().username()
        nodes = [f"NodeName={n} NodeAddr=127.0.0.1 Port={free_port()} CPUs=1 "
                 "RealMemory=1000 State=UNKNOWN" for n in self.names]
        self.conf.write_text("\n".join([
            "ClusterName=emulated", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={free_port()}",
            f"SlurmUser={user}", f"SlurmdUser={user}", "AuthType=auth/none", "CredType=cred/none",
            f"StateSaveLocation={self.work}/state", f"SlurmdSpoolDir={self.spool}/%n",
            f"SlurmctldPidFile={self.work}/slurmctld.pid", f"SlurmdPidFile={self.work}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.work}/log/slurmctld.log", f"SlurmdLogFile={self.work}/log/slurmd-%n.log",
            f"KillWait={self.kill_wait_s}", "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "MpiDefault=none",
            "ReturnToService=2",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", *nodes,
            f"PartitionName=emulated Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP", ""]))

    def _spawn(self, cmd: list[str]) -> None:
        self.daemons.append(subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL, start_new_session=True))

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the daemons and wait until every node is idle."""
        self._write_conf()
        self._spawn(["slurmctld", "-D", "-i"])
        for name in self.names:
            self._spawn(["slurmd", "-D", "-N", name])
        deadline = time.monotonic() + timeout_s
        states: list[str] = []
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True,
                                 timeout=30)
            states = out.stdout.split()
            if out.returncode == 0 and states == ["idle"] * len(self.names):
                return
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"the emulated Slurm did not come up within {timeout_s:.0f} s (node states {states}); "
                             f"logs in {self.work}/log")

    def sbatch(self, args: list[str], timeout_s: float, **env: str) -> subprocess.CompletedProcess:
        """`sbatch --wait ARGS` from the repository root; the job is cancelled past the deadline."""
        return self.finish(self.submit(args, **env), timeout_s)

    def submit(self, args: list[str], **env: str) -> subprocess.Popen:
        """`sbatch --wait ARGS` from the repository root, not waited for (``finish`` it)."""
        return subprocess.Popen(["sbatch", "--wait", "--parsable", *args], cwd=ROOT, env={**self.env, **env},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def job_ids(self) -> list[str]:
        out = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True, timeout=30)
        return out.stdout.split()

    def finish(self, proc: subprocess.Popen, timeout_s: float) -> subprocess.CompletedProcess:
        """Wait for a ``submit``ted job; past the deadline it is cancelled and this fails."""
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _, err = self.cancel(proc)
            raise AssertionError(f"the Slurm job did not finish within {timeout_s:.0f} s: {err[-2000:]}") from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def cancel(self, proc: subprocess.Popen) -> tuple[str, str]:
        """Cancel every job and reap ``proc`` (a ``submit``), raising nothing (a test's cleanup:
        an error of its own would hide the test's); returns its (stdout, stderr)."""
        subprocess.run(["scancel", "--full", "--partition=emulated"], env=self.env, timeout=30)
        proc.kill()
        return proc.communicate()

    def stop(self) -> None:
        for daemon in self.daemons:
            kill_tree(daemon)
        self.daemons = []
        shutil.rmtree(self.spool, ignore_errors=True)
