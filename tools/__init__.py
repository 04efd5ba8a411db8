"""What users run beside the ``megatron-grpo`` command: fetch and convert models, build the demos'
models and data, score a model with plain transformers, read a test timeline.

Every tool runs from the repository root as a module, ``python -m tools.NAME --help``; the
benchmarks, seed runners and GPU-loan scripts are ``tools.bench`` (``python -m tools.bench.NAME``).
Not part of the wheel: a checkout's ``tools/`` is where they live.
"""
