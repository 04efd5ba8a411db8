"""Benchmark the per-step weight sync: throughput vs a memcpy, bucket size, checksum cost.

    python -m tools.bench.bench_weight_sync [--layers 9] [--hidden 1024] [--repeats 2] [--json OUT]

A ~100M-parameter Qwen2-shaped model (``tiny_config`` with bigger sizes, random weights) is
saved as an HF directory and served by a launched embedded engine (float32, its own process,
over HTTP). Trainer ranks (``spawn_ranks``, gloo) build the Megatron model at TP1 and TP2,
load the HF weights and sync them into the engine with ``WeightSync`` exactly as the
trainer does, for several transports and bucket sizes, with and without verification.

Reported per configuration: bytes synced, best-of-N wall time of ``sync()``, throughput,
and the ratio to a plain memcpy of the same tensors in the same (sending) process
(``dst.copy_(src)`` into preallocated tensors, single thread, like the ranks), for the whole
sync and for the data path alone (the time inside ``transport.send``/``end``: packing, the
transfer and the engine's load, without weight iteration and the pause/flush/version calls);
"memcpy-equivalents" is that time over the memcpy's: how many in-process copies of every byte
it costs. The tensor transport runs with both of its CPU wires in the same process:
``named_tensors`` (SGLang's format, what the embedded engine used before) and ``shm_bucket``.
The checksum overhead is measured two ways, from interleaved (no verify, verify) pairs so
the machine's drifting load hits both alike: the wall-time difference of the medians, and
the checksum work itself (the sender's checksum CPU time, which overlaps the transfer, plus
one timed engine-side checksum pass over all tensors through /weights_checksum).

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

from megatron_grpo.config import EngineConfig, SyncConfig
from megatron_grpo.generation.manager import RolloutServerManager

from tools.bench.common import sections_config, spawn_ranks


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


def _time_data_path(transport) -> None:
    """Accumulate the time spent in ``transport.send``/``end`` into ``transport.data_seconds``
    (bench instrumentation: wraps the bound methods of this one transport)."""
    transport.data_seconds = 0.0
    for method in ("send", "end"):
        inner = getattr(transport, method)

        def timed(*a, _inner=inner, **k):
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                transport.data_seconds += time.perf_counter() - t0
        setattr(transport, method, timed)


def _bench_worker(rank, world_size, url, model_dir, work_dir, throughput_configs, overhead_transports, repeats):
    import statistics

    from megatron_grpo.models import build_model, iter_hf_weights, load_hf_config, load_hf_weights
    from megatron_grpo.generation import RolloutClient
    from megatron_grpo.sync.driver import WeightSync
    from megatron_grpo.sync.servers import ServerDelivery
    from megatron_grpo.sync.transports import TENSOR_WIRES

    hf_config = load_hf_config(model_dir)
    chunks = build_model(hf_config, dtype=torch.float32, init_weights=False)
    load_hf_weights(chunks, model_dir, hf_config)
    client = RolloutClient([url], request_timeout_s=600)
    named = list(iter_hf_weights(chunks, hf_config))  # collective: every rank iterates
    names = [n for n, _ in named]
    memcpy = memcpy_seconds([t for _, t in named], repeats) if rank == 0 else None
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    del named
    step = [0]

    def syncer(transport, bucket_mb, verify):
        kind, _, wire = transport.partition(":")
        cfg = sections_config(engine=EngineConfig(request_timeout_s=600),
                         sync=SyncConfig(transport=kind, bucket_mb=bucket_mb, verify_every=1 if verify else 0))
        s = WeightSync(cfg, hf_config, ServerDelivery(cfg, [url], hf_config, work_dir=work_dir, client=client))
        sender = s.delivery.transport
        if sender is not None:
            if wire:  # the other CPU wire, to compare both in this process
                sender.wire.release()
                sender.wire = TENSOR_WIRES[wire]()
            _time_data_path(sender)
        return s

    def run(s):
        step[0] += 1
        sender = s.delivery.transport
        if sender is not None:
            sender.data_seconds = 0.0
        st = s.sync(chunks, step[0])
        st.data_seconds = sender.data_seconds if sender is not None else 0.0
        return st

    rows = []
    for transport, bucket_mb in throughput_configs:  # best of N, no verification
        s = syncer(transport, bucket_mb, False)
        best = min((run(s) for _ in range(repeats)), key=lambda st: st.seconds)
        s.close()
        rows.append(dict(transport=transport, bucket_mb=bucket_mb, seconds=best.seconds,
                         data_seconds=best.data_seconds, bytes=best.num_bytes))
    overhead = []
    for transport in overhead_transports:  # interleaved off/on pairs: the machine's load drifts
        plain, checked = syncer(transport, 512, False), syncer(transport, 512, True)
        off, on, sender_cpu, engine_s = [], [], [], []
        for _ in range(repeats):
            off.append(run(plain).seconds)
            if rank == 0:  # the engine's checksum pass over everything, timed alone
                t0 = time.perf_counter()
                client.call("weights_checksum", {"names": names}, url=url)
                engine_s.append(time.perf_counter() - t0)
            st = run(checked)
            on.append(st.seconds)
            sender_cpu.append(st.checksum_seconds)
        plain.close()
        checked.close()
        med = statistics.median
        overhead.append(dict(transport=transport, off=med(off), on=med(on), sender_checksum=med(sender_cpu),
                             engine_checksum=med(engine_s) if engine_s else None))
    client.close()
    return {"memcpy_seconds": memcpy, "bytes": nbytes, "rows": rows, "overhead": overhead}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    from tools.tiny import save_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="bench_weight_sync_"))
    model_dir = str(save_tiny_model(tmp / "model", "qwen2", hidden_size=args.hidden, num_layers=args.layers,
                                    num_heads=16, num_kv_heads=4, intermediate_size=args.intermediate))
    num_params = sum(
        t.numel() for t in __import__("safetensors.torch", fromlist=["load_file"]).load_file(
            f"{model_dir}/model.safetensors").values())
    print(f"model: qwen2 hidden {args.hidden}, {args.layers} layers, {num_params / 1e6:.1f}M params "
          f"({num_params * 4 / 2**20:.0f} MiB fp32)", flush=True)
    plans = {  # tp -> (throughput configs, transports for the checksum overhead)
        1: ([("distributed", 64), ("distributed", 512), ("tensor:named_tensors", 512),
             ("tensor:shm_bucket", 512), ("disk", 512)],
            ["distributed", "tensor:shm_bucket"]),
        2: ([("distributed", 512), ("tensor:named_tensors", 512), ("tensor:shm_bucket", 512)], ["distributed"]),
    }
    cfg = sections_config(engine=EngineConfig(dtype="float32", launch_timeout_s=300))
    results = {}
    with RolloutServerManager(cfg, model_dir=model_dir, run_dir=tmp / "run") as manager:
        url = manager.urls[0]
        for tp, (configs, overhead) in plans.items():
            t0 = time.perf_counter()
            out = spawn_ranks(_bench_worker, tp, url, model_dir, str(tmp / "sync"), configs, overhead,
                                  args.repeats, tp=tp, pp=1, timeout_s=900)
            results[f"tp{tp}"] = out[0]
            print(f"tp{tp}: {time.perf_counter() - t0:.0f}s", flush=True)
    print_table(results, num_params)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def print_table(results: dict, num_params: int) -> None:
    print("\n| TP | transport | bucket MiB | GiB synced | sync s (best) | GiB/s | sync vs memcpy "
          "| data path s | data path vs memcpy | memcpy-equivalents (data path / sync) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, out in results.items():
        memcpy_s = out["memcpy_seconds"]
        for r in out["rows"]:
            gbs = r["bytes"] / r["seconds"] / 2**30
            print(f"| {name[2:]} | {r['transport']} | {r['bucket_mb']} | {r['bytes'] / 2**30:.2f} | "
                  f"{r['seconds']:.3f} | {gbs:.2f} | {100 * memcpy_s / r['seconds']:.0f}% | "
                  f"{r['data_seconds']:.3f} | {100 * memcpy_s / r['data_seconds']:.0f}% | "
                  f"{r['data_seconds'] / memcpy_s:.1f} / {r['seconds'] / memcpy_s:.1f} |")
        print(f"| {name[2:]} | memcpy (same process) | | {out['bytes'] / 2**30:.2f} | "
              f"{memcpy_s:.3f} | {out['bytes'] / memcpy_s / 2**30:.2f} | 100% | | | 1 |")
    print("\nChecksum verification (bucket 512 MiB, medians of interleaved pairs):\n")
    print("| TP | transport | sync s, no verify | sync s, verify | wall overhead | trainer checksum CPU "
          "| engine checksum pass | (trainer + engine) / sync |")
    print("|---|---|---|---|---|---|---|---|")
    for name, out in results.items():
        for o in out["overhead"]:
            engine = o["engine_checksum"] or 0.0
            print(f"| {name[2:]} | {o['transport']} | {o['off']:.3f} | {o['on']:.3f} | "
                  f"{100 * (o['on'] - o['off']) / o['off']:+.1f}% | {o['sender_checksum'] * 1e3:.1f} ms | "
                  f"{engine * 1e3:.1f} ms | {100 * (o['sender_checksum'] + engine) / o['off']:.1f}% |")


if __name__ == "__main__":
    sys.exit(main())
