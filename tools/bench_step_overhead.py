"""Where a GRPO step's time goes, phase by phase, against the model work in it: launched
(HTTP) embedded engine vs the in-process engine, a tiny and a small model, TP1 and TP2.

    python tools/bench_step_overhead.py [--steps 12] [--sizes tiny small] [--tp 1 2] \\
        [--engines embedded inprocess] [--demo-batch] [--out runs/bench_step_overhead]

The workload is the issue's: the CPU demo's one-token addition task (``tools/make_demo_model.py``),
8 prompts x 16 generations = 128 samples per step, one optimizer step of 128 sequences per
batch, fp32, no evaluation, no checkpoints. ``tiny`` is the demo's model (Qwen2, hidden 128,
2 layers); ``small`` is the same architecture and tokenizer at hidden 512, 4 layers,
intermediate 1024 (random weights: only time is measured). Each configuration is one
``megatron-grpo train`` run of ``yaml_configs/demo_cpu.yaml`` (OMP_NUM_THREADS=1 per process,
as the demo runs); configurations run round robin in the order given.

Reported per configuration: the medians over steps (the first ``--skip`` excluded) of the
trainer's own ``time/*_s`` metrics -- ``generate`` (engine round trip), ``sync`` (weight sync,
verified every step), ``train`` (forward/backward + optimizer), ``logprob`` (old-policy
recomputation), ``rest`` (step minus those) -- and the step. Against them, the model work
measured here in one thread: ``fwd`` the Hugging Face model's forward over the batch's 128
prompts x 16 (what generating one token costs: one prefill), with its FLOPs, and ``memcpy`` a copy of
the sync's bytes (the HF weights in fp32). ``gen/fwd`` and ``sync/memcpy`` are the overhead
factors. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPTS_PER_STEP, NUM_GENERATIONS = 8, 16
SMALL = {"hidden_size": 512, "num_hidden_layers": 4, "intermediate_size": 1024, "num_attention_heads": 8,
         "num_key_value_heads": 4}
PHASES = ("generate", "sync", "train", "logprob")


def build_small(demo_model: Path, out: Path) -> Path:
    """The demo model's architecture and tokenizer at ``SMALL``'s sizes, random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").is_file():
        return out
    config = AutoConfig.from_pretrained(demo_model)
    for key, value in SMALL.items():
        setattr(config, key, value)
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in demo_model.iterdir():  # tokenizer and chat template
        if f.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


