#!/usr/bin/env bash
# The separate environment tools/bench/bench_vs_trl.py runs TRL's GRPOTrainer in: .venv-trl at the
# repository root with the same CPU torch as the trainer, TRL from PyPI, and megatron-grpo
# itself (the TRL side imports its tokenizer loader, prompts and reward so both sides see the
# same token ids and scores; the reasoning extra for the reasoning_gym reward of --workload
# smollm2). Kept apart so TRL's dependencies never change the trainer's.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m venv .venv-trl
.venv-trl/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv-trl/bin/python -m pip install --quiet --disable-pip-version-check "trl==1.16.0" -e ".[reasoning]"
echo "ready: .venv-trl/bin/python ($(.venv-trl/bin/python -c 'import trl; print("trl", trl.__version__)'))"
