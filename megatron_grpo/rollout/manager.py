"""Start, watch, restart and stop the rollout server a run uses.

``RolloutServerManager(cfg, model_dir=..., run_dir=...)``:

* ``rollout.urls`` set: nothing is launched; ``start()`` waits (deadline
  ``launch_timeout_s``) until every listed server answers /health;
* otherwise one server is launched from the ``rollout.engine`` registry below
  (``python -m megatron_grpo.rollout.serve`` or ``python -m sglang.launch_server``), bound to
  ``rollout.host`` (loopback by default) with the API key when set (the embedded engine gets it
  through its environment; SGLang only takes ``--api-key``), logging to
  ``<run_dir>/rollout/server.log``; ``start()`` returns once it is healthy or raises with the
  log's last lines;
* ``ensure_alive()`` notices a dead server and restarts it on the same port (at most
  ``rollout.max_restarts`` times). A restarted server serves the checkpoint's weights again:
  the caller must sync its weights (``ensure_alive`` returns True then);
* ``stop()`` terminates only the process group the manager created (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from megatron_grpo.rollout.serve import API_KEY_ENV
from megatron_grpo.runtime.process import die_with_parent, free_port  # noqa: F401 - free_port re-exported

import httpx

from megatron_grpo.rollout.types import RolloutError

log = logging.getLogger(__name__)


def _embedded_command(cfg, model_dir: str, host: str, port: int) -> list[str]:
    # The API key reaches the embedded engine through its environment (API_KEY_ENV), not its
    # command line, where every local user could read it in `ps`.
    return [sys.executable, "-m", "megatron_grpo.rollout.serve", "--model-dir", model_dir, "--host", host,
            "--port", str(port), "--dtype", cfg.dtype, "--max-batch-size", str(cfg.embedded_max_batch_size)]


def _sglang_command(cfg, model_dir: str, host: str, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", host,
           "--port", str(port), "--tp-size", str(cfg.sglang_tp),
           "--mem-fraction-static", str(cfg.sglang_mem_fraction_static), "--dtype", cfg.dtype]
    return cmd + (["--api-key", cfg.api_key] if cfg.api_key else []) + list(cfg.sglang_extra_args)


# rollout.engine -> command line of a server for (cfg, model_dir, host, port)
LAUNCHERS: dict[str, Callable[..., list[str]]] = {
    "embedded": _embedded_command,
    "sglang": _sglang_command,
}


def wait_healthy(url: str, deadline: float, *, alive: Callable[[], bool] = lambda: True,
                 describe: Callable[[], str] = lambda: "") -> None:
    """Poll ``url``/health until it answers 200; RolloutError at ``deadline`` or if ``alive()`` turns False."""
    last = "no answer yet"
    while True:
        if not alive():
            raise RolloutError(url, "launch", f"the server process exited before it was healthy{describe()}")
        try:
            r = httpx.get(url + "/health", timeout=5.0)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        if time.monotonic() >= deadline:
            raise RolloutError(url, "GET /health", f"not healthy before the deadline ({last}){describe()}")
        time.sleep(0.5)


class RolloutServerManager:
    """Owns the rollout server of a run (see the module docstring)."""

    def __init__(self, cfg, *, model_dir: str, run_dir: str | Path):
        self.cfg = cfg
        self.model_dir = str(model_dir)
        self.log_path = Path(run_dir) / "rollout" / "server.log"
        self.restarts = 0
        self._proc: Optional[subprocess.Popen] = None
        self._port: Optional[int] = None
        if not cfg.urls and cfg.engine not in LAUNCHERS:
            raise ValueError(f"rollout.engine: unknown engine {cfg.engine!r}; expected one of {sorted(LAUNCHERS)}")

    @property
    def launched(self) -> bool:
        return not self.cfg.urls

    @property
    def urls(self) -> list[str]:
        if not self.launched:
            return [u.rstrip("/") for u in self.cfg.urls]
        if self._port is None:
            raise RuntimeError("the rollout server is not started")
        host = "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::") else self.cfg.host
        return [f"http://{host}:{self._port}"]

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> list[str]:
        """Launch (or wait for the external) server(s) until healthy; returns their URLs."""
        deadline = time.monotonic() + self.cfg.launch_timeout_s
        if not self.launched:
            for url in self.urls:
                wait_healthy(url, deadline)
            return self.urls
        self._port = self.cfg.port or free_port(self.cfg.host)
        self._launch(deadline)
        return self.urls

    def _launch(self, deadline: float) -> None:
        cmd = LAUNCHERS[self.cfg.engine](self.cfg, self.model_dir, self.cfg.host, self._port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} launch: {_redact(cmd)}\n".encode())
            logf.flush()
            # A new session makes the server (and anything it forks) one process group that
            # stop() can signal without touching any other process on the machine.
            env = dict(os.environ)
            if self.cfg.api_key and self.cfg.engine == "embedded":
                env[API_KEY_ENV] = self.cfg.api_key
            self._proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          start_new_session=True, preexec_fn=die_with_parent, env=env)
        log.info("rollout server pid %d: %s (log %s)", self._proc.pid, self.urls[0], self.log_path)
        try:
            wait_healthy(self.urls[0], deadline, alive=self.alive, describe=self._log_tail)
        except RolloutError:
            self.stop()
            raise

    def alive(self) -> bool:
        """True while the launched process runs (always True for external servers)."""
        return not self.launched or (self._proc is not None and self._proc.poll() is None)

    def ensure_alive(self) -> bool:
        """Restart a launched server that died; returns True if it did (weights must be re-synced)."""
        if self.alive():
            return False
        code = self._proc.returncode if self._proc is not None else None
        if self.restarts >= self.cfg.max_restarts:
            raise RolloutError(self.urls[0], "launch", f"the server died (exit code {code}) and "
                               f"rollout.max_restarts={self.cfg.max_restarts} restarts are used up{self._log_tail()}")
        self.restarts += 1
        log.warning("rollout server died (exit code %s); restart %d of %d", code, self.restarts, self.cfg.max_restarts)
        self._launch(time.monotonic() + self.cfg.launch_timeout_s)
        return True

    def stop(self, timeout_s: float = 15.0) -> None:
        """Terminate the launched server's process group (idempotent; external servers untouched)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
        else:
            _signal_group(proc.pid, signal.SIGKILL)  # children it may have left behind

    def _log_tail(self, num_lines: int = 5) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()[-num_lines:]
        except OSError:
            return ""
        return f"; log {self.log_path} ends: " + " | ".join(line.strip() for line in lines)

    def __enter__(self) -> "RolloutServerManager":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


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
