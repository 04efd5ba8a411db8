"""OpenEnv environments in the episode loop: ``openenv:path/to/app.py:app`` (the FastAPI app an
OpenEnv environment's ``server/app.py`` builds with ``create_app``) or ``openenv:http://host:port``
(a server you run yourself). docs/multi_turn.md has the whole of it.

**The server.** One per run, shared by every episode, owned by the fork server (``worker.py``):
started for the first episode's request (``prepare``; the run's pre-flight is that request, and
the launcher's check starts and stops one, so a server that cannot start is refused before the
run directory is written), forked from the fork server after OpenEnv's client is imported there
(the server then costs only its app's imports), served by uvicorn on a free loopback port. It
ends with the fork server (its own session, killed with the workers' groups; a parent-death
signal). Every wait has a deadline (``START_TIMEOUT_S``, ``PROBE_TIMEOUT_S``, the client's
timeouts, ``episodes.timeout_s`` over each call); a dead server is restarted at most
``MAX_RESTARTS`` times a run, the episodes it took counted as failures.

**An episode.** A session through OpenEnv's own client (``GenericEnvClient(...).sync()``):
``reset(**row)`` with the row's fields but ``prompt``, then one ``step`` per model turn with the
action's one string field set to the turn's text; the observation's one string field (else the
observation as JSON) is the observation text; ``reward`` (None: 0) and ``done`` are the step's.

Departures from OpenEnv's own use (TRL's wrappers, its examples):

* ``reset``'s observation is not shown to the model: the prompt is the dataset row's;
* the app is served unchanged, so its ``max_concurrent_envs`` must be at least the episodes in
  flight (a session refused for capacity is a counted failure that says so);
* Docker images and Hugging Face Spaces are not used (offline); the app runs from its package.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_grpo.config.connectors import AGENTS_EXTRA, FILE_TARGET_RE
from megatron_grpo.rollout.episodes.environment.loading import ContractViolation, describe
from megatron_grpo.runtime.errors import one_line

START_TIMEOUT_S = 120.0
"""Deadline for a forked server to serve (its app's own imports). With the client's import
before it, within ``worker.PREPARE_TIMEOUT_S``."""
PROBE_TIMEOUT_S = 5.0
"""Deadline of one HTTP request to a server (its health, its schema)."""
MAX_RESTARTS = 3
"""Restarts of a run's server after it died; past them, episodes stop the run with one line."""
CONNECT_TIMEOUT_S = 10.0
MESSAGE_TIMEOUT_S = 60.0
"""The client's deadlines (its own defaults); each call also has the worker's episodes.timeout_s."""
PROCESS_NAME = "openenv-server"
"""The server process's name (``/proc/<pid>/comm``; it is a fork of the fork server, same command line)."""
IGNORED_ACTION_FIELDS = ("metadata",)
IGNORED_OBSERVATION_FIELDS = ("done", "reward", "metadata")


@dataclass
class Server:
    """A run's server of one target (``pid`` None: one you run yourself)."""

    url: str
    action_field: str
    observation_field: Optional[str]
    pid: Optional[int] = None
    started: Optional[str] = None
    """The process's start time (``/proc/<pid>/stat``), so that a reused pid is not taken for it."""
    restarts: int = 0

    def alive(self) -> bool:
        return self.pid is None or _start_time(self.pid) == self.started


_servers: dict[str, Server] = {}
"""target -> its server, in the fork server; its workers inherit a copy when forked."""
_failures: dict[str, str] = {}
"""target -> why its server is not there (one line), likewise."""


# ---- schema -> what the model's text fills, what the model sees ---------------------------------

def string_fields(schema: dict, ignored: tuple[str, ...]) -> list[str]:
    """Names of the ``type: string`` properties of a JSON schema (pydantic's ``model_json_schema``)."""
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    return [name for name, p in props.items() if name not in ignored and isinstance(p, dict)
            and p.get("type") == "string"]


def action_field(schema: dict) -> str:
    """The action's one string field, which a model turn's text fills; ValueError otherwise."""
    fields = string_fields(schema, IGNORED_ACTION_FIELDS)
    if len(fields) != 1:
        props = [p for p in (schema.get("properties") or {}) if p not in IGNORED_ACTION_FIELDS]
        raise ValueError(f"its action has {len(fields)} string fields ({', '.join(props) or 'none'}); a model turn's "
                         "text can fill an action with exactly one string field")
    return fields[0]


def observation_field(schema: dict) -> Optional[str]:
    """The observation's one string field (its text for the model), or None: the whole
    observation, as JSON, is the text."""
    fields = string_fields(schema, IGNORED_OBSERVATION_FIELDS)
    return fields[0] if len(fields) == 1 else None


def observation_text(observation: Any, field: Optional[str]) -> str:
    """What the model sees of a step's observation (a dict: the Observation's fields but done,
    reward, metadata), by ``observation_field``'s rule."""
    if field is not None and isinstance(observation, dict):
        value = observation.get(field)
        return "" if value is None else str(value)
    return json.dumps(observation, sort_keys=True, ensure_ascii=False, default=str)


def step_answer(result: Any, field: Optional[str]) -> dict:
    """The client's ``StepResult(observation, reward, done)`` as the loop's answer."""
    done = bool(result.done)
    reward = result.reward
    try:
        reward = 0.0 if reward is None else float(reward)
    except (TypeError, ValueError):
        raise ContractViolation(f"the server's step returned reward={str(reward)[:40]!r}; expected a number") from None
    return {"observation": None if done else observation_text(result.observation, field), "done": done,
            "reward": reward}


def reset_kwargs(row: dict) -> dict:
    """``reset``'s keyword arguments: the row's fields but ``prompt`` (TRL's convention)."""
    return {k: v for k, v in row.items() if k != "prompt"}


# ---- the server (in the fork server) -------------------------------------------------------------

def _get_json(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:  # loopback or the user's own server
        return json.loads(r.read())


def _wait_serving(url: str, deadline: float, alive: Callable[[], bool]) -> None:
    """Return once the server at ``url`` answers /health; RuntimeError past ``deadline`` (one
    try when it has passed already) or once ``alive()`` is false."""
    while True:
        try:
            _get_json(f"{url}/health", PROBE_TIMEOUT_S)
            return
        except (OSError, ValueError) as e:
            if not alive():
                raise RuntimeError("exited while starting") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"did not answer {url}/health ({one_line(e)})") from None
            time.sleep(0.1)


def _fields(url: str) -> tuple[str, Optional[str]]:
    """(``action_field``, ``observation_field``) of the server's ``/schema``; ValueError (one line)
    for an action the model's text cannot fill."""
    schema = _get_json(f"{url}/schema", PROBE_TIMEOUT_S)
    return action_field(schema.get("action", {})), observation_field(schema.get("observation", {}))


def _start(target: str, workdir: str) -> tuple[str, int, str]:
    """Fork ``target``'s server from this process (the fork server, OpenEnv's modules loaded) and
    wait, bounded, until it serves: (its URL, its pid, its start time). RuntimeError (one line,
    with the last line the server wrote) if it does not."""
    m = FILE_TARGET_RE.match(target)
    path = Path(m["path"]).expanduser().resolve()
    run_dir = tempfile.mkdtemp(prefix="openenv-", dir=workdir)
    port_file, log_file = os.path.join(run_dir, "port"), os.path.join(run_dir, "server.log")
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the server: it never returns into the fork server's code
        try:
            _serve(path, m["attr"], port_file, log_file, parent)
        finally:
            os._exit(1)
    started = _start_time(pid)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(port_file):
            if _start_time(pid) != started:
                raise RuntimeError("exited while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"did not listen within {START_TIMEOUT_S:g}s")
            time.sleep(0.02)
        url = f"http://127.0.0.1:{int(Path(port_file).read_text())}"
        _wait_serving(url, deadline, lambda: _start_time(pid) == started)
    except Exception as e:
        _kill(pid)
        raise RuntimeError(f"its server {one_line(e).removeprefix('RuntimeError: ')}{_last_line(log_file)}") from None
    return url, pid, started


def _start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (field 22 of ``/proc/<pid>/stat``); None when it is gone.
    The fork server ignores SIGCHLD, so a dead child is reaped at once and leaves no zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _last_line(log_file: str) -> str:
    """``: <the last line the server wrote>`` (its error), or nothing."""
    try:
        lines = [ln.strip() for ln in Path(log_file).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return f": {lines[-1][:300]}" if lines else ""


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # its group: the server leads one (os.setsid)
    except (ProcessLookupError, PermissionError):
        pass


def _preload_client() -> None:
    try:
        importlib.import_module("openenv.core.generic_client")
    except Exception:  # noqa: BLE001 (the worker's import reports it, in one line)
        pass


def prepare(target: str, workdir: str) -> None:
    """In the fork server, before it forks an episode's worker: make sure ``target``'s server
    serves (start it, or restart a dead one) and the client library is loaded. A failure is
    kept in ``_failures`` and raised by ``environment_class`` in the workers."""
    server = _servers.get(target)
    if server is not None and server.alive():
        return
    if target in _failures:
        return
    restarts = 0
    if server is not None:  # its process died: the episodes it served have failed (counted)
        restarts = server.restarts + 1
        del _servers[target]
        if restarts > MAX_RESTARTS:
            _failures[target] = f"its server died {restarts} times; not restarted again"
            return
        print(f"[megatron-grpo] episodes.environment openenv:{describe(target)}: its server (pid {server.pid}) "
              f"died; restarting it ({restarts} of at most {MAX_RESTARTS})", file=sys.stderr, flush=True)
    _preload_client()  # before the fork: the server (and every worker) inherits OpenEnv's modules
    pid = started = None
    try:
        if FILE_TARGET_RE.match(target):
            url, pid, started = _start(target, workdir)
        else:  # a server you run: up before the run starts, so one try
            url = target.rstrip("/")
            try:
                _wait_serving(url, time.monotonic(), lambda: True)
            except RuntimeError as e:
                raise RuntimeError(f"no OpenEnv server answers: {e}") from None
        server = Server(url, *_fields(url), pid=pid, started=started, restarts=restarts)
    except Exception as e:  # noqa: BLE001 (kept, and raised in one line by every worker)
        if pid is not None:
            _kill(pid)
        _failures[target] = one_line(e).removeprefix("RuntimeError: ").removeprefix("ValueError: ")
        return
    _servers[target] = server
    if server.pid is not None:
        print(f"[megatron-grpo] episodes.environment openenv:{describe(target)}: its server (pid {server.pid}) "
              f"serves on {server.url}", file=sys.stderr, flush=True)


def environment_class(target: str) -> type:
    """The adapter class for ``target``; ValueError (one line) when its server could not be
    started (a worker forked after ``prepare``). A class is returned before any server exists
    too (a check without ``prepare``)."""
    where = f"openenv:{describe(target)}"
    if not (FILE_TARGET_RE.match(target) or target.startswith(("http://", "https://"))):
        raise ValueError(f"episodes.environment {where}: expected openenv:path/to/app.py:app or openenv:http://host:port")
    if target in _failures:
        raise ValueError(f"episodes.environment {where}: {_failures[target]}")
    return type("OpenEnvEnvironment", (OpenEnvAdapter,), {"target": target, "where": where})


# ---- an episode (in its worker) -------------------------------------------------------------------

class OpenEnvAdapter:
    """One OpenEnv session for one episode (the class ``environment_class`` returns binds
    ``target``)."""

    target: str
    where: str

    def __init__(self, row: dict):
        server = _servers.get(self.target)
        if server is None:
            raise ContractViolation("its server was not started (the fork server prepares it before an episode)")
        try:
            from openenv.core.generic_client import GenericEnvClient  # preloaded by the fork server
        except ImportError as e:
            raise ContractViolation(f"needs the openenv-core library ({one_line(e)}): {AGENTS_EXTRA}") from None
        self.server = server
        self.client = GenericEnvClient(base_url=server.url, connect_timeout_s=CONNECT_TIMEOUT_S,
                                       message_timeout_s=MESSAGE_TIMEOUT_S).sync()
        self._call(self.client.connect)
        self._call(self.client.reset, **reset_kwargs(row))

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if "CAPACITY_REACHED" in str(e):
                raise RuntimeError(f"{e}: the app's create_app(max_concurrent_envs=...) must be at least "
                                   "rollout.max_inflight_requests (episodes in flight)") from None
            raise

    def step(self, response: str) -> dict:
        result = self._call(self.client.step, {self.server.action_field: response})
        return step_answer(result, self.server.observation_field)


# ---- the server process -----------------------------------------------------------------------

def module_of(path: Path) -> tuple[Path, str]:
    """(the folder to put on ``sys.path``, the dotted module name) of a Python file, as ``python
    -m`` imports it: named inside the packages (folders with ``__init__.py``) that contain it,
    so that an OpenEnv app's relative imports (``from ..models import ...``) work."""
    parts, folder = [path.stem], path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return folder, ".".join(parts)


def _serve(path: Path, attr: str, port_file: str, log_file: str, parent: int) -> None:
    """The server, in a child forked from the fork server: a session of its own (the fork server
    kills it with its workers' groups), dead with the fork server (parent-death signal), every
    inherited descriptor closed (a copy of a worker's connection would hide that worker's death
    from the trainer), the app imported as ``python -m`` would; serves on a free port of
    127.0.0.1, whose number it writes to ``port_file``."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(15, PROCESS_NAME.encode(), 0, 0, 0)  # PR_SET_NAME: what ps shows
    except (OSError, AttributeError):
        pass  # not Linux: it is still killed with the fork server's workers
    if os.getppid() != parent:  # the fork server exited before the signal was armed
        return
    # the objects owning the closed descriptors stay referenced by the fork server's frames
    # (suspended in this process, never returned to), so none is closed again on a reused number
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    null, log = os.open(os.devnull, os.O_RDONLY), os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    try:
        root, name = module_of(path)
        sys.path.insert(0, str(root))
        app = getattr(importlib.import_module(name), attr, None)
        if app is None:
            raise AttributeError(f"{path} has no attribute {attr!r}")
        import uvicorn  # openenv-core's dependency

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        tmp = port_file + ".tmp"
        Path(tmp).write_text(str(sock.getsockname()[1]))
        os.replace(tmp, port_file)  # whole, or not there
        uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    except BaseException as e:  # noqa: BLE001 (the fork server reads this line as the reason)
        print(one_line(e), file=sys.stderr, flush=True)
    os._exit(0)
