"""Shared pytest setup: the repo root on sys.path (so spawned ranks can import test helpers)
and quiet megatron/TE warnings."""

import os
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


@pytest.fixture
def python_module(tmp_path, monkeypatch):
    """``python_module(name, source)`` writes an importable module (a user's reward plug-in,
    say) into tmp_path, puts it on sys.path and forgets it from sys.modules afterwards."""
    import textwrap

    written = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)
