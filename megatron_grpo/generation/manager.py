"""Start, watch, restart and stop the rollout servers a run uses.

``RolloutServerManager(cfg, model_dir=..., run_dir=...)``:

* ``engine.urls`` set: nothing is launched; ``start()`` waits (deadline
  ``launch_timeout_s``) until every listed server answers /health, then checks that each is of
  the kind ``engine.kind`` names;
* otherwise ``engine.num_servers`` servers are launched with the command and environment of
  the engine's adapter (``generation/adapters``), on the GPUs ``runtime.placement`` assigns them
  (with CUDA), bound to ``engine.host`` (loopback by default),
  each logging to ``<run_dir>/rollout/server_<i>.log``; ``start()`` returns once all are
  healthy or raises with the failing log's last lines;
* ``ensure_alive()`` notices dead servers and restarts them on their ports (at most
  ``engine.max_restarts`` restarts in all). A restarted server serves the checkpoint's
  weights again: the caller must sync its weights (``ensure_alive`` returns True then);
* ``stop()`` terminates only the process groups the manager created (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import httpx

from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.generation.adapters import ENGINES, EngineKindMismatch
from megatron_grpo.wire.samples import RolloutError
from megatron_grpo.runtime.device import cuda_available
from megatron_grpo.runtime.placement import engine_gpu_ids, ranks_on_this_node
from megatron_grpo.runtime import stop
from megatron_grpo.runtime.process import die_with_parent, free_port  # noqa: F401 - free_port re-exported

log = logging.getLogger(__name__)

WEIGHT_SYNC_SUBDIR = "weight_sync"


def weight_sync_dir(run_dir: str | Path) -> Path:
    """Where the disk transport writes a run's weights for the engines: a launched engine loads
    from this directory and the model directory only (``--trusted-weight-dir``)."""
    return Path(run_dir) / WEIGHT_SYNC_SUBDIR


def wait_healthy(url: str, deadline: float, *, alive: Callable[[], bool] = lambda: True,
                 describe: Callable[[], str] = lambda: "") -> None:
    """Poll ``url``/health until it answers 200; RolloutError at ``deadline`` or if ``alive()`` turns
    False; ``stop.RunStopped`` once this process received a stop signal (a preemption during
    start-up stops the run now, not after the launch timeout)."""
    last = "no answer yet"
    # One client for the whole wait: a fresh one per poll (httpx.get) builds an SSL context,
    # ~56 ms of CPU, so 10 polls a second took a third of a core from the server starting beside
    # it (3.1 s of CPU per 10 s of waiting; 0.2 s through one client).
    with httpx.Client(timeout=5.0) as client:
        while True:
            signum = stop.received()
            if signum:
                raise stop.RunStopped(f"stopped by {stop.signal_name(signum)} while the rollout server at {url} was "
                                      "starting: no step had run and nothing was saved; the same command starts the "
                                      "run again", signum)
            if not alive():
                raise RolloutError(url, "launch", f"the server process exited before it was healthy{describe()}")
            try:
                r = client.get(url + "/health")
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = type(e).__name__
            if time.monotonic() >= deadline:
                raise RolloutError(url, "GET /health", f"not healthy before the deadline ({last}){describe()}")
            time.sleep(0.1)  # a refused connection costs nothing; every run waits for its start


# What uvicorn (ours and SGLang's) prints when the port is taken.
_PORT_TAKEN = ("address already in use", "[Errno 98]")
# Launches of one server on fresh ports before its start fails: ports we pick are free when
# picked, but any process on the machine (a test's other run, torchrun's rendezvous) can bind
# one before the server does (seen once in CI); a configured engine.port is never moved.
_PORT_TRIES = 3


@dataclass
class _Server:
    """One launched server: its port, log and (while running) process."""

    port: int
    log_path: Path
    proc: Optional[subprocess.Popen] = None
    log_offset: int = 0  # where this launch's lines start in the (appended) log

    def lost_its_port(self) -> bool:
        """True when this launch exited because another process bound its port first."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return False
        return any(sign in text for sign in _PORT_TAKEN)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class RolloutServerManager:
    """Owns the rollout servers of a run (see the module docstring)."""

    def __init__(self, cfg: ExperimentConfig, *, model_dir: str, run_dir: str | Path,
                 ranks_on_node: Optional[int] = None):
        """``cfg``: the run's config; its ``engine:`` section says what to launch or reach (a
        launch command also reads the weight sync's and the sampling's keys it must know)."""
        self.cfg = cfg
        self.engine_cfg = cfg.engine
        self.adapter = ENGINES[cfg.engine.kind]
        # GPUs of each launched server (None without CUDA): runtime.placement's layout
        ranks = ranks_on_this_node() if ranks_on_node is None else ranks_on_node
        self.gpu_ids = (engine_gpu_ids(cfg.engine, cfg.sync, ranks, self.adapter.gpus_per_server(cfg.engine))
                        if cuda_available() else None)
        self.model_dir = str(model_dir)
        self.run_dir = Path(run_dir)
        self.restarts = 0
        self._servers: list[_Server] = []
        self._spawned_at = 0.0

    @property
    def launched(self) -> bool:
        return not self.engine_cfg.urls

    @property
    def log_path(self) -> Path:
        """The first launched server's log."""
        return self._log_path(0)

    def _log_path(self, index: int) -> Path:
        return self.run_dir / "rollout" / ("server.log" if index == 0 else f"server_{index}.log")

    @property
    def urls(self) -> list[str]:
        if not self.launched:
            return [u.rstrip("/") for u in self.engine_cfg.urls]
        if not self._servers:
            raise RuntimeError("the rollout servers are not started")
        host = "127.0.0.1" if self.engine_cfg.host in ("0.0.0.0", "::") else self.engine_cfg.host
        return [f"http://{host}:{s.port}" for s in self._servers]

    @property
    def pids(self) -> list[int]:
        return [s.proc.pid for s in self._servers if s.proc is not None]

    @property
    def pid(self) -> Optional[int]:
        """The first launched server's pid."""
        return self.pids[0] if self.pids else None

    def start(self) -> list[str]:
        """Launch (or wait for the external) servers until healthy; returns their URLs. After
        ``spawn`` it only waits, with the deadline counted from the spawn."""
        if not self.launched:
            deadline = time.monotonic() + self.engine_cfg.launch_timeout_s
            for url in self.urls:
                wait_healthy(url, deadline)
                self._check_kind(url)
            return self.urls
        if not self._servers:
            self.spawn()
        try:
            for server in self._servers:
                self._wait_or_move(server, self._spawned_at + self.engine_cfg.launch_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.urls

    def _wait_or_move(self, server: _Server, deadline: float) -> None:
        """Wait for ``server``; if it exited because its (picked) port was taken, launch it
        again on another free port, up to ``_PORT_TRIES`` launches, within the same deadline."""
        for attempt in range(1, _PORT_TRIES + 1):
            try:
                self._wait(server, deadline)
                return
            except RolloutError:
                if (attempt == _PORT_TRIES or self.engine_cfg.port or server.alive()
                        or not server.lost_its_port()):
                    raise
            taken = server.port
            server.port = self._new_port()
            log.warning("rollout server port %d was taken before the server bound it; launching it on port %d",
                        taken, server.port)
            self._spawn(server)

    def _new_port(self) -> int:
        """A free port that no server of this manager has."""
        used = {s.port for s in self._servers}
        port = free_port(self.engine_cfg.host)
        while port in used:
            port = free_port(self.engine_cfg.host)
        return port

    def spawn(self) -> None:
        """Start every launched server's process and return at once (``start`` waits for
        them). All start together, so their health waits overlap; the trainer's rank 0 calls
        this first thing, so that the servers boot while the ranks import and build."""
        ports: list[int] = []
        for i in range(self.engine_cfg.num_servers):
            port = (self.engine_cfg.port + i) if self.engine_cfg.port else free_port(self.engine_cfg.host)
            while port in ports:  # free_port may hand out a port twice before either is bound
                port = free_port(self.engine_cfg.host)
            ports.append(port)
        self._servers = [_Server(port, self._log_path(i)) for i, port in enumerate(ports)]
        self._spawned_at = time.monotonic()
        try:
            for server in self._servers:
                self._spawn(server)
        except BaseException:
            self.stop()
            raise

    def _check_kind(self, url: str) -> None:
        try:
            api_key = self.engine_cfg.api_key
            info = httpx.get(url + "/get_server_info", timeout=10.0,
                             headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
            info.raise_for_status()
            self.adapter.check_server(url, info.json())
        except EngineKindMismatch as e:
            raise RolloutError(url, "GET /get_server_info", str(e)) from None
        except (httpx.HTTPError, ValueError) as e:
            raise RolloutError(url, "GET /get_server_info", f"{type(e).__name__}: {e}") from None

    def _spawn(self, server: _Server) -> None:
        try:
            index = self._servers.index(server)
            cmd = self.adapter.launch_command(self.cfg, self.model_dir, self.engine_cfg.host, server.port,
                                              self.gpu_ids[index] if self.gpu_ids else None,
                                              trusted_weight_dirs=[str(weight_sync_dir(self.run_dir))])
        except RuntimeError as e:  # e.g. no SGLang environment on this machine
            raise RolloutError(f"{self.engine_cfg.kind} server", "launch", str(e)) from None
        server.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(server.log_path, "ab") as logf:
            server.log_offset = logf.tell()
            logf.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} launch: {_redact(cmd)}\n".encode())
            logf.flush()
            # A new session makes the server (and anything it forks) one process group that
            # stop() can signal without touching any other process on the machine.
            server.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True, preexec_fn=die_with_parent,
                                           env=self.adapter.launch_env(self.engine_cfg, dict(os.environ)))
        log.info("rollout server pid %d: port %d (log %s)", server.proc.pid, server.port, server.log_path)

    def _wait(self, server: _Server, deadline: float) -> None:
        url = self.urls[self._servers.index(server)]
        wait_healthy(url, deadline, alive=server.alive, describe=lambda: _log_tail(server.log_path))

    def alive(self) -> bool:
        """True while every launched process runs (always True for external servers)."""
        return not self.launched or (bool(self._servers) and all(s.alive() for s in self._servers))

    def ensure_alive(self) -> bool:
        """Restart launched servers that died; returns True if any did (weights must be re-synced)."""
        dead = [s for s in self._servers if not s.alive()] if self.launched else []
        for server in dead:
            code = server.proc.returncode if server.proc is not None else None
            url = self.urls[self._servers.index(server)]
            if self.restarts >= self.engine_cfg.max_restarts:
                raise RolloutError(url, "launch", f"the server died (exit code {code}) and "
                                   f"engine.max_restarts={self.engine_cfg.max_restarts} restarts are used up"
                                   f"{_log_tail(server.log_path)}")
            self.restarts += 1
            log.warning("rollout server %s died (exit code %s); restart %d of %d", url, code, self.restarts,
                        self.engine_cfg.max_restarts)
            _stop_process(server.proc)  # children it may have left behind
            self._spawn(server)
            try:
                self._wait(server, time.monotonic() + self.engine_cfg.launch_timeout_s)
            except RolloutError:
                _stop_process(server.proc)
                raise
        return bool(dead)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Terminate the launched servers' process groups (idempotent; external servers untouched)."""
        for server in self._servers:
            proc, server.proc = server.proc, None
            _stop_process(proc, timeout_s)

    def __enter__(self) -> "RolloutServerManager":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_process(proc: Optional[subprocess.Popen], timeout_s: float = 15.0) -> None:
    """SIGTERM the process group of ``proc`` (SIGKILL after ``timeout_s``); SIGKILL leftovers."""
    if proc is None:
        return
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)
    # Children the server left behind (SGLang's scheduler and detokenizer outlive its main
    # process by seconds while it writes crash diagnostics) go with the group.
    _signal_group(proc.pid, signal.SIGKILL)


def _log_tail(path: Path, num_lines: int = 5) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()[-num_lines:]
    except OSError:
        return ""
    return f"; log {path} ends: " + " | ".join(line.strip() for line in lines)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _redact(cmd: list[str]) -> str:
    """The command line with the API key hidden (logs are shared more widely than configs)."""
    out = list(cmd)
    for i, arg in enumerate(out[:-1]):
        if arg == "--api-key":
            out[i + 1] = "***"
    return " ".join(out)
