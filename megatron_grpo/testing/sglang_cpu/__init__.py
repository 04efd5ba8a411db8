"""Test support for the real SGLang on CPU machines (see ``launch/setup_sglang_cpu.sh``).

``requirements.txt`` and ``sgl_kernel/`` beside this file are what the setup script installs
into the SGLang environment; nothing here is imported by the trainer.
"""

from __future__ import annotations

import os

from megatron_grpo.rollout.engines import find_sglang_python


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
