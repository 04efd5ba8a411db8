"""Run a function on N gloo ranks: the harness behind every TP/PP test and benchmark.

``run_distributed(fn, world_size, *args, tp=..., pp=..., ep=..., vpp=..., etp=..., cp=...)`` spawns ``world_size`` fresh
processes (``spawn`` start method, so no state leaks from the parent), points them at a
free loopback port, initialises torch.distributed (+ megatron parallel state when ``tp``,
``pp`` or ``ep`` is given) and calls ``fn(rank, world_size, *args)`` in each. It returns the list of
per-rank return values (picklable), and raises ``RankFailure`` carrying the traceback of
every failed rank, or ``TimeoutError`` if any rank runs past ``timeout_s`` (all ranks are
then killed: no test hangs).

``fn`` must be importable by name (a module-level function), as with any spawn.

Results cross the process boundary as plain ``pickle`` bytes. A multiprocessing queue would
pickle tensors with torch's ``ForkingPickler``, which sends a handle to the worker's shared
memory instead of the data; a worker that has already exited when the parent unpickles (usual
on a loaded machine) leaves the parent with ``FileNotFoundError`` on a vanished socket.
Plain pickle copies tensor data into the bytes, so nothing depends on the worker being alive.

**The rank pool** (``MEGATRON_GRPO_RANK_POOL=1``, which the test suite sets): the ranks are
kept between calls, so a test pays a rank's start-up (a fresh interpreter importing torch,
megatron-core and this package: ~5 s of CPU each on 2 busy cores, most of a small test's time)
once per pool instead of once per call (tests/conftest.py closes a module's pools when the
module ends). A pool's ranks are forked from multiprocessing's forkserver, which imported those
once, so a new pool starts in ~0.05 s of CPU per rank. There is one pool per world size and
environment, and its ranks run under the caller's environment; a call whose environment differs
from this module's import-time one in a variable torch, triton or megatron-core read at import
(a test's ``monkeypatch.setenv("TRITON_INTERPRET", "1")``) gets ranks spawned under it, as a
fresh spawn would. Each call
still gets a new port, a new process group and megatron parallel state, the same seeds, and
afterwards the rank puts back what a call may change process-wide (environment variables,
default dtype, grad mode, megatron's cached checkpoint-writer queue: ``_FRESH_STATE``). A call that fails or runs past its deadline ends the whole pool (the next call
starts fresh ranks), so a broken state never reaches another test. ``fresh=True`` forces new
processes for a function that must see a first import (tools' benchmarks never use the pool).
A pool's ranks exit when the process that made the pool does (they watch its pid). A call
whose ranks fail in a pool (not one that times out) is run once more in fresh processes, and their outcome is the
call's: a state that leaked from an earlier call, which no test is meant to see, then shows as
a ``RankPoolWarning`` (with the pooled traceback) instead of a failure that a fresh process
would not have had. (Seen once in CI, not reproduced: a 2-rank attention check failed in a pool.)
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Optional

import psutil

from megatron_grpo.runtime import cpu_shim, parallel
from megatron_grpo.runtime.process import alive, free_port  # noqa: F401 - free_port re-exported for tests


class RankFailure(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""

POOL_ENV = "MEGATRON_GRPO_RANK_POOL"
_PARENT_POLL_S = 1.0


def _worker(fn, rank, world_size, port, tp, pp, ep, vpp, etp, cp, seed, args, kwargs, results):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        if tp is not None or pp is not None or ep is not None or cp is not None:
            parallel.initialize(tp or 1, pp or 1, seed=seed, ep=ep or 1, vpp=vpp, etp=etp, cp=cp or 1)
        else:
            import torch.distributed as dist

            cpu_shim.install()
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args, **kwargs)
        results.put((rank, True, pickle.dumps(out)))  # bytes: see the module docstring
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            parallel.destroy()
        except Exception:  # noqa: BLE001
            pass


_FRESH_STATE = (
    # megatron's checkpoint writer caches a multiprocessing Manager's queue (its server is a
    # child process) for the process's life. Seen once in the suite: a later job's checkpoint
    # save in the same rank found that server gone (EOFError on the queue; which earlier job
    # ended it is not known). A fresh process would build a new one: so does each job.
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "_results_queue", None),
)
"""(module, attribute, value): process-wide caches a pool rank puts back after each job, as a
fresh process would have them (only for modules a job imported)."""


def _pooled_worker(rank: int, world_size: int, jobs, results, owner_pid: int, caller_env: dict) -> None:
    """A pool rank: run jobs (pickled ``(fn, port, tp, pp, ep, vpp, etp, cp, seed, args, kwargs)``)
    until it gets None or the pool's owner is gone. Each job runs exactly as ``_worker`` runs it
    in a fresh process, then what a job may change process-wide is put back."""
    import torch

    os.environ.clear()  # the caller's, as a spawned rank's (a forked one has the forkserver's)
    os.environ.update(caller_env)
    environ = dict(os.environ)
    # The pool's owner, not the parent: a forked rank's parent is the forkserver, which lives
    # as long as any process it forked does (each holds its keep-alive pipe).
    try:
        owner = psutil.Process(owner_pid)
    except psutil.NoSuchProcess:  # the owner died while this rank started
        return
    while True:
        try:
            job = jobs.get(timeout=_PARENT_POLL_S)
        except queue.Empty:
            if not alive(owner):  # the owner died (kill -9): nobody will send None
                return
            continue
        if job is None:
            return
        fn, port, tp, pp, ep, vpp, etp, cp, seed, args, kwargs = pickle.loads(job)
        try:
            _worker(fn, rank, world_size, port, tp, pp, ep, vpp, etp, cp, seed, args, kwargs, results)
        finally:
            os.environ.clear()
            os.environ.update(environ)
            torch.set_default_dtype(torch.float32)
            torch.set_grad_enabled(True)
            for module, attribute, value in _FRESH_STATE:
                if module in sys.modules:
                    setattr(sys.modules[module], attribute, value)


class _RankPool:
    """``world_size`` ranks waiting for jobs, started by ``ctx`` (see the module docstring)."""

    def __init__(self, world_size: int, ctx: mp.context.BaseContext):
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_pooled_worker, args=(r, world_size, self.jobs[r], self.results, os.getpid(), dict(os.environ)),
                                  daemon=False)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def submit(self, job: bytes) -> None:
        for q in self.jobs:
            q.put(job)

    def close(self, grace_s: float = 5.0) -> None:
        """Ask the ranks to exit; kill those still alive after ``grace_s``."""
        for q, p in zip(self.jobs, self.procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()
        for q in (*self.jobs, self.results):
            q.close()
            q.cancel_join_thread()


_POOLS: dict[tuple, _RankPool] = {}
"""Pools by (world size, environment): a pool's ranks run under the environment of the call
that made them, so a call made under another one (a test's ``monkeypatch.setenv``) gets its own."""
_MAX_POOLS = 3  # the least recently used beyond this are closed (each rank holds ~0.5 GB)
_VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)  # pytest changes it for every test