def run_config(model: Path, demo: Path, tp: int, engine: str, steps: int, run_dir: Path,
               demo_batch: bool = False) -> list[dict]:
    """One `megatron-grpo train` run; its metric rows. ``demo_batch``: the demo config's own
    batch (16 x 16, four optimizer steps of 64) instead of the issue's 128 samples."""
    batch = [] if demo_batch else [
        f"rollout.prompts_per_step={PROMPTS_PER_STEP}", f"rollout.num_generations={NUM_GENERATIONS}",
        f"parallel.global_batch_size={PROMPTS_PER_STEP * NUM_GENERATIONS}", "parallel.micro_batch_size=32"]
    overrides = [
        f"model.hf_dir={model}", f"data.train_file={demo}/arithmetic.jsonl", f"trainer.run_dir={run_dir}",
        f"trainer.num_steps={steps}", f"parallel.tp={tp}", f"parallel.world_size={tp}", *batch,
        f"rollout.engine={engine}", "eval.sets=[]", "checkpoint.save_every=0", "checkpoint.resume=never",
        "logging.progress_bar=false", "logging.plot=false",
    ]
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "train", "--config",
                    str(ROOT / "yaml_configs/demo_cpu.yaml"), *overrides],
                   check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def phase_medians(rows: list[dict], skip: int) -> dict[str, float]:
    """Median seconds per phase over ``rows[skip:]``; ``rest`` = step minus the named phases."""
    rows = rows[skip:]
    out = {p: statistics.median(r[f"time/{p}_s"] for r in rows) for p in PHASES}
    out["step"] = statistics.median(r["time/step_s"] for r in rows)
    out["rest"] = statistics.median(r["time/step_s"] - sum(r[f"time/{p}_s"] for p in PHASES) for r in rows)
    return out


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model_work(model_dir: Path, demo: Path, num_prompts: int, repeats: int = 7) -> dict[str, float]:
    """One thread: the HF forward over a batch of the task's prompts (fwd_s, its FLOPs) and a
    memcpy of the model's fp32 bytes (memcpy_s, sync_bytes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [json.loads(line)["prompt"] for line in (demo / "arithmetic.jsonl").read_text().splitlines()]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
           for p in prompts[:num_prompts]]
    ids = [list(i["input_ids"]) if isinstance(i, dict) or hasattr(i, "keys") else list(i) for i in ids]
    length = max(map(len, ids))
    batch = torch.tensor([i + [0] * (length - len(i)) for i in ids for _ in range(NUM_GENERATIONS)])
    with torch.inference_mode():
        fwd_s = _median_time(lambda: model(batch), repeats)
    params = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    flops = 2 * (params - embed) * batch.numel()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    memcpy_s = _median_time(lambda: dst.copy_(src), repeats)
    return {"fwd_s": fwd_s, "gflop": flops / 1e9, "sync_mb": nbytes / 2**20, "memcpy_s": memcpy_s,
            "params_m": params / 1e6, "tokens": batch.numel()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the medians (start-up)")
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    p.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    p.add_argument("--engines", nargs="+", default=["embedded", "inprocess"], choices=["embedded", "inprocess", "sglang"])
    p.add_argument("--out", default="runs/bench_step_overhead")
    p.add_argument("--demo-batch", action="store_true",
                   help="the demo config's batch (16 prompts x 16, 4 optimizer steps) instead of 8 x 16, one step")
    p.add_argument("--demo", default=None, help="an existing tools/make_demo_model.py directory (else built in OUT)")
    args = p.parse_args(argv)
    if args.steps <= args.skip:
        print(f"--steps ({args.steps}) must be > --skip ({args.skip})", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    demo = Path(args.demo).resolve() if args.demo else out / "demo"
    if not (demo / "model" / "config.json").is_file():
        subprocess.run([sys.executable, "tools/make_demo_model.py", "--out", str(demo)], check=True, cwd=ROOT,
                       stdout=subprocess.DEVNULL)
    models = {"tiny": demo / "model"}
    if "small" in args.sizes:
        models["small"] = build_small(demo / "model", out / "small_model")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    work = {size: model_work(models[size], demo, 16 if args.demo_batch else PROMPTS_PER_STEP) for size in args.sizes}
    results = {}
    for size in args.sizes:
        for tp in args.tp:
            for engine in args.engines:
                rows = run_config(models[size], demo, tp, engine, args.steps, out / f"{size}_tp{tp}_{engine}",
                                  args.demo_batch)
                results[(size, tp, engine)] = phase_medians(rows, args.skip)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for size in args.sizes:
        w = work[size]
        print(f"\n{size}: {w['params_m']:.2f} M params; model work per step: forward over {w['tokens']} prompt "
              f"tokens {w['fwd_s'] * 1e3:.1f} ms ({w['gflop']:.3f} GFLOP); sync {w['sync_mb']:.2f} MiB, "
              f"memcpy {w['memcpy_s'] * 1e3:.2f} ms")
    header = ("| model | tp | engine | step ms | generate ms | gen/fwd | sync ms | sync/memcpy | train ms "
              "| logprob ms | rest ms | step vs first engine |")
    print("\n" + header + "\n" + "|---" * 12 + "|")
    for size in args.sizes:
        for tp in args.tp:
            base = results[(size, tp, args.engines[0])]["step"]
            for engine in args.engines:
                r, w = results[(size, tp, engine)], work[size]
                print(f"| {size} | {tp} | {engine} | {r['step'] * 1e3:.0f} | {r['generate'] * 1e3:.1f} | "
                      f"{r['generate'] / w['fwd_s']:.1f}x | {r['sync'] * 1e3:.1f} | {r['sync'] / w['memcpy_s']:.0f}x | "
                      f"{r['train'] * 1e3:.0f} | {r['logprob'] * 1e3:.0f} | {r['rest'] * 1e3:.1f} | "
                      f"{r['step'] / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
