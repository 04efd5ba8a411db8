#!/usr/bin/env bash
# The CPU demo, end to end on a fresh machine: install, build the tiny model and dataset,
# train with GRPO (TP=2 on 2 gloo ranks + the in-process rollout engine), print the table and
# write runs/demo_cpu/plot.png.   Usage: bash launch/demo_cpu.sh [section.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e .
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m tools.make_demo_model --out runs/demo_cpu
megatron-grpo train --config yaml_configs/demo_cpu.yaml "$@"
