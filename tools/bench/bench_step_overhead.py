"""Where a GRPO step's time goes, phase by phase, against the model work in it: launched
(HTTP) embedded engine vs the in-process engine, a tiny and a small model, TP1 and TP2.

    python -m tools.bench.bench_step_overhead [--workload demo|reasoning] [--steps 12] [--sizes tiny small] \\
        [--tp 1 2] [--engines embedded inprocess] [--demo-batch] [--out runs/bench_step_overhead]

Two workloads, 8 prompts x 16 generations = 128 samples per step, one optimizer step of 128
sequences per batch, fp32, no evaluation, no checkpoints:

* ``demo`` (default): the CPU demo's one-token addition task (``tools/make_demo_model.py``,
  ``yaml_configs/demo_cpu.yaml``): one decode step per batch, so the step is all overhead;
* ``reasoning``: the reasoning workload (``tools/make_reasoning_model.py``,
  ``yaml_configs/reasoning_cpu.yaml``, docs/reasoning.md): written-out chains of tens of tokens
  with a tail past 150, so generation runs many decode steps and the trainer scores long rows.

``tiny`` is the workload's own model (Qwen2; the demo's: hidden 128, 2 layers); ``small`` is
the same architecture and tokenizer at hidden 512, 4 layers, intermediate 1024 (random weights:
only time is measured; on the reasoning workload its random responses run to
``max_new_tokens``). Each configuration is one ``megatron-grpo train`` run of the workload's
config (OMP_NUM_THREADS=1 per process, as the demo runs); configurations run round robin in the
order given.

Reported per configuration: the medians over steps (the first ``--skip`` excluded) of the
trainer's own ``time/*_s`` metrics -- ``generate`` (engine round trip), ``sync`` (weight sync,
verified every step), ``train`` (forward/backward + optimizer), ``logprob`` (old-policy
recomputation), ``rest`` (step minus those) -- and the step, with the responses' mean and
longest length (medians over the same steps) and ``generate`` per decode step (``generate``
divided by the longest response: the batch decodes that many steps). Against them, the model work
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

from tools.bench.common import ROOT, run_records

PROMPTS_PER_STEP, NUM_GENERATIONS = 8, 16
SMALL = {"hidden_size": 512, "num_hidden_layers": 4, "intermediate_size": 1024, "num_attention_heads": 8,
         "num_key_value_heads": 4}
PHASES = ("generate", "sync", "train", "logprob")
WORKLOADS = {
    # name -> (config, builder, its data file)
    "demo": ("yaml_configs/demo_cpu.yaml", "tools.make_demo_model", "arithmetic.jsonl"),
    "reasoning": ("yaml_configs/reasoning_cpu.yaml", "tools.make_reasoning_model", "train.jsonl"),
}


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
               demo_batch: bool = False, workload: str = "demo") -> list[dict]:
    """One `megatron-grpo train` run of ``workload`` (``demo``: its built directory); its metric
    rows. ``demo_batch``: the config's own batch (16 x 16, optimizer steps of 64) instead of
    the issue's 128 samples."""
    config, _, data_file = WORKLOADS[workload]
    batch = [] if demo_batch else [
        f"rollout.prompts_per_step={PROMPTS_PER_STEP}", f"rollout.num_generations={NUM_GENERATIONS}",
        f"parallel.global_batch_size={PROMPTS_PER_STEP * NUM_GENERATIONS}", "parallel.micro_batch_size=32"]
    overrides = [
        f"model.hf_dir={model}", f"data.train_file={demo / data_file}", f"trainer.run_dir={run_dir}",
        f"trainer.num_steps={steps}", f"parallel.tp={tp}", f"parallel.world_size={tp}", *batch,
        f"engine.kind={engine}", "eval.sets=[]", "checkpoint.save_every=0", "checkpoint.resume=never",
        "logging.progress_bar=false", "logging.plot=false",
    ]
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "train", "--config",
                    str(ROOT / config), *overrides],
                   check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return run_records(run_dir)


