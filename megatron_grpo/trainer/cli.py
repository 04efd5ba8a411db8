"""Entry points of a training run.

* ``megatron-grpo train --config FILE [section.key=value ...] [--nproc N]``: validates the
  config and the inputs it names (pre-flight), then starts ``N`` ranks on this machine with
  ``torch.distributed.run`` (N = ``parallel.world_size``, default tp*pp). With ``--nnodes K
  --node-rank R --master-addr A`` it is node R of K (``nodes``; launch/multi_node.sh) and
  starts its share of the ranks, N / K by default.
* ``torchrun ... -m megatron_grpo.train --config FILE [overrides]``: one rank of a run
  (single or multi node); this is what the launcher and ``launch/`` scripts start.

User mistakes (config, data, model directory, reward functions) end with ONE line naming
the file and key/line on stderr and exit code 2. Pre-flight catches them before anything is
written to the run directory; the few that only show during training (a reward function
that raises on a real response) are recorded by the rank that hit them, and ``train``
prints that one line instead of torchrun's failure report.

Imports sit at the top except the driver's (``rank_main``): importing it (megatron-core's
optimizer, schedules and DDP) more than doubles the start-up, 3.0-3.7 s -> 7.2-7.4 s for
``import megatron_grpo.trainer.cli`` (2 busy CPU cores, measured for issue #24), which every
``megatron-grpo train`` pays before it can report a bad config (2.4-2.6 s now), and it
would print megatron-core's apex/TransformerEngine warnings before ``quiet_library_warnings``
runs. ``megatron-grpo --help`` imports no sub-command (0.1-0.2 s); ``validate-config`` takes
2.4-2.7 s.
"""

from __future__ import annotations

import argparse
import os
import re
import select
import signal
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import NoReturn

from megatron_grpo.config import ConfigError, ExperimentConfig, load_config
from megatron_grpo.preflight import load_experiment
from megatron_grpo.preflight.errors import USER_ERRORS, describe_user_error
from megatron_grpo.preflight.run import check_run
from megatron_grpo.rollout.http_engine import spawn_servers
from megatron_grpo.runtime import parallel, stacks, stop
from megatron_grpo.runtime.collectives import RunAborted
from megatron_grpo.runtime.library_warnings import quiet_library_warnings
from megatron_grpo.runtime.process import die_with_parent
from megatron_grpo.runtime.run_lock import lock_run_dir
from megatron_grpo.trainer import nodes

EXIT_USER_ERROR = 2
EXIT_RUN_ABORTED = 1
ERROR_FILE_ENV = "MEGATRON_GRPO_USER_ERROR_FILE"  # where a rank records its user error for `train`


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types whose message is a complete one-line user-facing error."""
    return USER_ERRORS


def _parse(argv: list[str], prog: str, launcher: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description="Run a GRPO experiment.")
    parser.add_argument("--config", required=True, help="experiment YAML (yaml_configs/...)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.num_steps=10")
    if launcher:
        parser.add_argument("--nproc", type=int, default=None,
                            help="ranks to start on this machine (default (parallel.world_size or tp*pp) / nnodes)")
        nodes.add_arguments(parser)
    return parser.parse_args(argv)


def _ranks_per_node(cfg: ExperimentConfig, nnodes: int) -> int:
    """This machine's share of the run's ranks when ``--nproc`` is not given."""
    total = cfg.parallel.world_size or cfg.parallel.tp * cfg.parallel.pp
    if total % nnodes:
        raise ConfigError("parallel.world_size", f"{total} ranks do not split evenly over --nnodes {nnodes}; "
                                                 "pass --nproc (ranks per node)")
    return total // nnodes


def _fail(message: str, code: int = EXIT_USER_ERROR) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def _record_user_error(line: str, path: str) -> None:
    """Write ``line`` to ``path`` unless a rank already did (first error wins, atomically)."""
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(line + "\n")
    try:
        os.link(tmp, path)  # fails if another rank recorded its error first
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


class _Agent:
    """torchrun's elastic agent in a child forked from the launcher: ``Popen``'s interface as
    ``_launch_ranks`` uses it (``pid``, ``stderr``, ``poll``, ``wait``, ``send_signal``).

    Forked, not exec'd (``python -m torch.distributed.run``): the launcher has imported torch
    for its pre-flight, and a fresh interpreter spends ~1.9 CPU s importing it again before it
    starts a rank (2 cores, measured), on every launch and in series with everything after.
    The agent computes nothing, so no thread pool of torch's is needed in the fork. It keeps the
    launcher's command line; ``ps -o comm`` shows ``pt_elastic``, the name torch gives it."""

    def __init__(self, torchrun_args: list[str], env: dict[str, str]):
        read_fd, write_fd = os.pipe()
        parent = os.getpid()
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here may be written twice
            stream.flush()
        with warnings.catch_warnings():  # Python >= 3.12 warns of any thread (a tokenizer's pool)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _run_agent(torchrun_args, env, parent, write_fd)  # never returns
        os.close(write_fd)
        self.pid = pid
        self.stderr = os.fdopen(read_fd, "rb", buffering=0)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def send_signal(self, signum: int) -> None:
        # Not reaped by this call (``forward_stop`` runs it while ``wait`` may be in waitpid);
        # until this process reaps the child its pid is its own, exited or not.
        if self.returncode is None:
            os.kill(self.pid, signum)


