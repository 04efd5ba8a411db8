#!/usr/bin/env bash
# The benchmark for a GPU loan on one CUDA machine (docs/gpu.md#benchmark-for-a-gpu-loan):
# install the wheels carried in .whl/ (if any) into /tmp/site, keep the carried pieces of a large
# file (runs/carry), then run tools/bench/bench_gpu.py.
# Re-run the same command after an interruption: finished parts (OUT/<part>.json) are skipped.
#   Usage: bash launch/gpu_bench.sh OUT [tools/bench/bench_gpu.py options, e.g. --parts logprobs]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash launch/gpu_bench.sh OUT [tools/bench/bench_gpu.py options]}"
shift
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
# the GGUF's pieces this call carried (tools/bench/gpu_loan.md) wait outside the working tree for the
# next ones; smollm2_grpo joins them once all came
if compgen -G "runs/carry/*.part-*-of-*" >/dev/null; then
  python3 -m tools.bench.device_pieces stash runs/carry
fi
exec python3 -m tools.bench.bench_gpu --out "$out" "$@"
