"""Build the CPU reasoning workload: a small model that adds multi-digit numbers with a
written-out chain of thought, part-trained so that GRPO has something to learn.

    python -m tools.make_reasoning_model --out runs/reasoning_cpu

writes ``OUT/model/`` (a Qwen2-architecture HF checkpoint + tokenizer), ``OUT/train.jsonl``
(training-split problems, ``megatron_grpo.data.reasoning``) and ``OUT/heldout.jsonl``
(held-out-split problems: operand pairs that neither the warm-up nor training ever shows), the
``eval`` set of ``yaml_configs/reasoning_cpu.yaml``.

The model starts from random weights and gets a supervised warm-up on worked chains of
training-split problems (``7 + 8 + 0 = 15 write 5 carry 1 , ... #### 5 2 5``), stopped after
``--warmup-steps`` steps, well before it has learned the task: it then writes the format
reliably but slips on some columns, so that sampled at temperature 1 it solves about a
fifth of the problems (measured with the defaults: 0.22 on both splits; the short ones most
often, those of 5+ digits never). The script measures that starting point
the way GRPO sees it, by sampling (``--probe`` problems of each split, one sample each at
temperature 1), and prints it with the response-length distribution.

The tokenizer is the project's tiny word-level one (every integer 0..199 one token) plus the
words of the format it lacks (``write``, ``carry``: ``megatron_grpo.data.reasoning.WORDS``).
Everything is seeded (``--seed``) and runs on one thread: the same seed builds the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from megatron_grpo.data.reasoning import WORDS, AdditionTask, generate, write_jsonl
from megatron_grpo.rewards.builtin import math_exact_match

from tools.tiny import build_tokenizer, tiny_config
from tools.tiny import supervised_step


def reasoning_tokenizer():
    """The tiny tokenizer with the format's words added (each one token)."""
    tokenizer = build_tokenizer()
    vocab = tokenizer.get_vocab()
    tokenizer.add_tokens([w for w in WORDS if w not in vocab])
    return tokenizer


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def warmup(model, tokenizer, rows: list[dict], *, steps: int, batch_size: int, lr: float, seed: int,
           log_every: int = 0) -> float:
    """``steps`` optimizer steps of next-token loss on the worked chains of ``rows`` (batches
    drawn with replacement, seeded); returns the mean loss of the last 20 steps."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    eos = tokenizer.eos_token_id
    encoded = [(chat_prompt_ids(tokenizer, r["prompt"]),
                tokenizer(r["chain"], add_special_tokens=False)["input_ids"] + [eos]) for r in rows]
    losses = []
    start = time.monotonic()
    for step in range(1, steps + 1):
        idx = torch.randint(len(encoded), (batch_size,), generator=gen).tolist()
        losses.append(float(supervised_step(model, opt, [encoded[i] for i in idx], tokenizer.pad_token_id)))
        if log_every and step % log_every == 0:
            print(f"  warm-up step {step}: loss {statistics.mean(losses[-log_every:]):.3f} "
                  f"({time.monotonic() - start:.0f} s)", flush=True)
    return statistics.mean(losses[-20:])


@torch.no_grad()
def sample_responses(model, tokenizer, prompts: list[str], *, max_new_tokens: int, temperature: float,
                     seed: int, batch_size: int = 64) -> list[list[int]]:
    """One response (token ids, EOS excluded) per prompt, sampled at ``temperature`` with no
    top-k/top-p, as the rollout engine samples for GRPO."""
    torch.manual_seed(seed)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out = []
    for lo in range(0, len(prompts), batch_size):
        batch = [chat_prompt_ids(tokenizer, p) for p in prompts[lo:lo + batch_size]]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])  # left-padded
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                             top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, eos_token_id=eos,
                             pad_token_id=pad)
        for row in gen[:, width:].tolist():
            out.append(row[:row.index(eos)] if eos in row else [t for t in row if t != pad])
    return out


def sampled_accuracy(model, tokenizer, rows: list[dict], *, max_new_tokens: int, seed: int) -> dict:
    """Pass@1 at temperature 1 (one sample each) by the workload's reward, with the response
    lengths and pass@1 by operand length (short: <= 4 digits)."""
    responses = sample_responses(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens=max_new_tokens,
                                 temperature=1.0, seed=seed)
    right = [math_exact_match(tokenizer.decode(ids, skip_special_tokens=True), r["answer"], use_last_number=False)
             for ids, r in zip(responses, rows)]
    short = [x for x, r in zip(right, rows) if r["digits"] <= 4]
    long = [x for x, r in zip(right, rows) if r["digits"] > 4]
    lengths = sorted(len(ids) + 1 for ids in responses)  # + the EOS
    return {"pass@1": statistics.mean(right), "pass@1_short": statistics.mean(short) if short else None,
            "pass@1_long": statistics.mean(long) if long else None,
            "length_mean": statistics.mean(lengths), "length_p50": lengths[len(lengths) // 2],
            "length_p90": lengths[int(0.9 * len(lengths))], "length_max": lengths[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="workload directory (model/, train.jsonl, heldout.jsonl)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128, help="hidden size")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--warmup-steps", type=int, default=800, help="supervised steps (stopped early on purpose)")
    parser.add_argument("--warmup-lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-digits", type=int, default=AdditionTask.max_digits)
    parser.add_argument("--num-train", type=int, default=4000, help="training-split problems written")
    parser.add_argument("--num-heldout", type=int, default=64, help="held-out problems written (the eval set)")
    parser.add_argument("--probe", type=int, default=128,
                        help="problems of each split sampled to measure the starting pass@1 (0: skip)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--force", action="store_true", help="rebuild even if the files exist")
    args = parser.parse_args(argv)
    out = Path(args.out)
    model_dir, train_file, eval_file = out / "model", out / "train.jsonl", out / "heldout.jsonl"
    if model_dir.joinpath("config.json").is_file() and train_file.is_file() and eval_file.is_file() \
            and not args.force:
        print(f"reasoning model and data already in {out} (use --force to rebuild)")
        return 0

    from transformers import AutoModelForCausalLM  # here: --help and the already-built exit skip its import (5.5 s measured, loaded machine)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    task = AdditionTask(max_digits=args.max_digits)
    train_rows = generate(args.num_train, args.seed, task)
    heldout_rows = generate(args.num_heldout, args.seed + 1, task, held_out=True)
    tokenizer = reasoning_tokenizer()
    config = tiny_config("qwen2", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_layers=args.layers, num_heads=4, num_kv_heads=2, vocab_size=len(tokenizer))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    start = time.monotonic()
    loss = warmup(model, tokenizer, train_rows, steps=args.warmup_steps, batch_size=args.batch_size,
                  lr=args.warmup_lr, seed=args.seed, log_every=100)
    warmup_s = time.monotonic() - start
    print(f"warm-up: {args.warmup_steps} steps in {warmup_s:.0f} s, final loss {loss:.3f}", flush=True)

    report: dict = {"warmup_steps": args.warmup_steps, "warmup_loss": loss, "warmup_s": round(warmup_s, 1)}
    if args.probe:
        model.eval()
        probe_train = generate(args.probe, args.seed + 2, task)
        for split, rows in (("train", probe_train), ("heldout", heldout_rows[:args.probe])):
            acc = sampled_accuracy(model, tokenizer, rows, max_new_tokens=args.max_new_tokens, seed=args.seed)
            report[split] = acc
            by_length = ", ".join(f"{name} {acc[key]:.3f}" for name, key in
                                  (("<= 4 digits", "pass@1_short"), ("longer", "pass@1_long")) if acc[key] is not None)
            print(f"starting pass@1 ({split} split, {len(rows)} problems, temperature 1): {acc['pass@1']:.3f} "
                  f"({by_length}); response tokens "
                  f"mean {acc['length_mean']:.0f}, p50 {acc['length_p50']}, p90 {acc['length_p90']}, "
                  f"max {acc['length_max']}", flush=True)

    tmp = model_dir.with_name(f".{model_dir.name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "reasoning_model.json").write_text(json.dumps(report, indent=1))
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)
    write_jsonl([{k: r[k] for k in ("prompt", "answer", "digits")} for r in train_rows], train_file)
    write_jsonl([{k: r[k] for k in ("prompt", "answer", "digits")} for r in heldout_rows], eval_file)
    print(f"wrote {model_dir}, {train_file} ({len(train_rows)} problems) and {eval_file} "
          f"({len(heldout_rows)} held-out problems)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
