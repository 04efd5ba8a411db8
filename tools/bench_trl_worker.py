"""TRL's side of ``tools/bench_vs_trl.py``: train the same model on the same prompts with TRL's
``GRPOTrainer`` and write one JSON line per rollout batch (mean reward, wall clock).

Run by ``bench_vs_trl.py`` with the interpreter of a separate virtual environment that has
``trl`` (``bash tools/setup_trl_venv.sh``); not meant to be run by hand. It imports
megatron-grpo only for what must be identical on both sides: the tokenizer as its files
describe it, the prompts (chat template applied exactly as the trainer does) and the
reward function.

    PY tools/bench_trl_worker.py --model DIR --data FILE --batches N --out FILE [--seed S] [--in-order]
        [--stop-after M]
    PY tools/bench_trl_worker.py --config YAML [--set KEY=VALUE ...] --grpo-args JSON --out FILE
        [--in-order] [--stop-after M]

The first form is the CPU demo (its hyper-parameters are this script's flags). The second
trains any config ``bench_vs_trl.trl_grpo_args`` can map (``--workload reasoning``): it loads
the config with the trainer's own ``load_config`` and the same overrides as our side, takes
the model, its dtype, the prompts and the reward from it (the trainer's ``RewardScorer`` on
the config's ``reward:`` section), and ``GRPOConfig(**JSON)`` for the rest. The log's first
line names the files the reward code was imported from, which the bench checks are its
checkout's (run with that checkout first on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path

# Both sides get the machine's cores: torch reads this before it starts its thread pool.
os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer import grpo_trainer as trl_grpo_module  # noqa: E402

from megatron_grpo.config import load_config  # noqa: E402
from megatron_grpo.config.sections import DataConfig  # noqa: E402
from megatron_grpo.data import load_prompt_dataset  # noqa: E402
from megatron_grpo.models.tokenizer import load_tokenizer  # noqa: E402
from megatron_grpo.rewards import RewardScorer, math_exact_match  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.float32}
"""Our model.dtype -> the dtype TRL's model is loaded in (bf16: fp32 weights, GRPOConfig.bf16 autocasts)."""


def trl_config(args, out_dir: str) -> GRPOConfig:
    """The demo's hyper-parameters in TRL's terms (the bench's table names each departure).
    One rollout batch = prompts x generations completions = ``steps_per_generation``
    optimizer steps of ``global_batch`` sequences, as the trainer's ``global_batch_size``."""
    opt_steps_per_batch = args.prompts * args.generations // args.global_batch
    return GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=args.global_batch,
        gradient_accumulation_steps=1,
        steps_per_generation=opt_steps_per_batch,
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": args.min_lr},
        warmup_steps=args.warmup,
        max_steps=args.batches * opt_steps_per_batch,
        max_grad_norm=1.0,
        weight_decay=0.0,
        adam_epsilon=1e-8,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",  # token mean over the optimizer step's sequences, as loss_reduction: token_mean
        scale_rewards="group",
        entropy_coef=args.entropy_coef,
        num_iterations=1,
        seed=args.seed,
        use_cpu=True,
        bf16=False,
        logging_steps=10**9,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


class StopAfter(TrainerCallback):
    """Stop training after ``steps`` optimizer steps (the schedule keeps its full length)."""

    def __init__(self, steps: int):
        self.steps = steps

    def on_step_end(self, args, state, control, **_):
        if state.global_step >= self.steps:
            control.should_training_stop = True
        return control


def demo_setup(args) -> tuple[str, list, GRPOConfig, torch.dtype, callable, dict]:
    """The demo's model dir, prompts, GRPOConfig, dtype, scoring and reward code (from the flags)."""
    tokenizer = load_tokenizer(args.model)
    prompts = load_prompt_dataset(DataConfig(train_file=args.data), tokenizer).prompts
    score = lambda completions, answers: [math_exact_match(c, a) for c, a in zip(completions, answers)]  # noqa: E731
    code = {"math_exact_match": inspect.getsourcefile(math_exact_match)}
    return args.model, prompts, trl_config(args, str(Path(args.out).parent / "trl_out")), torch.float32, score, code


