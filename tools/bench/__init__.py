"""Benchmarks, seed runners and the scripts a lent GPU runs (``python -m tools.bench.NAME`` from
the repository root); what they share is ``tools.bench.common``. See docs/benchmarks.md."""
