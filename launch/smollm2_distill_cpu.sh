#!/usr/bin/env bash
# On-policy distillation on the real model, against GRPO, on 2 CPU cores (docs/distillation.md).
# The teacher is SmolLM2-135M-Instruct after the main job's GRPO run (launch/smollm2_cpu.sh, its
# exported hf/ folder): reused when that run is there, trained first when it is not. Then the
# untrained model is trained three ways, a few seeds each (tools/bench/distill_arms.py): (a) GRPO
# alone (the main job's config), (b) distillation alone (distillation.task_reward: false), (c) both;
# and the table of held-out greedy accuracy against steps and seconds is printed.
#   Usage: bash launch/smollm2_distill_cpu.sh [--seeds 1 2 3] [--arms grpo distill both] [section.key=value ...]
#   (TEACHER_RUN=... for another teacher run, OUT=... for the arms' runs)
set -euo pipefail
cd "$(dirname "$0")/.."
teacher_run="${TEACHER_RUN:-runs/smollm2_cpu}"
if [[ ! -f "$teacher_run/hf/config.json" ]]; then
  RUN_DIR="$teacher_run" bash launch/smollm2_cpu.sh logging.progress_bar=false
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m tools.bench.distill_arms --teacher-run "$teacher_run" --out "${OUT:-runs/smollm2_distill}" "$@"