def _run_agent(torchrun_args: list[str], env: dict[str, str], parent_pid: int, stderr_fd: int) -> NoReturn:
    """The forked child: torchrun's ``main(torchrun_args)`` under ``env``, its stderr (and its
    ranks') on ``stderr_fd``; exits with torchrun's exit code and never returns to the launcher."""
    code = 1
    try:
        os.dup2(stderr_fd, 2)  # inheritable: the ranks write here too
        os.close(stderr_fd)
        # the launcher's SIGTERM handler forwards to its agent: not this process's; then take
        # SIGTERM again (the launcher held it while forking) and die with the launcher
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        die_with_parent(parent_pid)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["torchrun", *torchrun_args]
        from torch.distributed.run import main as torchrun

        torchrun(torchrun_args)
        code = 0
    except SystemExit as e:  # as the interpreter ends on one
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught one
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: the launcher is gone
                pass
        os._exit(code)


def _launch_ranks(torchrun_args: list[str], env: dict[str, str]) -> int:
    """Run torchrun, forwarding its stderr live, and turn a user error raised in a rank during
    training (a reward function that raises, ...) into ONE line and exit code 2.

    The rank records the error line in a temp file (outside the run directory) instead of
    printing it. Everything torchrun and the other ranks print after that (its failure report,
    tracebacks of collectives broken by the failed rank) is a consequence, so it is dropped.
    When torchrun itself fails (no rank recorded anything: a rendezvous that timed out waiting
    for the other nodes, say), its exception is repeated as the last line."""
    with tempfile.TemporaryDirectory(prefix="megatron-grpo-") as tmp:
        error_file = Path(tmp) / "user_error"
        # A SIGTERM for this process goes on to torchrun, which stops its ranks cleanly; the
        # ranks' stderr is this pipe, so dying here would otherwise kill them at their next write.
        stopping: list[int] = []  # the stop signal received, once one was
        started: list[_Agent] = []

        def forward_stop(signum, frame):
            stopping.append(signum)
            if started:
                started[0].send_signal(signal.SIGTERM)

        # SIGTERM is held from before torchrun starts until the handler can reach it: a stop that
        # arrives while it starts (Slurm's preemption during start-up) is forwarded, not fatal
        # to this process alone. The child unblocks it (it inherits the mask, not a pending signal).
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        previous = signal.signal(signal.SIGTERM, forward_stop)
        try:
            try:
                # torchrun dies with this process (a kill -9 of the launcher alone), and its ranks with it.
                started.append(_Agent(torchrun_args, {**env, ERROR_FILE_ENV: str(error_file)}))
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a held stop is forwarded here
            proc = started[0]
            tail = _forward_stderr(proc, error_file, stopping)
            code = proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
        # A rank's own error is the cause; a lost peer (recorded apart) is usually its effect.
        for recorded in (error_file, Path(f"{error_file}{PEER_SUFFIX}")):
            if recorded.exists():
                recorded_code, line = recorded.read_text().strip().split(" ", 1)
                return _fail(line, int(recorded_code))
        if stopping:  # the ranks were killed before they could say where they stopped
            name = stop.signal_name(stopping[0])
            return _fail(f"stopped by {name} before the ranks finished their step and saved (within "
                         "checkpoint.stop_timeout_s); the newest complete checkpoint is kept, and the same "
                         "command resumes from it", stop.exit_code(stopping[0]))
        reason = _launcher_exception(tail) if code != 0 else None
        return _fail(f"torchrun stopped (exit code {code}): {reason}", code) if reason else code


# torchrun's first line when a stop signal reaches it (its elastic agent, logged as a warning).
_TORCHRUN_SIGNALLED = re.compile(rb"[^\n]*Received (\d+) death signal, shutting down workers")