_FORKSERVER_PRELOAD = ["tests.support.distributed"]  # imports torch, megatron-core and the runtime
_READ_AT_IMPORT = ("TRITON_", "TORCH", "PYTORCH_", "CUDA_", "PYTHON")
"""Environment variables (prefixes) that torch, triton and megatron-core may read while they are
imported (TRITON_INTERPRET picks triton's interpreter when a kernel is defined, say): a forked
rank has the forkserver's imports, so these must be the caller's. Other variables are the
caller's anyway (a rank adopts its caller's environment first thing); the test process's own
change them freely (``runtime.parallel.initialize`` sets MASTER_PORT, building a megatron model
sets NVTE_*), which must not cost the forkserver."""
_SET_BY_TORCH = ("TORCHINDUCTOR_CACHE_DIR",)  # torch exports its default when it first needs it


def _environment() -> tuple:
    """This process's environment as a pool's key holds it."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k not in _VOLATILE_ENV))


def _read_at_import(environ: tuple) -> tuple:
    return tuple((k, v) for k, v in environ if k.startswith(_READ_AT_IMPORT) and k not in _SET_BY_TORCH)


_FORKSERVER_IMPORT_ENV = _read_at_import(_environment())
"""``_READ_AT_IMPORT``'s part of this module's import-time environment (in the test suite: at
collection, before any test changes it): the forkserver's, whatever else differs when it starts."""
_forkserver_ours: Optional[bool] = None  # None: not decided yet (no pool of that environment yet)


def _start_context(key: tuple) -> mp.context.BaseContext:
    """How a pool of ``key`` starts its ranks: forked from the forkserver, a process that
    imported torch, megatron-core and this module once (a rank then starts in ~0.05 s of CPU,
    not the ~5 s of a spawned interpreter's imports), unless the caller's environment differs
    from the forkserver's in a variable read at import (``_READ_AT_IMPORT``); then spawned, as
    a fresh call's ranks are. A forkserver that other code started first (its imports and
    environment unknown) is not used."""
    global _forkserver_ours
    from multiprocessing import forkserver

    if _read_at_import(key[1]) != _FORKSERVER_IMPORT_ENV:
        return mp.get_context("spawn")
    if _forkserver_ours is None:
        _forkserver_ours = getattr(forkserver._forkserver, "_forkserver_pid", None) is None
        if _forkserver_ours:
            mp.get_context("forkserver").set_forkserver_preload(_FORKSERVER_PRELOAD)
    return mp.get_context("forkserver" if _forkserver_ours else "spawn")


