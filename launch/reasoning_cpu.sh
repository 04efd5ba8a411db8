#!/usr/bin/env bash
# The CPU reasoning workload, end to end on a fresh machine: install, build the part-trained
# multi-digit addition model and its data (tools/make_reasoning_model.py, a few minutes), train
# it with GRPO (TP=2 on 2 gloo ranks + the embedded rollout engine), print the table and write
# runs/reasoning_cpu/plot.png.   Usage: bash launch/reasoning_cpu.sh [section.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e .
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m tools.make_reasoning_model --out runs/reasoning_cpu
megatron-grpo train --config yaml_configs/reasoning_cpu.yaml "$@"
