"""`megatron-grpo validate-config FILE [--world-size N] [section.key=value ...]`."""

from __future__ import annotations

import argparse
import sys

import yaml

from megatron_grpo.config.base import ConfigError
from megatron_grpo.preflight import load_experiment


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-grpo validate-config",
        description="Validate an experiment YAML and print the fully resolved config.",
    )
    parser.add_argument("config", help="experiment YAML file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.eps_clip_high=0.28")
    parser.add_argument("--world-size", type=int, default=None, help="check against this many ranks")
    args = parser.parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        print(f"error: --world-size must be >= 1, got {args.world_size}", file=sys.stderr)
        return 2
    try:
        cfg = load_experiment(args.config, args.overrides, world_size=args.world_size)
    except ConfigError as e:
        print(f"error: {e.one_line()}", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