def phase_medians(rows: list[dict], skip: int) -> dict[str, float]:
    """Median seconds per phase over ``rows[skip:]``; ``rest`` = step minus the named phases."""
    rows = rows[skip:]
    out = {p: statistics.median(r[f"time/{p}_s"] for r in rows) for p in PHASES}
    out["step"] = statistics.median(r["time/step_s"] for r in rows)
    out["rest"] = statistics.median(r["time/step_s"] - sum(r[f"time/{p}_s"] for p in PHASES) for r in rows)
    out["len_mean"] = statistics.median(r["response_length_mean"] for r in rows)
    out["len_max"] = statistics.median(r["response_length_max"] for r in rows)
    out["gen_per_decode"] = statistics.median(r["time/generate_s"] / max(r["response_length_max"], 1) for r in rows)
    return out


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model_work(model_dir: Path, demo: Path, num_prompts: int, repeats: int = 7,
               data_file: str = "arithmetic.jsonl") -> dict[str, float]:
    """One thread: the HF forward over a batch of the task's prompts (fwd_s, its FLOPs) and a
    memcpy of the model's fp32 bytes (memcpy_s, sync_bytes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [json.loads(line)["prompt"] for line in (demo / data_file).read_text().splitlines()]
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
    p.add_argument("--workload", choices=list(WORKLOADS), default="demo")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the medians (start-up)")
    p.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    p.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    p.add_argument("--engines", nargs="+", default=["embedded", "inprocess"], choices=["embedded", "inprocess", "sglang"])
    p.add_argument("--out", default="runs/bench_step_overhead")
    p.add_argument("--demo-batch", action="store_true",
                   help="the demo config's batch (16 prompts x 16, 4 optimizer steps) instead of 8 x 16, one step")
    p.add_argument("--demo", default=None,
                   help="an existing directory of the workload's builder (make_demo_model.py or "
                        "make_reasoning_model.py; else built in OUT)")
    args = p.parse_args(argv)
    if args.steps <= args.skip:
        print(f"--steps ({args.steps}) must be > --skip ({args.skip})", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    _, builder, data_file = WORKLOADS[args.workload]
    demo = Path(args.demo).resolve() if args.demo else out / args.workload
    if not (demo / "model" / "config.json").is_file():
        subprocess.run([sys.executable, "-m", builder, "--out", str(demo)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    if not (demo / data_file).is_file():
        print(f"--demo {demo}: no {data_file} (not a {builder} directory for --workload {args.workload})",
              file=sys.stderr)
        return 2
    models = {"tiny": demo / "model"}
    if "small" in args.sizes:
        models["small"] = build_small(demo / "model", out / "small_model")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    work = {size: model_work(models[size], demo, 16 if args.demo_batch else PROMPTS_PER_STEP, data_file=data_file)
            for size in args.sizes}
    results = {}
    for size in args.sizes:
        for tp in args.tp:
            for engine in args.engines:
                rows = run_config(models[size], demo, tp, engine, args.steps, out / f"{size}_tp{tp}_{engine}",
                                  args.demo_batch, args.workload)
                results[(size, tp, engine)] = phase_medians(rows, args.skip)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for size in args.sizes:
        w = work[size]
        print(f"\n{size}: {w['params_m']:.2f} M params; model work per step: forward over {w['tokens']} prompt "
              f"tokens {w['fwd_s'] * 1e3:.1f} ms ({w['gflop']:.3f} GFLOP); sync {w['sync_mb']:.2f} MiB, "
              f"memcpy {w['memcpy_s'] * 1e3:.2f} ms")
    header = ("| model | tp | engine | step ms | response mean / max | generate ms | gen/fwd | gen ms per decode step "
              "| sync ms | sync/memcpy | train ms | logprob ms | rest ms | step vs first engine |")
    print(f"\nworkload: {args.workload}\n" + header + "\n" + "|---" * 14 + "|")
    for size in args.sizes:
        for tp in args.tp:
            base = results[(size, tp, args.engines[0])]["step"]
            for engine in args.engines:
                r, w = results[(size, tp, engine)], work[size]
                print(f"| {size} | {tp} | {engine} | {r['step'] * 1e3:.0f} | {r['len_mean']:.1f} / {r['len_max']:.0f} | "
                      f"{r['generate'] * 1e3:.1f} | {r['generate'] / w['fwd_s']:.1f}x | "
                      f"{r['gen_per_decode'] * 1e3:.1f} | {r['sync'] * 1e3:.1f} | {r['sync'] / w['memcpy_s']:.0f}x | "
                      f"{r['train'] * 1e3:.0f} | {r['logprob'] * 1e3:.0f} | {r['rest'] * 1e3:.1f} | "
                      f"{r['step'] / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
