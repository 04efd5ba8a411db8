#!/usr/bin/env python
"""Hugging Face directory -> Megatron distributed checkpoint (same as `megatron-grpo convert-hf-to-megatron`).

    python -m tools.convert_hf_to_megatron --help
    torchrun --nproc-per-node 4 -m tools.convert_hf_to_megatron ... --tp 2 --pp 2
"""

import sys

from megatron_grpo.models.convert_cli import run_command

if __name__ == "__main__":
    sys.exit(run_command("convert-hf-to-megatron", sys.argv[1:]))
