"""tools/bench/bench_context_parallel.py: its flags, its refusals and its table (the measurement itself
runs in minutes and is a benchmark, not a test: docs/models.md has its figures)."""

import subprocess
import sys

from tests.support.demo_run import ROOT


def _tool(*args):
    return subprocess.run([sys.executable, "-m", "tools.bench.bench_context_parallel", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_help_and_refusals():
    out = _tool("--help")
    assert out.returncode == 0 and "--lengths" in out.stdout and "--layers" in out.stdout
    out = _tool("--lengths", "4", "--cps", "1", "2")
    assert out.returncode == 2 and "--lengths must be >= 4 x the largest cp" in out.stderr
    out = _tool("--cps", "2")
    assert out.returncode == 2 and "--cps must include 1" in out.stderr


def test_table_gives_ratios_against_cp1():
    from tools.bench.bench_context_parallel import table

    points = [{"length": 8, "cp": 1, "activation_bytes": 4 * 2**20, "peak_rss_over_bytes": 2**20, "update_s": 2.0},
              {"length": 8, "cp": 2, "activation_bytes": 2 * 2**20, "peak_rss_over_bytes": 2**20, "update_s": 3.0}]
    lines = table(points).splitlines()
    assert lines[2] == "| 8 | 1 | 4 | 1 | 2.0 | 1.00x | 1.00x |"
    assert lines[3] == "| 8 | 2 | 2 | 1 | 3.0 | 0.50x | 1.50x |"