def close_pools() -> None:
    """End every rank pool of this process (run at exit)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def _pool_key(world_size: int) -> tuple:
    return (world_size, _environment())


def _pool_for(key: tuple) -> _RankPool:
    pool = _POOLS.pop(key, None)  # re-inserted last: the dict's order is least recently used first
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.kill()
        while len(_POOLS) >= _MAX_POOLS:
            _POOLS.pop(next(iter(_POOLS))).close()
        pool = _RankPool(key[0], _start_context(key))
        # Registered after multiprocessing's own exit hook (it is imported by the first start):
        # atexit runs last-registered first, and that hook joins every non-daemon child, which
        # would wait forever for ranks still waiting for jobs.
        atexit.unregister(close_pools)
        atexit.register(close_pools)
    _POOLS[key] = pool
    return pool


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tp: int | None = None,
    pp: int | None = None,
    ep: int | None = None,
    vpp: int | None = None,
    etp: int | None = None,
    cp: int | None = None,
    seed: int = 1234,
    timeout_s: float = 300.0,
    fresh: Optional[bool] = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Returns the per-rank results ordered by rank. ``fresh``: new processes for this call
    (default: unless ``MEGATRON_GRPO_RANK_POOL=1``, then the rank pool's; module docstring).
    A rank's failure in a pool is retried once in fresh processes, which decide (a
    ``RankPoolWarning`` carries the pooled failure when they pass).
    """
    __tracebackhide__ = True  # pytest: a failure shows the ranks' tracebacks, not this harness
    if fresh is None:
        fresh = os.environ.get(POOL_ENV) != "1"
    layout = dict(tp=tp, pp=pp, ep=ep, vpp=vpp, etp=etp, cp=cp, seed=seed, timeout_s=timeout_s)
    if fresh:
        return _run(fn, world_size, args, kwargs, fresh=True, **layout)
    try:
        return _run(fn, world_size, args, kwargs, fresh=False, **layout)
    except RankFailure as pooled:
        results = _run(fn, world_size, args, kwargs, fresh=True, **layout)
        warnings.warn(RankPoolWarning(
            f"{getattr(fn, '__qualname__', fn)} failed in the rank pool and passed in fresh processes: "
            f"a state left by an earlier call in the same ranks, or a flaky function. The pooled failure: {pooled}"))
        return results


class RankPoolWarning(UserWarning):
    """A call failed in the rank pool and passed in fresh processes (``run_distributed``)."""


def _run(fn: Callable[..., Any], world_size: int, args: tuple, kwargs: dict, *, fresh: bool,
         tp: int | None, pp: int | None, ep: int | None, vpp: int | None, etp: int | None, cp: int | None,
         seed: int,
         timeout_s: float) -> list[Any]:
    """One try of ``run_distributed`` in fresh processes or the rank pool's."""
    __tracebackhide__ = True
    port = free_port()
    pool: Optional[_RankPool] = None
    if fresh:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, port, tp, pp, ep, vpp, etp, cp, seed, args, kwargs, results),
                daemon=False,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
    else:
        key = _pool_key(world_size)
        pool = _pool_for(key)
        results, procs = pool.results, pool.procs
        pool.submit(pickle.dumps((fn, port, tp, pp, ep, vpp, etp, cp, seed, args, kwargs)))
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if failures:
                    break
                missing = sorted(set(range(world_size)) - set(outputs) - set(failures))
                raise TimeoutError(
                    f"ranks {missing} did not finish within {timeout_s:.0f}s"
                    + _format_failures(failures)
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                # a fresh rank may exit 0 with its result still in the queue; a pool's never exits
                dead = [r for r, p in enumerate(procs) if p.exitcode not in ((None,) if pool is not None else (None, 0))]
                dead = [r for r in dead if r not in outputs and r not in failures]
                if dead:
                    # A rank died without reporting (segfault, os._exit, OOM kill).
                    for r in dead:
                        failures[r] = f"rank {r} exited with code {procs[r].exitcode} without a result"
                continue
            if ok:
                outputs[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                # The others are probably blocked in a collective with the failed rank:
                # give them a short grace period, then stop waiting.
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        if pool is not None:
            if len(outputs) < world_size:  # failed, timed out or interrupted: no state of it may last
                pool.kill()
                _POOLS.pop(key, None)
        else:
            for p in procs:
                p.join(timeout=5.0 if not failures else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    if failures:
        raise RankFailure(f"{len(failures)} of {world_size} ranks failed" + _format_failures(failures))
    return [outputs[r] for r in range(world_size)]


def _format_failures(failures: dict[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
