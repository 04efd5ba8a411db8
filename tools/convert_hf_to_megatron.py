#!/usr/bin/env python
"""Hugging Face directory -> Megatron distributed checkpoint (same as `megatron-grpo convert-hf-to-megatron`).

    python tools/convert_hf_to_megatron.py --help
    torchrun --nproc-per-node 4 tools/convert_hf_to_megatron.py ... --tp 2 --pp 2
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout

from megatron_grpo.models.convert_cli import run_command  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_command("convert-hf-to-megatron", sys.argv[1:]))
