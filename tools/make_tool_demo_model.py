"""Build the tool demo's starting model and dataset (yaml_configs/demo_cpu_tools.yaml; no downloads, ~4 min).

    python -m tools.make_tool_demo_model --out runs/demo_cpu_tools

The task: ``what is a + b ?`` with a, b in 0..99 (answers 0..198, one token each): a guess is
right 1 time in ~199, so the tiny model cannot do these additions alone. The environment is
the built-in ``calculator``: a turn ``compute a + b`` is answered ``result s``; any other turn
is the final answer (reward 1 when its number is the row's answer).

The format warm-up teaches the call syntax and nothing about the answers. Of its rows,
``--tool-fraction`` are a tool episode, ``compute a + b <eos>``, the calculator's observation
(the chat template's user turn, rendered exactly as the episode loop renders it; not trained
on), then the number the calculator returned; the others are a question-blind guess, ``N <eos>``
with N uniform over 0..198. No row pairs a question with its answer without the tool, so the
model starts calling the tool in about ``--tool-fraction`` of its episodes and scores about
that; GRPO must learn that calling it pays (``multi_turn/turns_mean`` rises towards 2 with
the reward).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path

import torch

from megatron_grpo.data.synthetic import write_jsonl
from megatron_grpo.rollout.episodes.turns import TurnRenderer

from tools.tiny import DEMO_ARCH, build_tokenizer, tiny_config

MAX_OPERAND = 99


def problem(rng: random.Random) -> tuple[str, int, int]:
    a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    return f"what is {a} + {b} ?", a, b


def warmup_row(tokenizer, renderer: TurnRenderer, rng: random.Random, tool_fraction: float):
    """(ids, labels) of one warm-up row: a tool episode or a question-blind guess."""
    prompt, a, b = problem(rng)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id

    def words(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    labels = [-100] * len(ids)
    if rng.random() < tool_fraction:
        call = words(f"compute {a} + {b}") + [eos]
        observation = renderer.observation_ids(call, f"result {a + b}")
        final = words(str(a + b)) + [eos]  # copied from the observation
        return ids + call + observation + final, labels + call + [-100] * len(observation) + final
    guess = words(str(rng.randint(0, 2 * MAX_OPERAND))) + [eos]
    return ids + guess, labels + guess


def warmup(model, tokenizer, steps: int, tool_fraction: float, seed: int, lr: float = 3e-3) -> float:
    rng = random.Random(seed)
    renderer = TurnRenderer(tokenizer, "user")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        rows = [warmup_row(tokenizer, renderer, rng, tool_fraction) for _ in range(32)]
        width = max(len(i) for i, _ in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        for r, (i, lab) in enumerate(rows):
            ids[r, : len(i)] = torch.tensor(i)
            labels[r, : len(lab)] = torch.tensor(lab)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


@torch.no_grad()
def greedy_tool_episode(model, tokenizer, renderer: TurnRenderer, rng: random.Random, num: int) -> dict:
    """Greedy behaviour on ``num`` fresh problems: how often the first turn is an exact tool
    call (``compute a + b``) and how often the answer after the calculator's result is right."""
    calls = right = 0
    eos = tokenizer.eos_token_id

    def greedy(ids: list[int], limit: int) -> list[int]:
        out = []
        for _ in range(limit):
            token = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(token)
            if token == eos:
                break
        return out

    for _ in range(num):
        prompt, a, b = problem(rng)
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        call = tokenizer(f"compute {a} + {b}", add_special_tokens=False)["input_ids"] + [eos]
        first = greedy(ids, 5)
        calls += first == call
        observation = renderer.observation_ids(call, f"result {a + b}")
        final = greedy(ids + call + observation, 2)
        right += tokenizer.decode(final, skip_special_tokens=True).strip() == str(a + b)
    return {"greedy_tool_call_rate": calls / num, "greedy_answer_after_result": right / num}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="demo directory (model/ and additions.jsonl are written)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=1500)
    parser.add_argument("--tool-fraction", type=float, default=0.3,
                        help="share of warm-up rows that call the calculator (the rest guess)")
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="the warm-up's AdamW learning rate (the tests' shorter build uses 1e-3: at 3e-3 "
                             "its 800 steps learned the call on one software stack and never on a later one)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the files exist")
    args = parser.parse_args(argv)
    out = Path(args.out)
    model_dir, data_file = out / "model", out / "additions.jsonl"
    if model_dir.joinpath("config.json").is_file() and data_file.is_file() and not args.force:
        print(f"tool demo model and data already in {out} (use --force to rebuild)")
        return 0

    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    config = tiny_config("qwen2", **DEMO_ARCH)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    loss = warmup(model, tokenizer, args.warmup_steps, args.tool_fraction, args.seed, args.lr)
    stats = greedy_tool_episode(model, tokenizer, TurnRenderer(tokenizer, "user"), random.Random(args.seed + 1), 100)

    tmp = model_dir.with_name(f".{model_dir.name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "demo_model.json").write_text(json.dumps({"warmup_steps": args.warmup_steps, "warmup_lr": args.lr,
                                                     "warmup_loss": loss, "tool_fraction": args.tool_fraction,
                                                     **stats}))
    shutil.rmtree(model_dir, ignore_errors=True)
    tmp.rename(model_dir)
    rng = random.Random(args.seed + 2)
    rows = []
    for _ in range(2000):
        prompt, a, b = problem(rng)
        rows.append({"prompt": prompt, "answer": str(a + b)})
    write_jsonl(rows, data_file)
    print(f"wrote {model_dir} (warm-up loss {loss:.3f}; {json.dumps(stats)}) and {data_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
