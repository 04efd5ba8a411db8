"""Greedy held-out accuracy of a Hugging Face model with plain transformers: the independent
check of a run's own evaluation.

    python -m tools.score_with_transformers --config yaml_configs/smollm2_135m_chain_sum_cpu.yaml \
        --model runs/smollm2_cpu/hf --set greedy [section.key=value ...]

The trainer evaluates through its rollout engine (the embedded engine's generation code); this
tool generates the same set's responses with ``transformers``' own ``generate`` (greedy, fp32,
no engine, no megatron) from the prompts exactly as the run renders them (the config's chat
template and system prompt), and grades them with the config's reward functions, deciding
"correct" as the run does (``eval.correct_function`` at ``eval.correct_threshold``). Only
greedy sets (``temperature: 0``) are scored: a sampled set's numbers depend on the sampler's
random stream. Prints one JSON line ``{"set", "num_prompts", "accuracy", "seconds"}`` (also
written to ``--out`` when given). Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from megatron_grpo.config import ConfigError
from megatron_grpo.data import load_prompt_dataset
from megatron_grpo.models.tokenizer import load_tokenizer
from megatron_grpo.preflight import load_experiment
from megatron_grpo.rewards import RewardScorer
from megatron_grpo.rewards.sample import RewardSample
from megatron_grpo.runtime.files import write_text_atomic


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids long[B, L], attention mask long[B, L]) of ``rows`` padded on the left to the longest."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


@torch.no_grad()
def greedy_responses(model, prompt_ids: list[list[int]], max_new_tokens: int, eos_ids: list[int], pad_id: int,
                     batch_size: int) -> list[list[int]]:
    """Each prompt's greedy continuation (token ids, cut after the first end-of-sequence id)."""
    out: list[list[int]] = []
    for start in range(0, len(prompt_ids), batch_size):
        ids, mask = (t.to(model.device) for t in left_pad(prompt_ids[start:start + batch_size], pad_id))
        generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                   do_sample=False, eos_token_id=eos_ids, pad_token_id=pad_id)
        for row in generated[:, ids.shape[1]:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
            out.append(row[:cut])
    return out


def correct_label(cfg, labels: list[str]) -> str:
    """The reward label that decides correctness (``eval.correct_function``, default the first)."""
    return cfg.eval.correct_function or labels[0]


def greedy_accuracy(model, tokenizer, cfg, eval_set, scorer: RewardScorer, batch_size: int) -> tuple[float, int]:
    """(accuracy, number of prompts) of ``model``'s greedy responses to ``eval_set`` (one of
    ``cfg.eval.sets``), rendered as the run renders them and graded by ``scorer`` (built from
    ``cfg.reward``) as the run decides "correct". Also the TRL side of
    ``tools/bench/bench_vs_trl.py --workload smollm2`` evaluates with this, inside its training."""
    prompts = load_prompt_dataset(cfg.data, tokenizer, path=eval_set.path).prompts[:eval_set.max_samples]
    eos_ids = sorted({int(i) for i in ([model.generation_config.eos_token_id] if isinstance(
        model.generation_config.eos_token_id, int) else model.generation_config.eos_token_id or [])}
                     | {int(tokenizer.eos_token_id)})
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    responses = greedy_responses(model, [p.prompt_ids for p in prompts],
                                 eval_set.max_new_tokens or cfg.rollout.max_new_tokens, eos_ids, pad_id, batch_size)
    samples = [RewardSample(prompt=p.text, response=tokenizer.decode(r, skip_special_tokens=True), answer=p.answer,
                            response_ids=r, prompt_ids=list(p.prompt_ids),
                            finish_reason="stop" if r and r[-1] in eos_ids else "length", row=p.fields)
               for p, r in zip(prompts, responses)]
    values = scorer.score_samples(samples).per_function[correct_label(cfg, scorer.labels)]
    return sum(v >= cfg.eval.correct_threshold for v in values) / len(values), len(prompts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the run's experiment YAML")
    p.add_argument("--model", required=True, type=Path, help="HF model directory (e.g. the run's export)")
    p.add_argument("--set", required=True, help="name of a greedy set in eval.sets")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    p.add_argument("overrides", nargs="*", help="section.key=value, as given to the run")
    args = p.parse_args(argv)
    try:
        cfg = load_experiment(args.config, args.overrides)
        chosen = [s for s in cfg.eval.sets if s.name == args.set]
        if not chosen:
            raise ConfigError("eval.sets", f"has no set named {args.set!r} (sets: "
                                           f"{', '.join(s.name for s in cfg.eval.sets) or 'none'})")
        eval_set = chosen[0]
        if eval_set.temperature != 0:
            raise ConfigError(f"eval.sets[{args.set}].temperature", "this tool scores greedy sets only (temperature 0)")
        if not (args.model / "config.json").is_file():
            raise ConfigError("--model", f"{args.model} is not a Hugging Face model directory (no config.json)")
    except ConfigError as e:
        print(f"score_with_transformers: error: {e}", file=sys.stderr)
        return 2
    # imported here: transformers' import is ~2 s, and the errors above need none of it
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    tokenizer = load_tokenizer(str(args.model))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    scorer = RewardScorer(cfg.reward)
    try:
        accuracy, num_prompts = greedy_accuracy(model, tokenizer, cfg, eval_set, scorer, args.batch_size)
    finally:
        scorer.close()
    line = {"set": eval_set.name, "num_prompts": num_prompts, "accuracy": accuracy,
            "seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(line), flush=True)
    if args.out is not None:
        write_text_atomic(args.out, json.dumps(line) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
