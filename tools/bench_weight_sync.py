"""Benchmark the per-step weight sync: throughput vs a memcpy, bucket size, checksum cost.

    python tools/bench_weight_sync.py [--layers 9] [--hidden 1024] [--repeats 2] [--json OUT]

A ~100M-parameter Qwen2-shaped model (``tiny_config`` with bigger sizes, random weights) is
saved as an HF directory and served by a launched embedded engine (float32, its own process,
over HTTP). Trainer ranks (``run_distributed``, gloo) build the Megatron model at TP1 and TP2,
load the HF weights and sync them into the engine with ``WeightSyncer`` exactly as the
trainer does, for several transports and bucket sizes, with and without verification.

Reported per configuration: bytes synced, best-of-N wall time of ``sync()``, throughput,
and the ratio to a plain memcpy of the same tensors in the same (sending) process
(``dst.copy_(src)`` into preallocated tensors, single thread, like the ranks).
The checksum overhead is (sync time with verification - without) / sync time without, at the
same bucket size, plus the checksum time the sender itself measured.

Runs in ~3-4 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_grpo.config.rollout import RolloutConfig  # noqa: E402
from megatron_grpo.rollout.manager import RolloutServerManager  # noqa: E402
from megatron_grpo.testing.distributed import run_distributed  # noqa: E402


def memcpy_seconds(tensors: list[torch.Tensor], repeats: int) -> float:
    """Best time to copy every tensor into a preallocated twin (warm pages)."""
    dst = [torch.empty_like(t) for t in tensors]
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for d, s in zip(dst, tensors):
            d.copy_(s)
        best = min(best, time.perf_counter() - t0)
    return best


def _bench_worker(rank, world_size, url, model_dir, work_dir, configs, repeats):
    from megatron_grpo.models import build_model, iter_hf_weights, load_hf_config, load_hf_weights
    from megatron_grpo.rollout import RolloutClient
    from megatron_grpo.sync.syncer import WeightSyncer

    hf_config = load_hf_config(model_dir)
    chunks = build_model(hf_config, dtype=torch.float32, init_weights=False)
    load_hf_weights(chunks, model_dir, hf_config)
    client = RolloutClient([url], request_timeout_s=600)
    tensors = [t for _, t in iter_hf_weights(chunks, hf_config)]  # collective: every rank iterates
    memcpy = memcpy_seconds(tensors, repeats) if rank == 0 else None
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    del tensors
    rows = []
    step = 0
    for transport, bucket_mb, verify in configs:
        cfg = RolloutConfig(weight_sync_transport=transport, weight_update_bucket_mb=bucket_mb,
                            verify_weights_every=1 if verify else 0, request_timeout_s=600)
        syncer = WeightSyncer(cfg, [url], hf_config, work_dir=work_dir, client=client)
        best = None
        for _ in range(repeats):
            step += 1
            stats = syncer.sync(chunks, step)
            if best is None or stats.seconds < best.seconds:
                best = stats
        syncer.close()
        rows.append(dict(transport=transport, bucket_mb=bucket_mb, verify=verify, seconds=best.seconds,
                         checksum_seconds=best.checksum_seconds, bytes=best.num_bytes, buckets=best.num_buckets))
    client.close()
    return {"memcpy_seconds": memcpy, "bytes": nbytes, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    from megatron_grpo.testing.tiny_models import save_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_weight_sync_"))
    model_dir = str(save_tiny_model(tmp / "model", "qwen2", hidden_size=args.hidden, num_layers=args.layers,
                                    num_heads=16, num_kv_heads=4, intermediate_size=args.intermediate))
    num_params = sum(
        t.numel() for t in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
            f"{model_dir}/model.safetensors").values())
    print(f"model: qwen2 hidden {args.hidden}, {args.layers} layers, {num_params / 1e6:.1f}M params "
          f"({num_params * 4 / 2**20:.0f} MiB fp32)", flush=True)
    tp1_configs = [("distributed", mb, False) for mb in (16, 64, 256, 512)]
    tp1_configs += [("distributed", 512, True), ("tensor", 512, False), ("tensor", 512, True),
                    ("disk", 512, False)]
    tp2_configs = [("distributed", 512, False), ("distributed", 512, True)]
    cfg = RolloutConfig(dtype="float32", launch_timeout_s=300)
    results = {}
    with RolloutServerManager(cfg, model_dir=model_dir, run_dir=tmp / "run") as manager:
        url = manager.urls[0]
        for tp, configs in ((1, tp1_configs), (2, tp2_configs)):
            t0 = time.perf_counter()
            out = run_distributed(_bench_worker, tp, url, model_dir, str(tmp / "sync"), configs, args.repeats,
                                  tp=tp, pp=1, timeout_s=900)
            results[f"tp{tp}"] = out[0]
            print(f"tp{tp}: {time.perf_counter() - t0:.0f}s", flush=True)
    print_table(results, num_params)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def print_table(results: dict, num_params: int) -> None:
    print("\n| TP | transport | bucket MiB | verify | GiB synced | sync s | GiB/s | vs memcpy | checksum overhead |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, out in results.items():
        memcpy_gbs = out["bytes"] / out["memcpy_seconds"] / 2**30
        unverified = {(r["transport"], r["bucket_mb"]): r["seconds"] for r in out["rows"] if not r["verify"]}
        for r in out["rows"]:
            gbs = r["bytes"] / r["seconds"] / 2**30
            overhead = ""
            base = unverified.get((r["transport"], r["bucket_mb"]))
            if r["verify"] and base:
                overhead = (f"{100 * (r['seconds'] - base) / base:+.1f}% wall; "
                            f"{100 * r['checksum_seconds'] / r['seconds']:.1f}% in checksums")
            print(f"| {name[2:]} | {r['transport']} | {r['bucket_mb']} | {'yes' if r['verify'] else 'no'} | "
                  f"{r['bytes'] / 2**30:.2f} | {r['seconds']:.3f} | {gbs:.2f} | {100 * gbs / memcpy_gbs:.0f}% | "
                  f"{overhead} |")
        print(f"| {name[2:]} | memcpy (same process) | | | {out['bytes'] / 2**30:.2f} | "
              f"{out['memcpy_seconds']:.3f} | {memcpy_gbs:.2f} | 100% | |")


if __name__ == "__main__":
    sys.exit(main())
