"""Build the CPU demo's starting model and dataset (no downloads, ~30 s on 2 cores).

    python -m tools.make_demo_model --out runs/demo_cpu

writes ``OUT/model/`` (a tiny Qwen2-architecture HF checkpoint + tokenizer),
``OUT/arithmetic.jsonl`` (single-token addition problems, megatron_grpo.data.synthetic) and
``OUT/arithmetic_heldout.jsonl``: ``--held-out`` problems ``a + b`` (a > b) that training never
shows (their mirror ``b + a`` it does), the demo's ``eval`` set.

The model starts from random weights and gets a short supervised *format* warm-up: after
the chat prompt it learns to answer with ONE number drawn uniformly from the task's answer
range, then end the turn -- with the number chosen independently of the question. It thus
starts at chance (1/11 for sums of 0..5; the greedy accuracy it prints is chance level too)
and every bit of arithmetic it shows after GRPO was learned from the reward. (A randomly
initialised model would first have to find the answer format among 255 tokens, which makes
the demo much slower without teaching anything about GRPO.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

from megatron_grpo.data.synthetic import all_problems, generate, held_out_problems, write_jsonl

from tools.tiny import DEMO_ARCH, build_tokenizer, tiny_config
from tools.tiny import supervised_step

MAX_OPERAND = 5  # sums 0..10: 36 problems; a uniform guess scores 1/11, the best question-blind answer 1/6
HELD_OUT = 6  # of the 36, never trained on: the eval set


def format_warmup(model, tokenizer, prompts: list[str], answers: list[int], steps: int, seed: int) -> float:
    """Teach "<|assistant|> N <eos>" with N uniform over ``answers`` (question-blind).
    Returns the last loss."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    eos = tokenizer.eos_token_id
    loss = torch.tensor(0.0)
    for _ in range(steps):
        idx = torch.randint(len(prompts), (32,), generator=gen).tolist()
        guesses = torch.randint(len(answers), (32,), generator=gen).tolist()
        rows = []
        for i, g in zip(idx, guesses):
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompts[i]}],
                                                 add_generation_prompt=True, tokenize=False)
            prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            answer_ids = tokenizer(str(answers[g]), add_special_tokens=False)["input_ids"] + [eos]
            rows.append((prompt_ids, answer_ids))
        loss = supervised_step(model, opt, rows, tokenizer.pad_token_id)
    return float(loss)


@torch.no_grad()
def greedy_accuracy(model, tokenizer, problems: list[tuple[str, int]]) -> float:
    """Fraction of ``problems`` whose greedy first answer token is the right number."""
    right = 0
    for prompt, answer in problems:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=False)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        right += tokenizer.decode([int(model(input_ids=ids).logits[0, -1].argmax())]).strip() == str(answer)
    return right / len(problems)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="demo directory (model/ and arithmetic.jsonl are written)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-operand", type=int, default=MAX_OPERAND, help="operands are 0..N")
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--held-out", type=int, default=HELD_OUT, help="problems kept out of training for eval")
    parser.add_argument("--force", action="store_true", help="rebuild even if the files exist")
    args = parser.parse_args(argv)
    out = Path(args.out)
    model_dir, data_file, eval_file = out / "model", out / "arithmetic.jsonl", out / "arithmetic_heldout.jsonl"
    if (model_dir.joinpath("config.json").is_file() and data_file.is_file() and eval_file.is_file()
            and not args.force):
        print(f"demo model and data already in {out} (use --force to rebuild)")
        return 0

    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    config = tiny_config("qwen2", **DEMO_ARCH)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    problems = all_problems(args.max_operand, ["+"])
    prompts = [p for p, _ in problems]
    answer_range = sorted({a for _, a in problems})
    loss = format_warmup(model, tokenizer, prompts, answer_range, args.warmup_steps, args.seed)
    accuracy = greedy_accuracy(model, tokenizer, problems)

    tmp = model_dir.with_name(f".{model_dir.name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "demo_model.json").write_text(json.dumps({"warmup_steps": args.warmup_steps, "warmup_loss": loss,
                                                     "answer_range": [answer_range[0], answer_range[-1]],
                                                     "greedy_accuracy": accuracy}))
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)
    held_out = held_out_problems(args.max_operand, args.held_out, args.seed)
    write_jsonl(generate(2000, args.seed, args.max_operand, ("+",), exclude=frozenset(p for p, _ in held_out)),
                data_file)
    write_jsonl([{"prompt": p, "answer": str(a)} for p, a in held_out], eval_file)
    print(f"wrote {model_dir} (format warm-up loss {loss:.3f}; chance reward {1 / len(answer_range):.3f}, "
          f"greedy accuracy {accuracy:.3f}), "
          f"{data_file} and {eval_file} ({len(held_out)} held-out problems)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
