"""megatron-grpo. Importing the package adds one import hook and imports nothing heavy:
without CUDA, megatron-core's fusion decorator defers torch's compiler to first use
(runtime/deferred_compile.py: 2.5-3 s less CPU per process that imports megatron-core)."""

from megatron_grpo.runtime import deferred_compile as _deferred_compile

_deferred_compile.install()
