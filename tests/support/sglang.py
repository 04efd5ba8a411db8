"""The real-SGLang tests' guard: the SGLang environment ``launch/setup_sglang_cpu.sh`` builds
(what it installs there is in ``launch/sglang_cpu/``: ``requirements.txt`` and the CPU
stand-in for ``sgl_kernel``)."""

from __future__ import annotations

import os

from megatron_grpo.generation.adapters import find_sglang_python


def require_sglang() -> str:
    """The interpreter that runs SGLang; without one, fail under CI (``CI`` set: the SGLang
    tests must run there) and skip elsewhere, naming the reason and the fix."""
    import pytest

    python, problem = find_sglang_python(None)
    if python is None:
        if os.environ.get("CI"):
            pytest.fail(f"SGLang tests cannot run in CI: {problem}")
        pytest.skip(problem)
    return python