def _read_stderr(proc: _Agent, exited_at: list[float]) -> bytes:
    """The next chunk of ``proc``'s stderr; b"" at its end, or ``DRAIN_S`` after ``proc`` exited
    (``exited_at``: when that was first seen), whatever still holds the pipe open."""
    fd = proc.stderr.fileno()
    while True:
        if not exited_at and proc.poll() is not None:
            exited_at.append(time.monotonic())
        if exited_at and time.monotonic() - exited_at[0] >= DRAIN_S:
            return b""
        if select.select([fd], [], [], POLL_S)[0]:
            return os.read(fd, 65536)


POLL_S = 0.5
"""How often the launcher looks whether torchrun's agent has exited while its stderr is quiet."""
DRAIN_S = 1.0
"""After the agent exited, how long its stderr may stay quiet before the launcher stops reading:
a process a rank left behind (a user's subprocess) may hold the pipe open for ever."""


def _forward_stderr(proc: _Agent, error_file: Path, stopping: list[int], keep_bytes: int = 4096) -> bytes:
    """Copy ``proc``'s stderr to ours until it closes, or ``proc`` has exited (``_read_stderr``),
    except after a rank recorded its error in ``error_file`` or a stop signal came
    (``stopping``: torchrun's shutdown report follows, and the ranks record where they
    stopped); returns the last ``keep_bytes`` of it. A second Ctrl-C leaves at once: this
    process exits and every rank dies with it."""
    out = getattr(sys.stderr, "buffer", None)
    tail = b""
    interrupts = 0  # Ctrl-Cs this process received
    exited_at: list[float] = []
    while True:
        try:
            chunk = _read_stderr(proc, exited_at)
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts > 1:
                raise
            if signal.SIGINT not in stopping:
                stopping.append(signal.SIGINT)  # torchrun got it too and passes it to its ranks
            continue
        if not chunk:
            return tail
        tail = (tail + chunk)[-keep_bytes:]
        signalled = None if stopping else _TORCHRUN_SIGNALLED.search(chunk)
        if signalled and int(signalled.group(1)) in signal.valid_signals():
            # A Ctrl-C reaches torchrun and this process together; torchrun's report of it can
            # be read before this process's KeyboardInterrupt is raised: it is the stop too.
            chunk = chunk[:signalled.start()]
            stopping.append(signal.Signals(int(signalled.group(1))))
        else:
            signalled = None
        if chunk and not error_file.exists() and (signalled or not stopping):
            if out is not None:
                out.write(chunk)
                out.flush()
            else:
                sys.stderr.write(chunk.decode(errors="replace"))


def _launcher_exception(stderr_tail: bytes) -> str | None:
    """``torch.distributed.X: message`` when that ends torchrun's output: its own failure
    (rendezvous, store), not a rank's. A rank's failure ends with torchrun's ChildFailedError
    report, whose rank tracebacks were shown above it."""
    lines = [line.strip() for line in stderr_tail.decode(errors="replace").splitlines() if line.strip()]
    if lines and lines[-1].startswith("torch.distributed.") and "ChildFailedError" not in lines[-1]:
        return lines[-1].removeprefix("torch.distributed.")
    return None


def main(argv: list[str]) -> int:
    """``megatron-grpo train``: pre-flight, then start this machine's ranks (all of them, or
    one node's share of a multi-node run, see ``nodes``)."""
    args = _parse(argv, "megatron-grpo train", launcher=True)
    try:
        node = nodes.from_args(args)
    except nodes.NodeError as e:
        return _fail(str(e))
    if args.nproc is not None and args.nproc < 1:
        return _fail(f"--nproc must be >= 1, got {args.nproc}")
    try:
        cfg = load_experiment(args.config, args.overrides)
        nproc = args.nproc or _ranks_per_node(cfg, node.nnodes)
        cfg = load_experiment(args.config, args.overrides, world_size=nproc * node.nnodes)
        check_run(cfg, nproc)  # on every node: each reads the model and data from its own disk
        # The run directory's lock, before anything is written there (runtime/run_lock.py). This
        # process holds it: it starts before the ranks and ends after them, while rank 0, which
        # writes config.yaml and metrics.jsonl, starts later (the lock must come first) and can
        # die first. Node 0 only: the other nodes of a run write into the same (shared) directory.
        lock = lock_run_dir(cfg.trainer.run_dir) if node.node_rank == 0 else None
    except user_errors() as e:
        return _fail(describe_user_error(e, args.config, _data_file(args.config, args.overrides), args.overrides))
    torchrun_args = [*node.torchrun_args(cfg.parallel.distributed_timeout_s), f"--nproc_per_node={nproc}",
                     "-m", "megatron_grpo.train", "--config", args.config, *args.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "MEGATRON_GRPO_PREFLIGHT_DONE": "1",
           # how long torchrun lets the ranks finish a step and save after a stop signal
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(max(1, round(cfg.checkpoint.stop_timeout_s)))}
    try:
        return _launch_ranks(torchrun_args, env)
    finally:
        if lock is not None:
            lock.release()


