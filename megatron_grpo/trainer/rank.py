"""One rank of a training run: ``torchrun ... -m megatron_grpo.train --config FILE [overrides]``
(``megatron_grpo/train.py``), what the launcher (``launcher/``) and ``launch/`` scripts start.

User errors end every rank with exit code 2, a run that had to stop with 1, a stop signal
with its own code; the one line is recorded for the launcher or printed
(``preflight/report.py``).

Imports sit at the top except the driver's (``rank_main``): importing it (megatron-core's
optimizer, schedules and DDP) more than doubles the start-up (3.0-3.7 s -> 7.2-7.4 s, 2 busy
CPU cores, measured for issue #24), and megatron-core warns at import, before
``quiet_library_warnings`` runs.
"""

from __future__ import annotations

import os

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.generation.handles import spawn_engine
from megatron_grpo.preflight import load_experiment
from megatron_grpo.preflight.errors import describe_user_error
from megatron_grpo.preflight.report import (ERROR_FILE_ENV, EXIT_RUN_ABORTED, EXIT_USER_ERROR, PEER_SUFFIX,
                                            data_file, fail, record_user_error, run_parser, user_errors)
from megatron_grpo.preflight.run import check_run
from megatron_grpo.runtime import parallel, stacks, stop
from megatron_grpo.runtime.collectives import RunAborted
from megatron_grpo.runtime.library_warnings import quiet_library_warnings
from megatron_grpo.runtime.process import die_with_parent
from megatron_grpo.runtime.run_lock import lock_run_dir


def _report(e: BaseException, rank: int, config_path: str, data_file: str | None,
            code: int = EXIT_USER_ERROR, lost_peer: bool = False) -> int:
    """A rank's one-line error: recorded for ``megatron-grpo train`` (any rank of the node,
    first wins) or printed by the node's first rank under a bare torchrun (each node's log
    says why it stopped: after a node died, global rank 0 may be the one that is gone).
    Every rank exits with ``code`` (2 for user errors, 1 for a run that had to stop:
    non-finite losses, an engine that stays down, a lost node)."""
    line = describe_user_error(e, config_path, data_file) if code == EXIT_USER_ERROR else str(e)
    if os.environ.get(ERROR_FILE_ENV):
        record_user_error(f"{code} {line}", os.environ[ERROR_FILE_ENV] + (PEER_SUFFIX if lost_peer else ""))
        return code
    return fail(line, code) if int(os.environ.get("LOCAL_RANK", rank)) == 0 else code


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
    args = run_parser("python -m megatron_grpo.train").parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    lock = None
    try:
        # deprecated keys are announced once: by the launcher (which sets PREFLIGHT_DONE), or
        # by rank 0 of a bare torchrun
        announce = rank == 0 and not os.environ.get("MEGATRON_GRPO_PREFLIGHT_DONE")
        cfg = load_experiment(args.config, args.overrides, world_size=world, announce_deprecated=announce)
        if rank == 0 and not os.environ.get("MEGATRON_GRPO_PREFLIGHT_DONE"):
            check_run(cfg)
            # a bare torchrun: no launcher holds the run directory's lock, so rank 0 does (main)
            lock = lock_run_dir(cfg.trainer.run_dir)
    except user_errors() as e:
        return _report(e, rank, args.config, data_file(args.config, args.overrides))
    stacks.dump_stacks_on_signal(cfg.trainer.run_dir, rank)  # kill -USR1: where a hung rank is
    # Rank 0's rollout servers boot from here, beside the driver's import and the model build
    # (generation.handles.spawn_engine); the trainer adopts them, and stops them at its end.
    spawned = spawn_engine(cfg) if rank == 0 else None
    try:
        # Deferred, measured (module docstring): the driver's import is most of a rank's
        # start-up, and megatron-core warns at import, so it comes after quiet_library_warnings().
        from megatron_grpo.trainer.driver import train

        parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.trainer.seed,
                            timeout_s=cfg.parallel.distributed_timeout_s, ep=cfg.parallel.ep,
                            vpp=cfg.parallel.vpp, etp=cfg.parallel.etp, cp=cfg.parallel.cp)
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