def config_setup(args) -> tuple[str, list, GRPOConfig, torch.dtype, callable, dict]:
    """The same from our config (``--config``, ``--set``) and the mapped ``--grpo-args``."""
    cfg = load_config(args.config, args.sets)
    tokenizer = load_tokenizer(cfg.model.hf_dir)
    prompts = load_prompt_dataset(cfg.data, tokenizer).prompts
    scorer = RewardScorer(cfg.reward)
    score = lambda completions, answers: scorer.score(completions, answers).rewards  # noqa: E731
    code = {f.label: inspect.getsourcefile(f.call.fn) for f in scorer.functions}
    grpo_args = json.loads(Path(args.grpo_args).read_text())
    if not grpo_args["use_cpu"] and not torch.cuda.is_available():
        raise SystemExit("bench_trl_worker: the GRPO arguments ask for a GPU but this python's torch sees no CUDA "
                         f"({torch.__version__}); accepted: a TRL venv with CUDA torch, or --device cpu")
    config = GRPOConfig(output_dir=str(Path(args.out).parent / "trl_out"), **grpo_args)
    return cfg.model.hf_dir, prompts, config, DTYPES[cfg.model.dtype], score, code


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="our experiment YAML (with --grpo-args); replaces the demo flags")
    p.add_argument("--set", dest="sets", action="append", default=[], help="override of --config (repeatable)")
    p.add_argument("--grpo-args", default=None, help="JSON of GRPOConfig keyword arguments (bench_vs_trl.trl_grpo_args)")
    p.add_argument("--model")
    p.add_argument("--data")
    p.add_argument("--out", required=True)
    p.add_argument("--batches", type=int)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=16)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=1)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--min-lr", type=float, default=5e-5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--entropy-coef", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many rollout batches (the lr schedule still spans --batches)")
    p.add_argument("--in-order", action="store_true",
                   help="split each rollout batch into optimizer steps in generation order (whole prompt "
                        "groups per step, as megatron-grpo does) instead of TRL's shuffle")
    args = p.parse_args()
    if (args.config is None) != (args.grpo_args is None) or (args.config is None and None in (
            args.model, args.data, args.batches)):
        p.error("give --config with --grpo-args, or the demo's --model, --data and --batches")
    if args.in_order:  # TRL shuffles the rollout batch before splitting it into optimizer steps
        trl_grpo_module.shuffle_sequence_dict = lambda batch: batch

    model_dir, prompts, config, dtype, score, code = (demo_setup if args.config is None else config_setup)(args)
    tokenizer = load_tokenizer(model_dir)
    for pr in prompts[:4]:  # TRL tokenizes the text again: it must give the trainer's ids
        ids = tokenizer(pr.text, add_special_tokens=False)["input_ids"]
        if ids != pr.prompt_ids:
            raise SystemExit(f"{model_dir}: TRL would tokenize prompt {pr.index} differently")
    dataset = Dataset.from_list([{"prompt": pr.text, "answer": pr.answer} for pr in prompts])

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.open("w")
    log.write(json.dumps({"reward_code": code, "python": sys.executable}) + "\n")
    t0 = time.monotonic()

    def reward(completions, answer, **_):
        # called once per rollout batch, right after generation: the batch's clock tick
        rewards = score(completions, answer)
        log.write(json.dumps({"batch": reward.calls + 1, "reward_mean": sum(rewards) / len(rewards),
                              "wall_s": time.monotonic() - t0}) + "\n")
        log.flush()
        reward.calls += 1
        return rewards

    reward.calls = 0
    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    if args.stop_after is not None:  # optimizer steps: TRL's global_step
        trainer.add_callback(StopAfter(args.stop_after * config.steps_per_generation
                                       // config.gradient_accumulation_steps))
    trainer.train()
    log.write(json.dumps({"done": True, "wall_s": time.monotonic() - t0}) + "\n")
    log.close()


if __name__ == "__main__":
    main()
