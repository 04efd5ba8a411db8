#!/usr/bin/env bash
# Context parallelism on the real model at long context: SmolLM2-135M-Instruct on reasoning-gym's
# needle_haystack (chat prompts of 1.9-2.4k tokens), GRPO for a few steps at parallel.cp=2 (each
# sequence split over the 2 ranks) and at cp=1 (one rank, the same batches), then the two runs'
# metrics side by side: rewards equal, loss and grad norm within 1e-5 (SGD: see
# tests/test_context_parallel_e2e.py for why not Adam). Slow: minutes a step on 2 CPU cores.
#   Usage: bash launch/smollm2_long_context_cpu.sh [section.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[reasoning,gguf]"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
config=yaml_configs/smollm2_135m_needle_cp2_cpu.yaml
python tools/fetch_smollm2.py --out runs/smollm2/model
if [[ ! -f runs/smollm2/needle_haystack/heldout.jsonl ]]; then
  python tools/make_reasoning_gym_data.py --task needle_haystack --size 200 --heldout 20 --seed 0 \
    --task-config '{"min_num_statements": 250, "max_num_statements": 300}' \
    --prompt-template plain --out runs/smollm2/needle_haystack
fi
sgd=(optimizer.name=sgd optimizer.lr=0.05)
megatron-grpo train --config "$config" trainer.run_dir=runs/smollm2_needle_cp2 "${sgd[@]}" "$@"
megatron-grpo train --config "$config" trainer.run_dir=runs/smollm2_needle_cp1 parallel.cp=1 \
  parallel.world_size=1 "${sgd[@]}" "$@"
python - <<'PY'
from megatron_grpo.metrics_log import read_metrics
cp2 = read_metrics("runs/smollm2_needle_cp2/metrics.jsonl")
cp1 = read_metrics("runs/smollm2_needle_cp1/metrics.jsonl")
keys = ("reward_mean", "loss", "grad_norm", "entropy", "time/train_s")
print("| step | " + " | ".join(f"{k} cp2 | {k} cp1" for k in keys) + " |")
for a, b in zip(cp2, cp1):
    print(f"| {a['step']} | " + " | ".join(f"{a[k]:.6g} | {b[k]:.6g}" for k in keys) + " |")
worst = max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for a, b in zip(cp2, cp1) for k in ("loss", "grad_norm", "entropy"))
same = all(a["reward_mean"] == b["reward_mean"] for a, b in zip(cp2, cp1))
print(f"rewards equal: {same}; largest relative difference of loss, grad norm, entropy: {worst:.2e}")
PY
