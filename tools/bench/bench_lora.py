"""LoRA vs full fine-tuning on one model, in one run: trainable parameters, optimizer state,
peak memory, update-step time and the weight sync's bytes and seconds.

    python -m tools.bench.bench_lora [--model smollm2|demo | --model-dir DIR] [--tp 1] [--pp 1] [--world 2] [--rank 16]
                               [--alpha 32] [--targets all-linear] [--steps 4] [--rows 16] [--tokens 128]
                               [--dtype float32] [--json OUT]

Each mode (full, then LoRA) runs in fresh ranks (``spawn_ranks``: the peak RSS
is the mode's own) that build the trainer's policy (``trainer.components.build_policy``: megatron
chunks, DDP, megatron-core optimizer; Adam), run ``--steps`` GRPO updates on one random batch
of ``--rows`` sequences of ``--tokens`` tokens (one optimizer step each, micro-batches of 4
rows) and time each; then the weight sync's payload is built as the in-process engine's sync
builds it (full: every weight merged, gathered over TP; LoRA: A and B gathered) and rank 0
loads it into an ``EmbeddedEngine`` of the same model (full: ``load_weights``; LoRA:
``merge_lora``, the engine's fp32 merge), timed.

Reported per mode: trainable parameters, optimizer state bytes (fp32 main copies and Adam
moments, this rank), DDP gradient-buffer bytes, peak RSS of rank 0 (``ru_maxrss``: everything
the process ever held, model and engine included), median update seconds (the first step
excluded: warm-up), sync bytes and seconds (gather + engine load); and LoRA/full ratios.
``--model smollm2`` fetches the main job's model into its cache first (``tools/fetch_smollm2.py``);
``--model-dir DIR`` runs on any HF directory of an architecture the trainer takes (e.g. a sized
model of ``tools/bench/make_sized_model.py``: ``tools/bench/bench_gpu.py``'s ``lora_1.5b`` part calls
``compare``). On CUDA each mode also reports rank 0's peak GPU memory
(``torch.cuda.max_memory_allocated``: the update and the sync's engine load).

Python: ``compare(hf_dir, lora, *, world, tp, pp, dtype, steps, rows, tokens) -> {"full": ..., "lora": ...}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tools.bench.common import bench_model_dir, spawn_ranks


def _batch(vocab: int, rows: int, tokens: int, seed: int = 0):
    """``rows`` sequences: a quarter prompt, the rest response, random ids and advantages."""
    from megatron_grpo.rollout.batch import build_train_batch

    gen = torch.Generator().manual_seed(seed)
    prompt = tokens // 4
    prompts = [torch.randint(0, vocab, (prompt,), generator=gen).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (tokens - prompt,), generator=gen).tolist() for _ in range(rows)]
    logps = [(-torch.rand(tokens - prompt, generator=gen) * 3).tolist() for _ in range(rows)]
    return build_train_batch(prompts, outputs, logps, torch.randn(rows, generator=gen), pad_id=0)


def _tensor_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def _optimizer_state_bytes(optimizer) -> int:
    """Adam moments + fp32 main parameters (mixed precision) of this rank."""
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    state = [t for opt in inner for s in opt.state.values() for t in s.values()]
    # in bf16 the inner optimizer steps fp32 copies of the parameters; in fp32, the parameters themselves
    mains = [p for opt in inner for g in opt.param_groups for p in g["params"]] if optimizer.config.bf16 else []
    return _tensor_bytes(state) + _tensor_bytes(mains)


def _bench(rank, world, hf_dir, lora, dtype, steps, rows, tokens):
    import resource

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_grpo.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from megatron_grpo.config.model import LoraConfig
    from megatron_grpo.models import iter_hf_weights
    from megatron_grpo.models.lora import has_lora
    from megatron_grpo.models.lora_export import iter_adapters_hf
    from megatron_grpo.models.weights import exports_weights
    from megatron_grpo.inference.engine import EmbeddedEngine
    from tools.bench.common import policy_of
    from megatron_grpo.rollout.batch import dp_shard
    from megatron_grpo.trainer.megatron_step import ScoringSpec, train_mini_batch

    torch.manual_seed(0)
    model = ModelConfig(hf_dir=hf_dir, dtype=dtype, lora=LoraConfig(**lora) if lora else None)
    policy = policy_of(model, OptimizerConfig(name="adam", lr=1e-6, clip_grad=1.0))
    vocab = policy.hf_config.vocab_size
    spec = ScoringSpec(temperature=1.0, vocab_size=vocab)
    algo = AlgorithmConfig()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    full = _batch(vocab, rows, tokens)
    local = dp_shard(full, dp_rank, dp, rows)
    local.old_log_probs = local.rollout_log_probs.clone()
    seconds = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        train_mini_batch(policy.chunks, policy.optimizer, local, algo, spec, 4, int(full.loss_mask.sum()),
                         full.num_sequences, dp, ps.get_data_parallel_group())
        dist.barrier()
        seconds.append(time.perf_counter() - t0)
    params = [p for c in policy.modules for p in c.parameters()]
    out = {"trainable": sum(p.numel() for p in params if p.requires_grad),
           "total_params": sum(p.numel() for p in params),
           "optimizer_bytes": _optimizer_state_bytes(policy.optimizer),
           "grad_buffer_bytes": sum(b.grad_data.numel() * b.grad_data.element_size()
                                    for c in policy.chunks for b in c.buffers),
           "update_s": statistics.median(seconds[1:] or seconds)}
    # the sync's payload as the in-process sync builds it (pp = 1 here: rank 0 holds it all)
    dist.barrier()
    t0 = time.perf_counter()
    if has_lora(policy.modules):
        payload = list(iter_adapters_hf(policy.modules, policy.hf_config)) if exports_weights() else []
        sent = {id(t): t for _, a, b in payload for t in (a, b)}
    else:
        payload = list(iter_hf_weights(policy.modules, policy.hf_config)) if exports_weights() else []
        sent = {id(t): t for _, t in payload}
    gather_s = time.perf_counter() - t0
    if rank == 0:
        engine = EmbeddedEngine(hf_dir, dtype="float32")
        try:
            with engine.exclusive():
                if has_lora(policy.modules):
                    engine.load_weights(iter_hf_weights(policy.modules, policy.hf_config, merge_lora=False))
                    t0 = time.perf_counter()
                    engine.merge_lora(payload, policy.modules[0].lora_spec.scale)
                else:
                    t0 = time.perf_counter()
                    engine.load_weights(iter(payload))
                load_s = time.perf_counter() - t0
        finally:
            engine.shutdown()
        out.update(sync_bytes=sum(t.numel() * 4 for t in sent.values()), sync_gather_s=gather_s, sync_load_s=load_s,
                   peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   # the ranks are fresh processes: the peak is this mode's own
                   peak_cuda_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None)
    elif has_lora(policy.modules) and exports_weights():
        list(iter_hf_weights(policy.modules, policy.hf_config, merge_lora=False))  # rank 0's base load gathers
    return out


def compare(hf_dir: str, lora: dict, *, world: int = 1, tp: int = 1, pp: int = 1, dtype: str = "float32",
            steps: int = 4, rows: int = 16, tokens: int = 128, timeout_s: float = 3600) -> dict:
    """Rank 0's figures of each mode, full then LoRA (``lora``: model.lora's rank, alpha and
    target_modules), each in fresh ranks: ``{"full": {...}, "lora": {...}}``."""
    results = {}
    for mode, cfg in (("full", None), ("lora", lora)):
        ranks = spawn_ranks(_bench, world, hf_dir, cfg, dtype, steps, rows, tokens, tp=tp, pp=pp,
                                timeout_s=timeout_s)
        results[mode] = ranks[0]
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["smollm2", "demo"], default="smollm2")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="an HF model directory to run on instead of --model (e.g. tools/bench/make_sized_model.py's)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", default="all-linear", help="comma-separated model.lora.target_modules")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.pp != 1:
        p.error("--pp 1 only: the sync payload is measured on rank 0 holding every stage")
    if args.model_dir is not None and not (args.model_dir / "config.json").is_file():
        p.error(f"--model-dir {args.model_dir}: no config.json there (an HF model directory is expected)")
    lora = {"rank": args.rank, "alpha": args.alpha, "target_modules": args.targets.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = str(args.model_dir) if args.model_dir is not None else bench_model_dir(args.model, Path(tmp))
        results = compare(hf_dir, lora, world=args.world, tp=args.tp, pp=args.pp, dtype=args.dtype,
                          steps=args.steps, rows=args.rows, tokens=args.tokens)
    rows = [("trainable parameters (rank 0)", "trainable", "{:,}"),
            ("optimizer state, MB (rank 0)", "optimizer_bytes", "{:.1f}"),
            ("DDP gradient buffers, MB (rank 0)", "grad_buffer_bytes", "{:.1f}"),
            ("peak RSS of rank 0, MB", "peak_rss_bytes", "{:.0f}"),
            ("peak GPU memory of rank 0, MB", "peak_cuda_bytes", "{:.0f}"),
            ("update step, s (median)", "update_s", "{:.3f}"),
            ("sync payload, MB", "sync_bytes", "{:.3f}"),
            ("sync gather, s", "sync_gather_s", "{:.3f}"),
            ("sync engine load / merge, s", "sync_load_s", "{:.3f}")]
    print(f"model {args.model_dir or args.model}, {args.dtype}, world {args.world} (tp {args.tp}), "
          f"LoRA rank {args.rank} alpha "
          f"{args.alpha:g} on {args.targets}; {args.rows} rows x {args.tokens} tokens, {args.steps} Adam steps")
    print(f"{'':36s} {'full':>14s} {'LoRA':>14s} {'LoRA/full':>10s}")
    for label, key, fmt in rows:
        f, lo = results["full"][key], results["lora"][key]
        if f is None or lo is None:  # the GPU's peak without CUDA
            continue
        scale = 1e6 if key.endswith("bytes") else 1
        f, lo = (f / scale, lo / scale) if scale != 1 else (f, lo)
        print(f"{label:36s} {fmt.format(f):>14s} {fmt.format(lo):>14s} {lo / f if f else float('nan'):>10.3f}")
    if args.json:
        named = vars(args) | {"json": str(args.json), "model_dir": str(args.model_dir)}
        args.json.write_text(json.dumps({"args": named, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
