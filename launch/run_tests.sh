#!/usr/bin/env bash
# Install megatron-grpo with its test, reasoning, gguf, lora and agents extras (the reasoning-gym,
# math-verify, GGUF, peft, skyrl-gym and OpenEnv tests need the real libraries) and run the test
# suite's CI tier on two pytest-xdist workers (CPU, 2 cores: docs/testing.md has the counts and times).
# MEGATRON_GRPO_TEST_EXTENDED=1 runs the extended tier too (tests/support/tiers.py).
# MEGATRON_GRPO_TEST_WORKERS=0 runs it in one process; tests/conftest.py keeps each module, and every
# test of the shared SGLang servers, on one worker, heaviest groups first.
# torch==2.13.0 is installed first: on the project's CPU machines it is a local CPU wheel;
# an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
python -m pip install --quiet --disable-pip-version-check -e ".[test,reasoning,gguf,lora,agents]"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
workers="${MEGATRON_GRPO_TEST_WORKERS:-2}"
parallel=()
if [[ "$workers" != 0 ]]; then
  parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
fi
python -m pytest -q -rs --tb=short --durations=25 "${parallel[@]}" "$@"
