#!/usr/bin/env bash
# Context parallelism on the real model at long context: SmolLM2-135M-Instruct on reasoning-gym's
# chain_sum behind ~2k tokens of notes to ignore (chat prompts of ~2.1k tokens), GRPO for a
# few steps at parallel.cp=2 (each sequence split over the 2 ranks) and at cp=1 (one rank, the
# same batches), then the two runs' metrics side by side: rewards equal, loss, grad norm and
# entropy within 1e-5 (SGD: tests/test_context_parallel_e2e.py says why not Adam). Slow: minutes
# a step on 2 CPU cores.
#   Usage: bash launch/smollm2_long_context_cpu.sh [section.key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[reasoning,gguf]"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
config=yaml_configs/smollm2_135m_long_context_cp2_cpu.yaml
data=runs/smollm2/chain_sum_long
python -m tools.fetch_smollm2 --out runs/smollm2/model
if [[ ! -f "$data/heldout.jsonl" ]]; then
  mkdir -p "$data"
  # ~2k tokens of notes to ignore (reasoning-gym's needle_haystack statements), then the question
  python - "$data/template.txt" <<'PY'
import sys
import reasoning_gym
notes = reasoning_gym.create_dataset("needle_haystack", size=1, seed=5, min_num_statements=260,
                                     max_num_statements=260)[0]["question"].rsplit("\n", 1)[0].strip()
open(sys.argv[1], "w").write("Some notes you can ignore:\n" + notes + "\n\n{question}")
PY
  python -m tools.make_reasoning_gym_data --task chain_sum --size 400 --heldout 20 --seed 0 --split natural \
    --task-config '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}' \
    --prompt-template "$(cat "$data/template.txt")" --out "$data"
fi
sgd=(optimizer.name=sgd optimizer.lr=0.05)
megatron-grpo train --config "$config" trainer.run_dir=runs/smollm2_long_context_cp2 "${sgd[@]}" "$@"
megatron-grpo train --config "$config" trainer.run_dir=runs/smollm2_long_context_cp1 parallel.cp=1 \
  parallel.world_size=1 "${sgd[@]}" "$@"
python - <<'PY'
from megatron_grpo.metrics_log import read_metrics
cp2 = read_metrics("runs/smollm2_long_context_cp2/metrics.jsonl")
cp1 = read_metrics("runs/smollm2_long_context_cp1/metrics.jsonl")
keys = ("reward_mean", "loss", "grad_norm", "entropy", "rollout_train_logprobs_abs_diff_mean", "time/train_s")
print("| step | " + " | ".join(f"{k} cp2 | cp1" for k in keys) + " |")
for a, b in zip(cp2, cp1):
    print(f"| {a['step']} | " + " | ".join(f"{a[k]:.6g} | {b[k]:.6g}" for k in keys) + " |")
worst = max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for a, b in zip(cp2, cp1) for k in ("loss", "grad_norm", "entropy"))
same = all(a["reward_mean"] == b["reward_mean"] for a, b in zip(cp2, cp1))
print(f"rewards equal: {same}; largest relative difference of loss, grad norm, entropy: {worst:.2e}")
PY
