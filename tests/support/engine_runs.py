"""Helpers for tests that drive the embedded engine in-process (no server), and the references they
compare it with: a full float64 forward's log-probs (``reference_logprobs``), a plain HF forward's
MoE routing (``hf_topk``)."""

from __future__ import annotations

import threading

import torch

from megatron_grpo.inference import routing
from megatron_grpo.inference.generation import Sequence
from megatron_grpo.inference.sampling import resolve_sampling_params


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


def reference_logprobs(model, seq: Sequence, temperature: float) -> torch.Tensor:
    """float64 log_softmax(logits / T) of the full sequence at its output tokens."""
    full = torch.tensor([seq.prompt_ids + seq.output_ids])
    with torch.no_grad():
        logits = model(full).logits[0].double()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    n = len(seq.prompt_ids)
    return torch.stack([logprobs[n - 1 + i, t] for i, t in enumerate(seq.output_ids)])


def hf_topk(model, token_ids: list[int]) -> torch.Tensor:
    """int [P, num_moe_layers, k]: top-k of softmax(router logits) of a plain HF forward,
    computed here from the logits the routers return (their own indices are ignored)."""
    logits = []
    routers = routing.moe_routers(model)
    handles = [r.register_forward_hook(lambda m, i, o: logits.append(o[0].detach())) for r in routers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([token_ids]))
    finally:
        for h in handles:
            h.remove()
    k = routers[0].top_k
    probs = torch.stack(logits, dim=1).float().softmax(dim=-1)  # [P, layers, E]
    return probs.topk(k, dim=-1).indices
