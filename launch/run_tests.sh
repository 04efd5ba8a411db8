#!/usr/bin/env bash
# Install megatron-grpo with its test extras and run the whole test suite (CPU, 2 cores: 36.9 min
# for 996 of the 1083 tests in the project's CI, see README.md).
# torch==2.13.0 is installed first: on the project's CPU machines it is a local CPU wheel;
# an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[test]"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
python -m pytest -q -rs --durations=25 "$@"
