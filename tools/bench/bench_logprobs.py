"""Benchmark: vocab-parallel log-probs + entropy vs megatron's cross-entropy vs naive gather.

    python -m tools.bench.bench_logprobs            # V = 32k and 152k, 1024 tokens, tp = 1 and 2
    python -m tools.bench.bench_logprobs --quick    # V = 32k, 256 tokens: a smoke run (~15 s)
    python -m tools.bench.bench_logprobs --tokens 4096 --vocab 151936 --tp 2
    python -m tools.bench.bench_logprobs --methods "megatron CE (log-prob only)" triton  # a subset, in order

1024 tokens by default (about 2.5 min on 2 CPU cores): at 4096 tokens and V = 152k the naive
baseline alone needs ~12 GB, too much for a shared machine.

Each tp runs on ``tp`` gloo ranks spawned by ``spawn_ranks`` (tp = 1 is one process),
one CPU thread per rank. Every method does forward + backward of a loss on this rank's
logits shard ``[tokens, V/tp]`` (float32 by default; ``--dtype bfloat16``), T = 1 unless
``--temperature`` is given:

* ``megatron CE``: ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` (log-prob
  only). It works in place on its input (its float32 input becomes its gradient), so it
  allocates almost nothing: it is the baseline for the time ratios.
* ``megatron CE + entropy``: the same, plus the entropy written as a plain autograd
  vocab-parallel computation (max all-reduce, exp, two differentiable sums).
* ``naive gather``: all-gather the full vocabulary (differentiable), ``log_softmax``,
  gather the targets, entropy from the full softmax.
* ``ours``: ``megatron_grpo.ops.vocab_parallel_log_probs``, log-prob and entropy both in the
  loss (so the entropy gradient is computed too, as with the two rows above);
  ``entropy value only``: the entropy is returned but detached (GRPO with no entropy bonus
  logs it), so only the log-prob gradient is computed, as megatron's CE does;
  ``inplace``: ``inplace=True`` (overwrites the logits, like megatron's CE). These rows run
  the torch implementation (``kernel="torch"``) on every device.
* ``triton``: the same op with ``kernel="triton"`` (``ops/triton_logprobs.py``: one fused
  pass forward, one backward), in the same three variants. CUDA only: without a GPU these
  rows are skipped (one line on stderr says so).

Time: median of ``--repeats`` timed forward+backward runs after one warm-up (methods taken
in turn, so background load spreads over all of them), the slowest rank counts; a fresh
copy of the logits is made before each run, outside the timing.

Memory ("extra peak"): the peak of the bytes held by torch's allocator during one
forward+backward, above what was allocated before it started (the logits shard and the
targets), including the logits gradient that exists at the end. On CPU it is read from
``torch.profiler``'s allocator events (``profile_memory=True``: every allocation and free
of a torch tensor, in order; their running sum is the live total, its maximum the peak);
this run is separate from the timed ones. On CUDA, ``torch.cuda.max_memory_allocated``.
Process RSS or tracemalloc would not measure this: glibc keeps freed pages and tracemalloc
does not see torch's allocations. The ratio is to the size of one logits shard.

CPU caveat: a fresh logits-sized allocation is first-touched page by page, and on this
machine those page faults cost more than the arithmetic. The op without ``inplace``
allocates one (its saved exps, which become the gradient); megatron's CE and ``inplace``
reuse the input. ``THP_MEM_ALLOC_ENABLE=1`` (torch's transparent-huge-page allocation)
removes most of that cost; the table header says which was used. GPUs (caching allocator)
do not have this cost.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the memory profiler's start/stop chatter

import torch
import torch.distributed as dist

from megatron_grpo.ops import vocab_parallel_log_probs
from megatron_grpo.runtime.device import compute_device

from tools.bench.common import spawn_ranks


@dataclass(frozen=True)
class BenchConfig:
    vocab: int
    tokens: int
    dtype: str
    temperature: float
    repeats: int
    logit_std: float
    chunk_size: int | None
    methods: tuple[str, ...] | None = None
    """Names of ``methods(...)`` to run, in order (the first is the time ratios' baseline);
    None: all that this machine can run."""


# ---- the methods: each returns (log_probs [N], entropy [N] or None) with autograd ----


def _megatron_ce(x, targets, temperature):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # megatron has no temperature; scaling first is what a caller would do (one more pass).
    return -vocab_parallel_cross_entropy(x if temperature == 1.0 else x / temperature, targets), None


def _entropy_autograd(x, temperature):
    """Vocab-parallel entropy written the plain autograd way (what one adds next to CE)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    z = x.float() / temperature
    shift = z.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    z = z - shift
    e = torch.exp(z)
    s = reduce_from_tensor_model_parallel_region(e.sum(-1))
    d = reduce_from_tensor_model_parallel_region((e * z).sum(-1))
    return torch.log(s) - d / s


def _megatron_ce_and_entropy(x, targets, temperature):
    entropy = _entropy_autograd(x, temperature)  # first: megatron's CE overwrites x
    return _megatron_ce(x, targets, temperature)[0], entropy


def _naive_gather(x, targets, temperature):
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(x)
    log_p = torch.log_softmax(full.float() / temperature, dim=-1)
    lp = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, -(log_p.exp() * log_p).sum(-1)


def _ours(chunk_size, entropy_grad=True, inplace=False, kernel="torch"):
    def run(x, targets, temperature):
        lp, entropy = vocab_parallel_log_probs(
            x, targets, temperature=temperature, chunk_size=chunk_size, inplace=inplace, kernel=kernel
        )
        return lp, entropy if entropy_grad else entropy.detach()

    return run


TRITON_SKIPPED = "triton kernel rows skipped: no CUDA (the Triton kernels run on the GPU)"


def methods(cfg: BenchConfig, cuda: bool) -> dict:
    """name -> method (``(x, targets, temperature) -> (log_probs, entropy or None)``) for the
    names in ``cfg.methods`` (None: all; the triton rows only when ``cuda``)."""
    table = {
        "megatron CE (log-prob only)": _megatron_ce,
        "megatron CE + entropy": _megatron_ce_and_entropy,
        "naive gather + log_softmax": _naive_gather,
        "ours": _ours(cfg.chunk_size),
        "ours, entropy value only": _ours(cfg.chunk_size, entropy_grad=False),
        "ours inplace": _ours(cfg.chunk_size, inplace=True),
        "ours inplace, entropy value only": _ours(cfg.chunk_size, entropy_grad=False, inplace=True),
    }
    if cuda:
        table.update({
            "triton": _ours(None, kernel="triton"),
            "triton, entropy value only": _ours(None, entropy_grad=False, kernel="triton"),
            "triton inplace": _ours(None, inplace=True, kernel="triton"),
        })
    if cfg.methods is None:
        return table
    unknown = [name for name in cfg.methods if name not in table]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; available here: {list(table)}")
    return {name: table[name] for name in cfg.methods}


# ---- measurement ----


def _step(method, x, targets, weights, temperature):
    """One forward + backward on the leaf ``x``; returns (log_probs, entropy, the logits'
    gradient) detached."""
    lp, entropy = method(x, targets, temperature)
    loss = (lp * weights[0]).sum()
    if entropy is not None and entropy.requires_grad:
        loss = loss + (entropy * weights[1]).sum()
    # autograd.grad, not backward(): the gradient is handed on as it would be to the output
    # layer, without AccumulateGrad (which may copy it into .grad).
    (grad,) = torch.autograd.grad(loss, x)
    assert grad.shape == x.shape
    return lp.detach(), None if entropy is None else entropy.detach(), grad


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _extra_peak_bytes(fn) -> int:
    """Peak bytes allocated by torch while ``fn()`` runs, above the level at its start."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events = [e for e in events if str(e.device_type()).endswith("CPU")]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _diffs_vs_ours(outputs: dict) -> dict:
    """name -> (max |d log-prob|, max |d entropy|, max |d gradient|) of every kernel row
    ("triton...") against the torch op's row with the same entropy and in-place settings, on
    this rank's shard: the kernel's exactness on the device it ran on. {} without such rows."""
    diffs = {}
    for name, (lp, entropy, grad) in outputs.items():
        if not name.startswith("triton"):
            continue
        twin = outputs.get("ours" + name[len("triton"):])
        if twin is None:
            continue
        d_ent = float("nan") if entropy is None or twin[1] is None else float((entropy - twin[1]).abs().max())
        diffs[name] = (float((lp - twin[0]).abs().max()), d_ent,
                       float((grad.float() - twin[2].float()).abs().max()))
    return diffs


def _bench_worker(rank: int, world_size: int, cfg: BenchConfig) -> dict:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    dtype = getattr(torch, cfg.dtype)
    shard = cfg.vocab // world_size
    gen = torch.Generator().manual_seed(0)  # same targets/weights on every rank
    device = compute_device()  # the rank's GPU when CUDA is available (runtime.device)
    targets = torch.randint(0, cfg.vocab, (cfg.tokens,), generator=gen).to(device)
    weights = torch.randn(2, cfg.tokens, generator=gen).to(device)
    base = (torch.randn(cfg.tokens, shard, generator=torch.Generator().manual_seed(rank + 1))
            * cfg.logit_std).to(device=device, dtype=dtype)
    arms = methods(cfg, device.type == "cuda")
    fresh = lambda: base.clone().requires_grad_()  # noqa: E731 - megatron's CE overwrites it
    reference, exact = None, {}
    for name, method in arms.items():  # warm-up, and every method computes the same thing
        lp, entropy, grad = _step(method, fresh(), targets, weights, cfg.temperature)
        reference = lp if reference is None else reference
        torch.testing.assert_close(lp, reference, rtol=1e-3, atol=1e-3, msg=name)
        exact[name] = (lp, entropy, grad)
    results = {"_max_abs_diff_vs_ours": _diffs_vs_ours(exact)}
    # Round-robin over the methods, so that load from other processes on a shared machine
    # spreads over all of them rather than hitting one.
    times = {name: [] for name in arms}
    for _ in range(cfg.repeats):
        for name, method in arms.items():
            x = fresh()
            dist.barrier(group)
            _synchronize()
            start = time.perf_counter()
            _step(method, x, targets, weights, cfg.temperature)
            _synchronize()  # CUDA kernels run asynchronously: time them to completion
            times[name].append(time.perf_counter() - start)
            del x
    for name, method in arms.items():
        x = fresh()
        dist.barrier(group)
        peak = _extra_peak_bytes(lambda: _step(method, x, targets, weights, cfg.temperature))
        results[name] = (statistics.median(times[name]), peak)
        del x
    results["_shard_bytes"] = base.numel() * base.element_size()
    return results


def run(vocabs, tps, cfg_kwargs, timeout_s: float) -> list[dict]:
    """One table row per (vocab, tp, method): time, ratio to the first method, extra peak."""
    if not torch.cuda.is_available():
        print(TRITON_SKIPPED, file=sys.stderr, flush=True)
    rows = []
    for vocab in vocabs:
        for tp in tps:
            cfg = BenchConfig(vocab=vocab, **cfg_kwargs)
            per_rank = spawn_ranks(_bench_worker, tp, cfg, tp=tp, timeout_s=timeout_s)
            shard_bytes = per_rank[0]["_shard_bytes"]
            names = [k for k in per_rank[0] if not k.startswith("_")]
            base_time = max(r[names[0]][0] for r in per_rank)
            for name in names:
                t = max(r[name][0] for r in per_rank)
                peak = max(r[name][1] for r in per_rank)
                diffs = [r["_max_abs_diff_vs_ours"][name] for r in per_rank if name in r["_max_abs_diff_vs_ours"]]
                rows.append(dict(
                    vocab=vocab, tp=tp, tokens=cfg.tokens, method=name, ms=t * 1e3,
                    time_ratio=t / base_time, peak_mb=peak / 2**20, peak_shards=peak / shard_bytes,
                    shard_mb=shard_bytes / 2**20,
                    # kernel rows: max |diff| against the torch op (log-prob, entropy, gradient)
                    max_abs_diff_vs_ours=[max(d[i] for d in diffs) for i in range(3)] if diffs else None,
                ))
            print(f"done V={vocab} tp={tp}", file=sys.stderr, flush=True)
    return rows


def format_table(rows: list[dict], cfg_kwargs: dict) -> str:
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0") == "1"
    lines = [
        f"tokens={rows[0]['tokens']}, dtype={cfg_kwargs['dtype']}, T={cfg_kwargs['temperature']}, "
        f"logits ~ N(0, {cfg_kwargs['logit_std']}^2), 1 CPU thread per rank, "
        f"THP_MEM_ALLOC_ENABLE={'1' if thp else 'unset'}; forward + backward, median of "
        f"{cfg_kwargs['repeats']}, slowest rank",
        "",
        "| V | tp | shard MB | method | time ms | time / megatron CE | extra peak MB | extra peak / shard |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['vocab']} | {r['tp']} | {r['shard_mb']:.0f} | {r['method']} | {r['ms']:.1f} | "
            f"{r['time_ratio']:.2f}x | {r['peak_mb']:.1f} | {r['peak_shards']:.2f}x |"
        )
    exact = [r for r in rows if r.get("max_abs_diff_vs_ours")]
    if exact:  # the kernel's exactness on the device it ran on
        lines += ["", "| V | tp | kernel row | max abs diff vs ours: log-prob | entropy | gradient |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['vocab']} | {r['tp']} | {r['method']} | "
                  + " | ".join(f"{d:.2e}" for d in r["max_abs_diff_vs_ours"]) + " |" for r in exact]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936],
                        help="padded vocabulary sizes (divisible by every tp)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank (S*B)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--logit-std", type=float, default=3.0)
    parser.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (default auto)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="method names to run, in order (default: all this machine can run)")
    parser.add_argument("--quick", action="store_true", help="V=32k, 256 tokens, 3 repeats")
    parser.add_argument("--output", help="also write the markdown table here")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.quick:
        args.vocab, args.tokens, args.repeats = [32768], 256, 3
    for v in args.vocab:
        for tp in args.tp:
            if v % tp:
                parser.error(f"--vocab {v} is not divisible by --tp {tp}")
    cfg_kwargs = dict(tokens=args.tokens, dtype=args.dtype, temperature=args.temperature,
                      repeats=args.repeats, logit_std=args.logit_std, chunk_size=args.chunk_size,
                      methods=tuple(args.methods) if args.methods else None)
    table = format_table(run(args.vocab, args.tp, cfg_kwargs, args.timeout), cfg_kwargs)
    print(table)
    if args.output:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(args.output)) or ".")
        with os.fdopen(fd, "w") as f:
            f.write(table + "\n")
        os.replace(tmp, args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
