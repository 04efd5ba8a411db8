"""Context parallelism's memory and time per rank (``parallel.cp``;
docs/models.md#context-parallelism-parallelcp), cp 1 against cp 2 in one run.

    python -m tools.bench.bench_context_parallel [--lengths 2048 4096 8192] [--layers 4] [--out FILE.json]

For each length L and cp in (1, 2): one update of the trainer (``train_mini_batch``: the real
megatron-core schedule, forward, backward, Adam step) of one sequence of L tokens (a prompt of
L/4, a response of 3L/4, every response token scored) on a SmolLM2-135M-shaped model (llama,
hidden 576, 9 heads over 3 key/value groups, MLP 1536, vocabulary 49152, ``--layers`` of its
30; random weights: only memory and time mean anything), fp32, on cp gloo ranks; the machine's
cores are split between the ranks (cp 1: one rank with every thread). Measured on each rank:

* activation memory: the peak of the bytes autograd holds for the backward at once
  (``saved_tensors_hooks``: each storage once, counted from its first save until autograd
  frees its last, the parameters left out; recomputations inside the backward count too):
  deterministic, what CP divides;
* the update's peak resident memory above the rank's before it (``resource.getrusage``'s
  high-water mark minus the resident size after the model and optimizer were built);
* the update's seconds (the second of two updates: the first pays the allocator's warm-up).

Printed: one row per (L, cp) and the ratios cp 2 / cp 1 at each length; ``--out`` writes them as
JSON. The goal (issue: activation memory per rank at cp 2 <= 0.6 x cp 1 at 8k tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
import weakref
from pathlib import Path

from tools.bench.common import spawn_ranks
from tools.tiny import save_tiny_model

SMOLLM2 = dict(hidden_size=576, num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=49152)


class _Held:
    """A saved tensor as autograd holds it (``saved_tensors_hooks``): freed when autograd is done with it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _rank(rank: int, world: int, hf_dir: str, length: int, threads: int) -> dict:
    """One rank of a (length, cp = world) point (module docstring); runs under ``spawn_ranks``."""
    import psutil
    import torch

    from types import SimpleNamespace

    from megatron_grpo.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from megatron_grpo.config.model import ParallelConfig
    from megatron_grpo.rollout.batch import build_train_batch
    from megatron_grpo.trainer.components import build_policy
    from megatron_grpo.trainer.megatron_step import ScoringSpec, train_mini_batch

    torch.set_num_threads(threads)
    policy = build_policy(SimpleNamespace(model=ModelConfig(hf_dir=hf_dir, dtype="float32"),
                                          optimizer=OptimizerConfig(lr=1e-6), parallel=ParallelConfig(cp=world)))
    gen = torch.Generator().manual_seed(0)
    prompt, response = length // 4, length - length // 4
    batch = build_train_batch([torch.randint(10, 40000, (prompt,), generator=gen).tolist()],
                              [torch.randint(10, 40000, (response,), generator=gen).tolist()],
                              [[-1.0] * response], torch.tensor([1.0]), pad_id=0)
    spec = ScoringSpec(temperature=1.0, vocab_size=policy.hf_config.vocab_size)
    params = {p.untyped_storage().data_ptr() for c in policy.chunks for p in c.parameters()}
    live: dict[int, list] = {}  # storage -> [saved tensors holding it, its bytes]
    total = {"now": 0, "peak": 0}

    def release(ptr: int) -> None:
        entry = live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            total["now"] -= entry[1]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() in params:
            return t
        entry = live.setdefault(storage.data_ptr(), [0, storage.nbytes()])
        if entry[0] == 0:
            total["now"] += entry[1]
            total["peak"] = max(total["peak"], total["now"])
        entry[0] += 1
        holder = _Held(t)  # autograd drops it when the saved tensor is used up: the bytes leave the count
        weakref.finalize(holder, release, storage.data_ptr())
        return holder

    def update():
        return train_mini_batch(policy.chunks, policy.optimizer, batch, AlgorithmConfig(), spec, 1,
                                int(batch.loss_mask.sum()), 1, 1, None)

    update()  # warm-up: the allocator's first growth, megatron's buffers
    rss_before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.tensor if isinstance(held, _Held) else held):
        update()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"activation_bytes": total["peak"], "peak_rss_over_bytes": max(0, peak - rss_before),
            "update_s": seconds}


def measure(hf_dir: str, length: int, cp: int, timeout_s: float) -> dict:
    """One (length, cp) point on fresh ranks: the largest per-rank values."""
    threads = max(1, (os.cpu_count() or 1) // cp)
    rows = spawn_ranks(_rank, cp, hf_dir, length, threads, tp=1, pp=1, cp=cp, timeout_s=timeout_s)
    return {key: max(r[key] for r in rows) for key in rows[0]}


def table(points: list[dict]) -> str:
    """The rows and the cp2/cp1 ratios as a markdown table."""
    lines = ["| tokens | cp | activation MiB / rank | update peak RSS over MiB / rank | update s | "
             "activation vs cp 1 | time vs cp 1 |", "|---|---|---|---|---|---|---|"]
    base = {p["length"]: p for p in points if p["cp"] == 1}
    for p in points:
        b = base[p["length"]]
        lines.append(f"| {p['length']} | {p['cp']} | {p['activation_bytes'] / 2**20:.0f} | "
                     f"{p['peak_rss_over_bytes'] / 2**20:.0f} | {p['update_s']:.1f} | "
                     f"{p['activation_bytes'] / b['activation_bytes']:.2f}x | {p['update_s'] / b['update_s']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of SmolLM2-135M's 30 (default 4)")
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="deadline of each point")
    parser.add_argument("--out", type=Path, help="write the points as JSON here")
    args = parser.parse_args(argv)
    if any(n < 4 * max(args.cps) for n in args.lengths) or args.layers < 1 or 1 not in args.cps:
        parser.error("--lengths must be >= 4 x the largest cp, --layers >= 1, and --cps must include 1 (the baseline)")
    from megatron_grpo.runtime.files import write_text_atomic

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = str(save_tiny_model(Path(tmp) / "model", "llama", num_layers=args.layers, **SMOLLM2))
        points = []
        for length in args.lengths:
            for cp in args.cps:
                points.append({"length": length, "cp": cp, **measure(hf_dir, length, cp, args.timeout_s)})
                print(f"{length} tokens, cp {cp}: {points[-1]}", flush=True)
    print(table(points))
    if args.out:
        write_text_atomic(args.out, json.dumps({"layers": args.layers, "points": points}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
