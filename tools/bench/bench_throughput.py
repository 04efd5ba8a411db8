"""GRPO step throughput on a long-tailed multi-token task: sync vs one-step off-policy rollouts,
fixed vs token-budget micro-batches, in one run.

    python -m tools.bench.bench_throughput --steps 80 --seeds 1 2 --out runs/bench_throughput

The task (built locally, no downloads, into ``OUT/task/``): the CPU demo's addition problems
(``a + b``, operands 0..5, a uniform guess scores 1/11) with a *chain-of-thought-style*
response: filler words, then ``#### N``, then the end of turn. A short supervised *format*
warm-up (``--warmup-steps``) teaches a tiny Qwen2 that format with ``N`` drawn uniformly from
the answer range (question-blind: it starts at chance) and ``MIN_FILLER`` filler words plus
a geometric number more (stop probability 1 / ``FILLER_MEAN`` per word): responses of 8 to 128
tokens, most short, a few long (the shape of reasoning-length mixes). Only the number after ``####`` is rewarded
(``math_exact_match``), so GRPO has to learn the arithmetic while the lengths stay long-tailed.

Each configuration is one ``megatron-grpo train`` run of ``yaml_configs/demo_cpu.yaml`` with
the overrides in ``CONFIGS`` on top of ``COMMON`` (TP=1, 8 prompts x 8 generations, four
optimizer steps of 16 sequences per rollout batch, lr 1e-3, no entropy bonus, up to 128 new
tokens), run round robin over ``--seeds`` (all configurations for a seed, then the next seed)
so drifting machine load hits each alike; ``--configs`` runs a subset (ratios are to the first
given). A run whose directory holds a ``done`` marker is read, not run again.
Reported per configuration (mean over seeds): tokens/s of a GRPO step (prompt + response
tokens of the batch over ``time/step_s``, the first step excluded), the step time, the
padding fraction of the update, the step at which the ``--window``-step rolling mean reward
first reaches ``--target`` and the training time to it, and the ratios to the first
configuration. The load average (``os.getloadavg``) is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

from tools.bench.common import ROOT, fmt, reward_rows, run_records

MAX_OPERAND = 5
MIN_FILLER = 5  # + "####", the number and <eos>: at least 8 response tokens
FILLER_MEAN = 16.0  # 1 / the stop probability per filler word
MAX_NEW_TOKENS = 128
COMMON = [
    "parallel.tp=1", "parallel.world_size=1", "parallel.global_batch_size=16", "optimizer.lr=1.0e-3",
    # the demo's entropy bonus (0.05 of a token mean) outweighs one rewarded token among ~20
    # filler tokens: in a trial run its earlier 0.02 already drove the policy to uniform
    "algorithm.entropy_coef=0.0",
    "rollout.prompts_per_step=8", "rollout.num_generations=8", f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
    "eval.sets=[]", "checkpoint.save_every=0", "checkpoint.resume=never",
    "engine.kind=embedded",  # the launched engine, as the measurements in the docs were taken
    "logging.progress_bar=false", "logging.plot=false",
]
FIXED = ["parallel.micro_batch_size=8", "parallel.max_tokens_per_microbatch=null"]
BUDGET = ["parallel.micro_batch_size=8", "parallel.max_tokens_per_microbatch=1024"]
CONFIGS: dict[str, list[str]] = {
    "sync, fixed": ["rollout.mode=sync", *FIXED],
    "off-policy, fixed": ["rollout.mode=one_step_off_policy", *FIXED],
    "sync, budget": ["rollout.mode=sync", *BUDGET],
    "off-policy, budget": ["rollout.mode=one_step_off_policy", *BUDGET],
}


def filler_length(rng: random.Random) -> int:
    """Filler words of one warm-up response: MIN_FILLER, then one more word while a draw says go
    on (stop probability 1 / FILLER_MEAN per word: mean FILLER_MEAN - 1 extra words), capped so
    the response (filler, ``####``, number, <eos>) fits MAX_NEW_TOKENS."""
    k = MIN_FILLER
    while rng.random() > 1.0 / FILLER_MEAN and k < MAX_NEW_TOKENS - 3:
        k += 1
    return k


def warmup_response(rng: random.Random, words: list[str], answers: list[int]) -> str:
    """One question-blind format example: filler words, ``####`` and a uniform answer."""
    filler = " ".join(rng.choice(words) for _ in range(filler_length(rng)))
    return f"{filler} #### {rng.choice(answers)}"


def build_task(out: Path, steps: int, seed: int) -> Path:
    """Write ``out/model`` (warmed-up tiny Qwen2) and ``out/train.jsonl``; returns ``out``."""
    if (out / "model" / "config.json").is_file() and (out / "train.jsonl").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_grpo.data.synthetic import all_problems, generate, write_jsonl
    from tools.tiny import DEMO_ARCH, WORDS, build_tokenizer, tiny_config
    from tools.tiny import supervised_step

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_config(
        tiny_config("qwen2", **DEMO_ARCH),
        dtype=torch.float32)
    problems = all_problems(MAX_OPERAND, ["+"])
    answers = sorted({a for _, a in problems})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        rows = []
        for prompt, _ in rng.choices(problems, k=16):
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=False)
            p = tok(text, add_special_tokens=False)["input_ids"]
            r = tok(warmup_response(rng, WORDS, answers), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            rows.append((p, r))
        loss = supervised_step(model, opt, rows, tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".model.tmp.{os.getpid()}"
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out / "model")
    write_jsonl(generate(2000, seed, MAX_OPERAND, ("+",)), out / "train.jsonl")
    print(f"built {out}: format warm-up loss {float(loss):.3f}", flush=True)
    return out


def summarize(rows: list[dict], window: int, target: float) -> dict:
    """One run's metrics.jsonl rows (those with ``reward_mean``) -> the table's numbers."""
    timed = rows[1:]  # step 1 pays one-off start-up costs (and generates in order when off-policy)
    hit = next((i for i in range(window - 1, len(rows))
                if statistics.fmean(r["reward_mean"] for r in rows[i - window + 1:i + 1]) >= target), None)
    return {
        "tokens_per_s": statistics.fmean(r["num_sequence_tokens"] / r["time/step_s"] for r in timed),
        "step_s": statistics.fmean(r["time/step_s"] for r in timed),
        "padding": statistics.fmean(r["padding_fraction"] for r in rows),
        "response_mean": statistics.fmean(r["response_length_mean"] for r in rows),
        "response_max": max(r["response_length_max"] for r in rows),
        "hit_step": None if hit is None else rows[hit]["step"],
        "s_to_target": None if hit is None else rows[hit]["train_elapsed_s"],
        "final_reward": statistics.fmean(r["reward_mean"] for r in rows[-window:]),
    }


def mean_or_none(values: list) -> float | None:
    """Mean over seeds; None when some seed never reached the target (no honest mean)."""
    return None if not values or None in values else statistics.fmean(values)


def run(name: str, seed: int, steps: int, task: Path, out: Path) -> list[dict]:
    run_dir = out / f"{name.replace(', ', '_').replace('-', '')}_s{seed}"
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "train", "--config", str(ROOT / "yaml_configs/demo_cpu.yaml"),
           *COMMON, *CONFIGS[name], f"model.hf_dir={task}/model", f"data.train_file={task}/train.jsonl",
           f"trainer.seed={seed}", f"trainer.num_steps={steps}", f"trainer.run_dir={run_dir}"]
    if not (run_dir / "done").exists():
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       stdout=subprocess.DEVNULL)
        (run_dir / "done").write_text(" ".join(cmd) + "\n")
    return reward_rows(run_records(run_dir))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=80, help="rollout steps per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                   help="configurations to run; ratios are to the first")
    p.add_argument("--target", type=float, default=0.15, help="rolling mean reward to reach (chance: 1/11)")
    p.add_argument("--window", type=int, default=10, help="steps in the rolling mean")
    p.add_argument("--warmup-steps", type=int, default=150, help="format warm-up steps of the task's model")
    p.add_argument("--out", default=str(ROOT / "runs/bench_throughput"))
    args = p.parse_args()
    if args.steps <= args.window:
        p.error(f"--steps must exceed --window ({args.window}), got {args.steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    task = build_task(out / "task", args.warmup_steps, seed=0)
    print("load average before: %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    results: dict[str, list[dict]] = {name: [] for name in args.configs}
    for seed in args.seeds:  # round robin: every configuration for one seed, then the next seed
        for name in args.configs:
            results[name].append(summarize(run(name, seed, args.steps, task, out), args.window, args.target))
            print(f"{name}, seed {seed}: done; load average %.2f %.2f %.2f" % os.getloadavg(), flush=True)
    print("load average after: %.2f %.2f %.2f" % os.getloadavg())

    base = results[args.configs[0]]
    base_tps = statistics.fmean(r["tokens_per_s"] for r in base)
    base_hit = mean_or_none([r["s_to_target"] for r in base])
    print(f"\n{args.steps} steps x seeds {args.seeds}; target: {args.window}-step rolling mean reward >= {args.target}\n")
    print("| configuration | tokens/s | x | s / step | padding | response mean / max | step reaching target | "
          f"s to target | x | reward, last {args.window} |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        tps = statistics.fmean(r["tokens_per_s"] for r in runs)
        hit_s = mean_or_none([r["s_to_target"] for r in runs])
        speed = fmt(None if hit_s is None or base_hit is None else base_hit / hit_s, ".2f", "never")
        print(f"| {name} | {tps:.0f} | {tps / base_tps:.2f} | {statistics.fmean(r['step_s'] for r in runs):.2f} | "
              f"{statistics.fmean(r['padding'] for r in runs):.2f} | "
              f"{statistics.fmean(r['response_mean'] for r in runs):.1f} / {max(r['response_max'] for r in runs):.0f} | "
              f"{fmt(mean_or_none([r['hit_step'] for r in runs]), '.0f', 'never')} | {fmt(hit_s, '.0f', 'never')} | {speed} | "
              f"{statistics.fmean(r['final_reward'] for r in runs):.2f} |")
    print("\nPer seed (tokens/s, step reaching target, final reward):")
    for name, runs in results.items():
        print(f"  {name}: " + "; ".join(f"{r['tokens_per_s']:.0f}, {fmt(r['hit_step'], '.0f', 'never')}, "
                                         f"{r['final_reward']:.2f}" for r in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
