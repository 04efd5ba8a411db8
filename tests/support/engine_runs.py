"""Helpers for tests that drive the embedded engine in-process (no server)."""

from __future__ import annotations

import threading

from megatron_grpo.engine.generation import Sequence
from megatron_grpo.engine.sampling import resolve_sampling_params


def run(engine, prompts, params: dict, logprob_start_len=-1, timeout_s=120, hold=True) -> list[Sequence]:
    """Submit one sequence per prompt (SGLang ``sampling_params`` dict ``params``) to an
    ``EmbeddedEngine`` and wait for all of them; returns the finished sequences. ``hold``:
    ``EmbeddedEngine.submit``'s (False: no batching window)."""
    done = threading.Semaphore(0)
    seqs = [Sequence(rid=str(i), prompt_ids=list(p), params=resolve_sampling_params(params),
                     return_logprob=True, logprob_start_len=logprob_start_len, on_finish=lambda s: done.release())
            for i, p in enumerate(prompts)]
    engine.submit(seqs, hold=hold)
    for _ in seqs:
        assert done.acquire(timeout=timeout_s), "generation did not finish"
    return seqs
