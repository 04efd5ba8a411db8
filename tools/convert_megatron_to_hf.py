#!/usr/bin/env python
"""Megatron checkpoint (any TP/PP) -> Hugging Face directory (same as `megatron-grpo convert-megatron-to-hf`).

    python -m tools.convert_megatron_to_hf --help
    torchrun --nproc-per-node 4 -m tools.convert_megatron_to_hf ... --tp 2 --pp 2
"""

import sys

from megatron_grpo.models.convert_cli import run_command

if __name__ == "__main__":
    sys.exit(run_command("convert-megatron-to-hf", sys.argv[1:]))
