"""Entry points of a training run.

* ``megatron-grpo train --config FILE [section.key=value ...] [--nproc N]``: validates the
  config and the inputs it names (pre-flight), then starts ``N`` ranks on this machine with
  ``torch.distributed.run`` (N = ``parallel.world_size``, default tp*pp).
* ``torchrun ... -m megatron_grpo.train --config FILE [overrides]``: one rank of a run
  (single or multi node); this is what the launcher and ``launch/`` scripts start.

User mistakes (config, data, model directory, reward functions) end with ONE line naming
the file and key/line on stderr and exit code 2, before anything is written to the run
directory.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from megatron_grpo.config import ConfigError, ExperimentConfig, load_config

EXIT_USER_ERROR = 2


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types whose message is a complete one-line user-facing error."""
    from megatron_grpo.data import DataError
    from megatron_grpo.models import ModelError
    from megatron_grpo.rewards import RewardError

    return (ConfigError, DataError, ModelError, RewardError)


def preflight(cfg: ExperimentConfig) -> None:
    """Check, without writing anything, every input the run reads at start-up: the model
    directory, the tokenizer against the model's vocabulary, the dataset (every line), and
    the reward functions. Raises a user error (see ``user_errors``)."""
    from megatron_grpo.data import load_prompt_dataset
    from megatron_grpo.models import ModelError, load_hf_config
    from megatron_grpo.rewards import RewardScorer
    from megatron_grpo.trainer.components import load_tokenizer

    hf_config = load_hf_config(cfg.model.hf_dir)
    try:
        tokenizer = load_tokenizer(cfg.model.hf_dir)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad dir
        raise ModelError(f"{cfg.model.hf_dir}: cannot load the tokenizer: {' '.join(str(e).split())[:200]}") from None
    if len(tokenizer) > hf_config.vocab_size:
        raise ModelError(
            f"{cfg.model.hf_dir}: the tokenizer has {len(tokenizer)} tokens but config.json's vocab_size is "
            f"{hf_config.vocab_size}: tokenizer and model do not belong together")
    load_prompt_dataset(cfg.data, tokenizer)
    RewardScorer(cfg.reward)


def _parse(argv: list[str], prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description="Run a GRPO experiment.")
    parser.add_argument("--config", required=True, help="experiment YAML (yaml_configs/...)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.num_steps=10")
    parser.add_argument("--nproc", type=int, default=None, help="ranks to start (default parallel.world_size or tp*pp)")
    return parser.parse_args(argv)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR


def main(argv: list[str]) -> int:
    """``megatron-grpo train``: pre-flight, then start the ranks on this machine."""
    args = _parse(argv, "megatron-grpo train")
    try:
        cfg = load_config(args.config, args.overrides)
        nproc = args.nproc or cfg.parallel.world_size or cfg.parallel.tp * cfg.parallel.pp
        cfg = load_config(args.config, args.overrides, world_size=nproc)
        preflight(cfg)
    except user_errors() as e:
        return _fail(str(e))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "megatron_grpo.train", "--config", args.config, *args.overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "MEGATRON_GRPO_PREFLIGHT_DONE": "1"}
    return subprocess.call(cmd, env=env)


def rank_main(argv: list[str]) -> int:
    """One rank (under torchrun). Rank 0 reports user errors; all ranks exit 2 on them."""
    from megatron_grpo.runtime import parallel

    args = _parse(argv, "python -m megatron_grpo.train")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_config(args.config, args.overrides, world_size=world)
        if rank == 0 and not os.environ.get("MEGATRON_GRPO_PREFLIGHT_DONE"):
            preflight(cfg)
    except user_errors() as e:
        return _fail(str(e)) if rank == 0 else EXIT_USER_ERROR
    parallel.initialize(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.trainer.seed)
    from megatron_grpo.trainer.driver import train

    try:
        train(cfg)
    except user_errors() as e:
        return _fail(str(e)) if rank == 0 else EXIT_USER_ERROR
    finally:
        parallel.destroy()
    return 0
