"""Run a function on N gloo ranks: the harness behind every TP/PP test and benchmark.

``run_distributed(fn, world_size, *args, tp=..., pp=..., ep=..., vpp=..., etp=...)`` spawns ``world_size`` fresh
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
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable

from megatron_grpo.runtime import cpu_shim, parallel
from megatron_grpo.runtime.process import free_port  # noqa: F401 - re-exported for tests


class RankFailure(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""

def _worker(fn, rank, world_size, port, tp, pp, ep, vpp, etp, seed, args, kwargs, results):
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
        if tp is not None or pp is not None or ep is not None:
            parallel.initialize(tp or 1, pp or 1, seed=seed, ep=ep or 1, vpp=vpp, etp=etp)
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


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    tp: int | None = None,
    pp: int | None = None,
    ep: int | None = None,
    vpp: int | None = None,
    etp: int | None = None,
    seed: int = 1234,
    timeout_s: float = 300.0,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Returns the per-rank results ordered by rank.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, tp, pp, ep, vpp, etp, seed, args, kwargs, results),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
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
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
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
