"""``megatron-grpo train --config FILE [section.key=value ...] [--nproc N]``: the launcher.

It validates the config and the inputs it names (pre-flight), takes the run directory's lock,
then starts ``N`` ranks on this machine under torchrun's agent (``agent``; N =
``parallel.world_size``, default tp*pp*cp). With ``--nnodes K --node-rank R --master-addr A`` it
is node R of K (``nodes``; launch/multi_node.sh) and starts its share of the ranks, N / K by
default. Each rank runs ``python -m megatron_grpo.train`` (``trainer/rank.py``), which is also
what a bare ``torchrun`` and the ``launch/`` scripts start.

User mistakes end with ONE line naming the file and key/line on stderr and exit code 2
(``preflight/report.py``). This module imports no trainer code: the ranks import it, and
``megatron-grpo train`` reports a bad config in 2.4-2.6 s (2 busy CPU cores) instead of the
7.2-7.4 s the driver's import costs (megatron-core's optimizer, schedules and DDP; measured
for issue #24). ``megatron-grpo --help`` imports no sub-command (0.1-0.2 s).
"""

from __future__ import annotations

import os

from megatron_grpo.config import ConfigError, ExperimentConfig
from megatron_grpo.launcher import nodes
from megatron_grpo.launcher.agent import launch_ranks
from megatron_grpo.preflight import load_experiment
from megatron_grpo.preflight.errors import describe_user_error
from megatron_grpo.preflight.report import data_file, fail, run_parser, user_errors
from megatron_grpo.preflight.run import check_run
from megatron_grpo.runtime.run_lock import lock_run_dir


def _parse(argv: list[str]):
    parser = run_parser("megatron-grpo train")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to start on this machine (default (parallel.world_size or tp*pp*cp) / nnodes)")
    nodes.add_arguments(parser)
    return parser.parse_args(argv)


def _ranks_per_node(cfg: ExperimentConfig, nnodes: int) -> int:
    """This machine's share of the run's ranks when ``--nproc`` is not given."""
    total = cfg.parallel.world_size or cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp
    if total % nnodes:
        raise ConfigError("parallel.world_size", f"{total} ranks do not split evenly over --nnodes {nnodes}; "
                                                 "pass --nproc (ranks per node)")
    return total // nnodes


def main(argv: list[str]) -> int:
    """``megatron-grpo train``: pre-flight, then start this machine's ranks (all of them, or
    one node's share of a multi-node run, see ``nodes``)."""
    args = _parse(argv)
    try:
        node = nodes.from_args(args)
    except nodes.NodeError as e:
        return fail(str(e))
    if args.nproc is not None and args.nproc < 1:
        return fail(f"--nproc must be >= 1, got {args.nproc}")
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
        return fail(describe_user_error(e, args.config, data_file(args.config, args.overrides), args.overrides))
    torchrun_args = [*node.torchrun_args(cfg.parallel.distributed_timeout_s), f"--nproc_per_node={nproc}",
                     "-m", "megatron_grpo.train", "--config", args.config, *args.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "MEGATRON_GRPO_PREFLIGHT_DONE": "1",
           # how long torchrun lets the ranks finish a step and save after a stop signal
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(max(1, round(cfg.checkpoint.stop_timeout_s)))}
    try:
        return launch_ranks(torchrun_args, env)
    finally:
        if lock is not None:
            lock.release()
