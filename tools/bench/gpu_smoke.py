"""GPU verification on ONE CUDA device: the checks the CPU test suite cannot run.

    python -m tools.bench.gpu_smoke [--out DIR] [--only step,features,bench,self_check,demo,fp8] [--demo-steps N]

Each check prints its figures on lines that start with the GPU's name
(``torch.cuda.get_device_name()``), and a last line ``PASS`` or ``FAIL: <check>: <why>``:

* ``step``: two steps of ``megatron-grpo train`` at TP1 in bf16 with the embedded engine
  launched on the same GPU (``--device cuda:0``) and ``sync.transport=tensor``:
  the buckets reach the engine as CUDA IPC handles (``wire/serialize.py``), every sync is
  verified by per-tensor checksums. Exercises the device seam (batch placement, NCCL
  collectives on GPU tensors, the fused finiteness check), the embedded engine on a GPU and
  the CUDA RNG state in the checkpoint written at the end;
* ``features``: activation recomputation and the distributed optimizer in bf16: two steps,
  a checkpoint (the optimizer's sharded format), then a resume to step 4;
* ``bench``: ``tools/bench/bench_logprobs.py`` at tp 1 on the GPU: our vocab-parallel log-prob +
  entropy op against megatron-core's ``vocab_parallel_cross_entropy`` (time and peak memory,
  V = 32k and 152k, bf16 logits);
* ``self_check``: the HF -> Megatron conversion self-check (``models.self_check``) in fp32
  on the GPU: max |Δlogits| against the HF model;
* ``demo``: the demo (``yaml_configs/demo_cpu.yaml``, its model built by
  ``tools/make_demo_model.py``) for ``--demo-steps`` steps at TP1 on the GPU: reward at the
  start and the end, seconds per step;
* ``fp8``: ``engine.quantization=fp8`` on its GPU path: one 0.5B-sized layer through
  ``torch._scaled_mm`` against the fake-quantized product in fp32, then three bf16 demo steps
  with the fp8 embedded engine, every weight sync verified by the trainer's fake-quantized probe.

Without CUDA it prints one line saying so and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tools.bench.common import ROOT, run_records

CHECKS = ("step", "features", "bench", "self_check", "demo", "fp8")
EXIT_NO_GPU = 2


def gpu_name() -> str:
    return torch.cuda.get_device_name()


def report(check: str, **figures) -> None:
    """One line of figures, prefixed with the GPU's name."""
    text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
    print(f"[{gpu_name()}] {check}: {text}", flush=True)


