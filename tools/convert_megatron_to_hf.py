#!/usr/bin/env python
"""Megatron checkpoint (any TP/PP) -> Hugging Face directory (same as `megatron-grpo convert-megatron-to-hf`).

    python tools/convert_megatron_to_hf.py --help
    torchrun --nproc-per-node 4 tools/convert_megatron_to_hf.py ... --tp 2 --pp 2
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout

from megatron_grpo.models.convert_cli import run_command  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_command("convert-megatron-to-hf", sys.argv[1:]))
