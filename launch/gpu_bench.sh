#!/usr/bin/env bash
# The benchmark for a GPU loan on one CUDA machine (docs/gpu.md#benchmark-for-a-gpu-loan):
# install the wheels carried in .whl/ (if any) into /tmp/site, then run tools/bench_gpu.py.
# Re-run the same command after an interruption: finished parts (OUT/<part>.json) are skipped.
#   Usage: bash launch/gpu_bench.sh OUT [tools/bench_gpu.py options, e.g. --parts logprobs]
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bash launch/gpu_bench.sh OUT [tools/bench_gpu.py options]}"
shift
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec python3 tools/bench_gpu.py --out "$out" "$@"
