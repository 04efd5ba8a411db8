"""Numerical kernels shared by the trainer: vocab-parallel log-probs and entropy."""

from megatron_grpo.ops.vocab_parallel import auto_chunk_size, resolve_tp_group, vocab_parallel_log_probs

__all__ = ["vocab_parallel_log_probs", "auto_chunk_size", "resolve_tp_group"]
