"""The launch scripts of the README, run as a user runs them."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (ROOT / "launch").iterdir() if p.suffix in (".sh", ".sbatch"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    # A quote inside ${VAR:?message} once made multi_node.sh unparseable: every multi-node
    # launch failed before torchrun started.
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
