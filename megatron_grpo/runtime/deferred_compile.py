"""Import megatron-core without loading torch's compiler when there is no GPU.

``megatron.core.jit`` sets ``jit_fuser = torch.compile`` and a dozen megatron modules decorate
functions with it at import time. Decorating is cheap in itself, but the first
``torch.compile(fn)`` imports ``torch._dynamo`` and inductor's lowering: 2.5-3 s of CPU in
every process that imports megatron-core, about a third of a rank's start-up on the project's
2-core machines (``import megatron.core`` 6.4 s, 3.9 s without it). The test suite starts
hundreds of such processes (torchrun ranks, ``testing.distributed`` ranks).

``install()`` (called by ``megatron_grpo/__init__.py``, so before any of our modules can import
megatron-core) adds an import hook for ``megatron.core.jit`` alone: once that module has run,
and only when CUDA is unavailable, its ``jit_fuser`` becomes ``defer``, which wraps each
function so that ``torch.compile`` is called on its first call instead of at decoration.
The compiled function is the same, at the same moment of first use (``torch.compile`` is lazy
in itself: it compiles on the first call); only the compiler's import moves, and it never
happens in a process that calls no fused function (the CPU trainer calls none: megatron's
fusion flags are off without TransformerEngine). On a GPU nothing changes: the path measured
there is megatron's own.

A process that imported megatron-core before ``megatron_grpo`` keeps megatron's eager import.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

JIT_MODULE = "megatron.core.jit"


def defer(fn: Callable | None = None, **kwargs: Any) -> Callable:
    """``torch.compile`` with the call postponed to ``fn``'s first call (and its keyword form,
    ``defer(**kwargs)(fn)``)."""
    if fn is None:
        return lambda f: defer(f, **kwargs)
    compiled: list[Callable] = []

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        if not compiled:
            import torch

            compiled.append(torch.compile(fn, **kwargs))
        return compiled[0](*args, **kw)

    return call


def _patch_jit(module: Any) -> None:
    """After ``megatron.core.jit`` ran: swap its torch.compile fuser for ``defer`` on CPU."""
    import torch

    if not torch.cuda.is_available() and module.jit_fuser is torch.compile:
        module.jit_fuser = defer


class _JitFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the normal path finder does and patches it once loaded."""

    def find_spec(self, name: str, path: Any, target: Any = None):  # noqa: D102 - importlib API
        if name != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _patch_jit(module)

        spec.loader.exec_module = exec_module  # this spec's own loader instance
        return spec


def install() -> None:
    """Add the hook (idempotent; no-op once megatron-core's jit module is imported). Imports
    nothing heavy: torch is only imported by megatron-core itself."""
    if JIT_MODULE in sys.modules or any(isinstance(f, _JitFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitFinder())
