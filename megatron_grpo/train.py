"""``python -m megatron_grpo.train --config FILE [overrides]``: one rank of a run (torchrun)."""

import sys

from megatron_grpo.trainer.cli import rank_main

if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