def _data_file(config_path: str, overrides: list[str]) -> str | None:
    """``data.train_file`` of a config that may not validate (to recognise dataset errors)."""
    try:
        return load_config(config_path, overrides).data.train_file
    except ConfigError:
        return None


PEER_SUFFIX = ".lost_peer"  # where lost-peer lines are recorded, so a cause on another rank wins


def _report(e: BaseException, rank: int, config_path: str, data_file: str | None,
            code: int = EXIT_USER_ERROR, lost_peer: bool = False) -> int:
    """A rank's one-line error: recorded for ``megatron-grpo train`` (any rank of the node,
    first wins) or printed by the node's first rank under a bare torchrun (each node's log
    says why it stopped: after a node died, global rank 0 may be the one that is gone).
    Every rank exits with ``code`` (2 for user errors, 1 for a run that had to stop:
    non-finite losses, an engine that stays down, a lost node)."""
    line = describe_user_error(e, config_path, data_file) if code == EXIT_USER_ERROR else str(e)
    if os.environ.get(ERROR_FILE_ENV):
        _record_user_error(f"{code} {line}", os.environ[ERROR_FILE_ENV] + (PEER_SUFFIX if lost_peer else ""))
        return code
    return _fail(line, code) if int(os.environ.get("LOCAL_RANK", rank)) == 0 else code


def _lost_peer(rank: int, detail: str, cfg: ExperimentConfig) -> BaseException:
    """The one-line reason a rank stops when another rank of the run is gone (a node died, or
    went silent for longer than parallel.distributed_timeout_s) instead of its traceback."""
    node = os.environ.get("GROUP_RANK", "0")  # torchrun's node rank
    return RunAborted(
        f"rank {rank} on node {node} lost contact with the other ranks: {detail} (a node died, or was silent "
        f"for parallel.distributed_timeout_s={cfg.parallel.distributed_timeout_s:g}); relaunch every node "
        "to resume from the last complete checkpoint")


def rank_main(argv: list[str]) -> int:
    """One rank (under torchrun). User errors end every rank with exit code 2 (see ``_report``)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()  # never outlive torchrun's agent (see runtime/process.py)
    stop.install()  # SIGTERM / Ctrl-C: stop after the step in progress (driver.stop_before)
    quiet_library_warnings()
    args = _parse(argv, "python -m megatron_grpo.train")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    lock = None
    try:
        cfg = load_experiment(args.config, args.overrides, world_size=world)
        if rank == 0 and not os.environ.get("MEGATRON_GRPO_PREFLIGHT_DONE"):
            check_run(cfg)
            # a bare torchrun: no launcher holds the run directory's lock, so rank 0 does (main)
            lock = lock_run_dir(cfg.trainer.run_dir)
    except user_errors() as e:
        return _report(e, rank, args.config, _data_file(args.config, args.overrides))
    stacks.dump_stacks_on_signal(cfg.trainer.run_dir, rank)  # kill -USR1: where a hung rank is
    # Rank 0's rollout servers boot from here, beside the driver's import and the model build
    # (rollout.http_engine.spawn_servers); the trainer adopts them, and stops them at its end.
    spawned = (spawn_servers(cfg.rollout, model_dir=cfg.model.hf_dir, run_dir=cfg.trainer.run_dir)
               if rank == 0 else None)
    try:
        # Deferred, measured (module docstring): the driver's import is most of a rank's
        # start-up, and megatron-core warns at import, so it comes after quiet_library_warnings().
        from megatron_grpo.trainer.driver import train

        parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.trainer.seed,
                            timeout_s=cfg.parallel.distributed_timeout_s, ep=cfg.parallel.ep,
                            vpp=cfg.parallel.vpp, etp=cfg.parallel.etp)
        train(cfg, spawned)
    except user_errors() as e:
        return _report(e, rank, args.config, cfg.data.train_file)
    except RunAborted as e:
        return _report(e, rank, args.config, cfg.data.train_file, code=EXIT_RUN_ABORTED)
    except stop.RunStopped as e:
        return _report(e, rank, args.config, cfg.data.train_file, code=stop.exit_code(e.signum))
    except Exception as e:  # noqa: BLE001 - only a lost peer becomes one line; anything else is a bug
        detail = parallel.peer_failure(e)
        if detail is None:
            raise
        return _report(_lost_peer(rank, detail, cfg), rank, args.config, cfg.data.train_file,
                       code=EXIT_RUN_ABORTED, lost_peer=True)
    finally:
        if spawned is not None:
            spawned.stop()  # a run that failed before the trainer adopted them (idempotent)
        parallel.destroy()
        if lock is not None:
            lock.release()
    return 0