def _env() -> dict:
    """This process's environment with the repository first on PYTHONPATH (kept: carried wheels)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _train(out: Path, name: str, overrides: list[str], timeout_s: float) -> list[dict]:
    """``megatron-grpo train`` on the demo config with ``overrides``; its metric records."""
    run_dir = out / name
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "train", "--config", str(ROOT / "yaml_configs/demo_cpu.yaml"),
           f"model.hf_dir={out / 'demo/model'}", f"data.train_file={out / 'demo/arithmetic.jsonl'}",
           f"trainer.run_dir={run_dir}", "parallel.tp=1", "parallel.world_size=1", "logging.plot=false",
           "engine.kind=embedded",  # the launched engine on the GPU is what this checks
           "checkpoint.resume=never",
           f"eval.sets=[{{name: heldout, path: {out / 'demo/arithmetic_heldout.jsonl'}, n: 8, temperature: 1.0}}]",
           *overrides]
    env = _env()
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / f"train_{len(list(run_dir.glob('train_*.log')))}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        errors = [ln for ln in log.read_text().splitlines() if "Error" in ln or "error:" in ln]
        raise RuntimeError(f"train exited {proc.returncode} (log {log}): {' | '.join(errors[-3:])}")
    return run_records(run_dir)


def _make_demo(out: Path) -> None:
    if not (out / "demo/model/config.json").is_file():
        subprocess.run([sys.executable, "-m", "tools.make_demo_model", "--out", str(out / "demo")],
                       cwd=ROOT, check=True, capture_output=True, env=_env())


def check_step(out: Path) -> None:
    _make_demo(out)
    records = _train(out, "step", ["trainer.num_steps=2", "model.dtype=bfloat16", "engine.dtype=bfloat16",
                                   "sync.transport=tensor", "sync.verify_logprob_tolerance=0.05",
                                   "checkpoint.save_every=2"], timeout_s=900)
    launch = (out / "step/rollout/server.log").read_text()
    if "--device cuda:" not in launch:
        raise RuntimeError("the embedded engine was not launched on a GPU")
    ckpt = out / "step/checkpoints/step_000002/rng/rank_00000.pt"
    rng = torch.load(ckpt, weights_only=True)
    if "cuda" not in rng or "tracker" not in rng:
        raise RuntimeError(f"{ckpt} has no CUDA RNG state (keys {sorted(rng)})")
    last = records[-1]
    if not all(r["weight_sync_verified"] for r in records):
        raise RuntimeError("a weight sync was not verified")
    report("step (TP1 bf16, embedded engine on this GPU, tensor transport over CUDA IPC)",
           steps=len(records), time_step_s=float(last["time/step_s"]), time_sync_s=float(last["time/sync_s"]),
           time_train_s=float(last["time/train_s"]), loss=float(last["loss"]),
           grad_norm=float(last["grad_norm"]), skipped_updates=int(last["skipped_updates"]),
           cuda_rng_in_checkpoint=True)


def check_features(out: Path) -> None:
    """Activation recomputation + the distributed optimizer in bf16: 2 steps, a checkpoint, and a resume to 4."""
    _make_demo(out)
    common = ["model.dtype=bfloat16", "model.recompute_activations=true", "parallel.use_distributed_optimizer=true",
              "sync.transport=tensor", "checkpoint.save_every=2"]
    first = _train(out, "features", ["trainer.num_steps=2", *common], timeout_s=900)
    ckpt = out / "features/checkpoints/step_000002"
    if not ckpt.is_dir():
        raise RuntimeError(f"no checkpoint at {ckpt}")
    resumed = _train(out, "features", ["trainer.num_steps=4", "checkpoint.resume=auto", *common], timeout_s=900)
    steps = [int(r["step"]) for r in resumed]
    if steps[-1] != 4 or steps[:2] != [1, 2] or len(steps) != 4:
        raise RuntimeError(f"resume did not continue at step 3: steps in metrics.jsonl {steps}")
    last = resumed[-1]
    report("features (bf16, recompute_activations, distributed optimizer, save at 2, resume to 4)",
           steps_before=len(first), steps_after=len(resumed), loss=float(last["loss"]),
           grad_norm=float(last["grad_norm"]), time_step_s=float(last["time/step_s"]))


def check_bench(out: Path) -> None:
    from tools.bench.bench_logprobs import format_table, run

    cfg = dict(tokens=4096, dtype="bfloat16", temperature=1.0, repeats=10, logit_std=3.0, chunk_size=None)
    rows = run([32768, 151936], [1], cfg, timeout_s=900)
    for r in rows:
        report("bench", vocab=r["vocab"], tokens=r["tokens"], method=repr(r["method"]), time_ms=float(r["ms"]),
               time_vs_megatron_ce=float(r["time_ratio"]), extra_peak_mb=float(r["peak_mb"]),
               extra_peak_vs_shard=float(r["peak_shards"]))
    (out / "bench.md").write_text(f"GPU: {gpu_name()}\n\n{format_table(rows, cfg)}\n")


def _self_check_worker(rank, world, hf_dir):
    from megatron_grpo.models import build_model, load_hf_config, load_hf_weights
    from megatron_grpo.models.self_check import run_self_check

    cfg = load_hf_config(hf_dir)
    chunks = build_model(cfg, init_weights=False)
    load_hf_weights(chunks, hf_dir, cfg)
    device = str(next(chunks[0].parameters()).device)
    result = run_self_check(chunks, cfg, hf_dir)
    return {"max_abs_diff": result.max_abs_diff, "ok": result.ok, "device": device}


def check_self_check(out: Path) -> None:
    from tools.bench.common import spawn_ranks
    from tools.tiny import save_tiny_model

    hf_dir = str(save_tiny_model(out / "self_check", "qwen2", seed=0))
    (res,) = spawn_ranks(_self_check_worker, 1, hf_dir, tp=1, pp=1, timeout_s=600)
    report("self_check (fp32, TP1)", model_device=res["device"], max_abs_logit_diff=float(res["max_abs_diff"]))
    if not res["ok"] or not res["device"].startswith("cuda"):
        raise RuntimeError(f"self-check failed: {res}")


def check_demo(out: Path, steps: int) -> None:
    _make_demo(out)
    t0 = time.monotonic()
    records = _train(out, "demo", [f"trainer.num_steps={steps}", "sync.transport=tensor",
                                   "checkpoint.save_every=0"], timeout_s=3000)
    head, tail = records[: max(1, steps // 5)], records[-max(1, steps // 5):]
    mean = lambda rs: sum(float(r["reward_mean"]) for r in rs) / len(rs)  # noqa: E731
    report("demo (TP1 fp32, embedded engine on this GPU)", steps=len(records), reward_first=mean(head),
           reward_last=mean(tail), seconds_per_step=float(sum(r["time/step_s"] for r in records) / len(records)),
           wall_s=time.monotonic() - t0)


def check_fp8(out: Path) -> None:
    """engine.quantization: fp8 on the GPU path (ops/quantize.py's torch._scaled_mm): one layer
    against the fake-quantized definition, then the demo's steps with an fp8 embedded engine
    whose every weight sync the trainer's fake-quantized probe must verify."""
    from megatron_grpo.ops.quantize import quantize_weight, quantized_linear, scaled_mm_supported, scheme_of

    scheme = scheme_of("fp8")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 896, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(4864, 896, device="cuda", generator=gen) * 0.02).bfloat16()
    if not scaled_mm_supported(x.device, x.dtype, scheme, w.shape):
        raise RuntimeError(f"torch._scaled_mm is not used on this GPU ({torch.cuda.get_device_capability()})")
    q = quantize_weight(w, scheme)
    fast = quantized_linear(x, q, None, scheme).float()
    fake = quantized_linear(x.float(), q, None, scheme).float()  # fp32: the fake-quantized definition
    exact = (x.float() @ w.float().t())
    rel = ((fast - fake).abs().max() / fake.abs().max()).item()
    rel_quant = ((fake - exact).abs().max() / exact.abs().max()).item()
    if rel > 1e-2:
        raise RuntimeError(f"_scaled_mm differs from the fake-quantized product by {rel:.2e} (relative)")
    _make_demo(out)
    records = _train(out, "fp8", ["trainer.num_steps=3", "model.dtype=bfloat16", "engine.dtype=bfloat16",
                                  "engine.quantization=fp8", "sync.transport=tensor",
                                  "checkpoint.save_every=0"], timeout_s=900)
    if not all(r["weight_sync_verified"] for r in records):
        raise RuntimeError("a weight sync of the fp8 engine was not verified")
    report("fp8 (torch._scaled_mm in the embedded engine, bf16)",
           layer_rel_diff_vs_fake_quant=rel, layer_rel_quant_error=rel_quant, steps=len(records),
           syncs_verified=sum(int(r["weight_sync_verified"]) for r in records),
           rollout_train_logprob_diff_mean=float(records[-1]["rollout_train_logprobs_abs_diff_mean"]),
           is_ratio_outside_10pct=float(records[-1]["is_ratio_outside_10pct"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="work directory (default: a new temporary one)")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    parser.add_argument("--demo-steps", type=int, default=30)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device on this machine (torch.cuda.is_available() is False); these checks "
              "need one GPU", file=sys.stderr)
        return EXIT_NO_GPU
    checks = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        parser.error(f"--only: unknown check(s) {unknown}; expected {', '.join(CHECKS)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_smoke_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"[{gpu_name()}] torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB; work dir {out}", flush=True)
    runners = {"step": lambda: check_step(out), "features": lambda: check_features(out), "bench": lambda: check_bench(out),
               "self_check": lambda: check_self_check(out), "demo": lambda: check_demo(out, args.demo_steps), "fp8": lambda: check_fp8(out)}
    failed = []
    for check in checks:
        try:
            runners[check]()
        except Exception as e:  # noqa: BLE001 - every check runs; each failure is one line
            failed.append(check)
            print(f"[{gpu_name()}] FAIL: {check}: {' '.join(f'{type(e).__name__}: {e}'.split())[:800]}", flush=True)
    print("PASS" if not failed else f"FAIL: {', '.join(failed)}", flush=True)
    (out / "summary.json").write_text(json.dumps({"gpu": gpu_name(), "checks": checks, "failed": failed}) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
