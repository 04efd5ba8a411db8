"""TRL's side of ``tools/bench/bench_vs_trl.py``: train the same model on the same prompts with TRL's
``GRPOTrainer`` and write one JSON line per rollout batch (mean reward, wall clock).

Run by ``bench_vs_trl.py`` with the interpreter of a separate virtual environment that has
``trl`` (``bash tools/bench/setup_trl_venv.sh``); not meant to be run by hand. It imports
megatron-grpo only for what must be identical on both sides: the tokenizer as its files
describe it, the prompts (chat template applied exactly as the trainer does) and the
reward function.

    PY -m tools.bench.bench_trl_worker --model DIR --data FILE --batches N --out FILE [--seed S] [--in-order]
        [--stop-after M]
    PY -m tools.bench.bench_trl_worker --config YAML [--set KEY=VALUE ...] --grpo-args JSON --out FILE
        [--in-order] [--stop-after M] [--evaluate --save-model DIR] [--our-prompt-order]

The first form is the CPU demo (its hyper-parameters are this script's flags). The second
trains any config ``bench_vs_trl.trl_grpo_args`` can map (``--workload reasoning``): it loads
the config with the trainer's own ``load_config`` and the same overrides as our side, takes
the model, its dtype, the prompts and the reward from it (the trainer's ``RewardScorer`` on
the config's ``reward:`` section), and ``GRPOConfig(**JSON)`` for the rest. The log's first
line names the files the reward code was imported from, which the bench checks are its
checkout's (run with that checkout first on ``PYTHONPATH``). A reward function sees each
response with its prompt's whole row (``RewardSample.row``), as in the trainer.

``--evaluate`` (``--workload smollm2``) evaluates the config's greedy held-out sets in this
process, as the trainer does in its run: before training when ``eval.at_start``, then after
each rollout batch ``eval.due`` names, with ``tools/score_with_transformers.py``'s
``greedy_accuracy`` (transformers' greedy ``generate`` on the same prompt ids, the same reward
and "correct"). Its training clock then starts at TRL's ``on_train_begin`` and leaves the
evaluations out, as the trainer's ``train_elapsed_s`` does; each evaluation is a log line
``{"eval_step", "set", "accuracy", "num_prompts", "train_s"}``. ``--save-model DIR`` writes the
trained model (and the tokenizer's files) as a Hugging Face folder for the bench to re-score.

``--our-prompt-order``: TRL's dataset holds the prompts in the trainer's sampler order for the
config's seed (``bench_vs_trl.our_order``: the trainer's ``PromptSampler`` itself, epoch after
epoch as far as the run reaches) and its shuffle is off, so its rollout batch k holds the
prompts of our step k.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

# Both sides get the machine's cores: torch reads this before it starts its thread pool.
os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.trainer import grpo_trainer as trl_grpo_module

from megatron_grpo.config import ExperimentConfig, load_config
from megatron_grpo.config.sections import DataConfig
from megatron_grpo.data import load_prompt_dataset
from megatron_grpo.models.tokenizer import load_tokenizer
from megatron_grpo.rewards import RewardScorer, math_exact_match
from megatron_grpo.rewards.sample import RewardSample

from tools.bench.bench_vs_trl import TrainClock, our_order, truncated_of
from tools.score_with_transformers import greedy_accuracy

DTYPES = {"float32": torch.float32, "bfloat16": torch.float32}
"""Our model.dtype -> the dtype TRL's model is loaded in (bf16: fp32 weights, GRPOConfig.bf16 autocasts)."""
EVAL_BATCH_SIZE = 32
"""Prompts per greedy ``generate`` call of an evaluation (tools/score_with_transformers.py's default)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""Files copied beside ``--save-model``'s weights: the tokenizer exactly as the run read it."""


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


class HeldOutEval(TrainerCallback):
    """Starts ``clock`` when TRL's training begins, and calls ``evaluate(batch, model)`` after
    each rollout batch (``steps_per_batch`` of TRL's optimizer steps, its ``global_step``)."""

    def __init__(self, evaluate, steps_per_batch: int, clock: TrainClock):
        self.evaluate, self.steps_per_batch, self.clock = evaluate, steps_per_batch, clock

    def on_train_begin(self, args, state, control, **_):
        self.clock.start()

    def on_step_end(self, args, state, control, model=None, **_):
        if state.global_step % self.steps_per_batch == 0:
            self.evaluate(state.global_step // self.steps_per_batch, model)


def held_out_evaluator(cfg, tokenizer, scorer: RewardScorer, clock: TrainClock, write):
    """``evaluate(step, model)``: the greedy accuracy of every ``cfg.eval.sets`` entry when
    ``cfg.eval`` has one due after ``step`` (0: the start), written as a log line; its time is
    left off ``clock``."""
    for s in cfg.eval.sets:
        if s.temperature != 0 or s.n != 1:
            raise SystemExit(f"bench_trl_worker: eval.sets[{s.name}]: --evaluate scores greedy sets "
                             f"(temperature 0, n 1); got temperature {s.temperature}, n {s.n}")

    def evaluate(step: int, model) -> None:
        due = cfg.eval.at_start if step == 0 else cfg.eval.due(step, cfg.trainer.num_steps)
        if not due:
            return
        train_s, started = clock(), time.monotonic()
        model.eval()
        for s in cfg.eval.sets:
            accuracy, num_prompts = greedy_accuracy(model, tokenizer, cfg, s, scorer, EVAL_BATCH_SIZE)
            write({"eval_step": step, "set": s.name, "accuracy": accuracy, "num_prompts": num_prompts,
                   "train_s": round(train_s, 3)})
        model.train()
        clock.exclude(time.monotonic() - started)

    return evaluate


def save_model(model, model_dir: str, out_dir: Path) -> None:
    """``model``'s weights and config as a Hugging Face folder, with ``model_dir``'s tokenizer files."""
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (Path(model_dir) / name).is_file():
            shutil.copy2(Path(model_dir) / name, out_dir / name)


@dataclass(kw_only=True)
class Setup:
    """What one form of the worker trains: the model, prompts, TRL's config and the scoring."""

    model_dir: str
    prompts: list
    """The training ``Prompt``s, tokenized by our loader."""
    config: GRPOConfig
    dtype: torch.dtype
    """The dtype TRL's model is loaded in."""
    score: Callable[[list[str], list], list[float]]
    """(completions, their prompts) -> rewards."""
    code: dict
    """Reward label -> the file its function was imported from."""
    cfg: Optional[ExperimentConfig] = None
    """Our config (the config form)."""
    scorer: Optional[RewardScorer] = None
    """The trainer's scorer built from ``cfg.reward`` (the config form)."""


def source_file(fn) -> str:
    """The file a reward function, or the class of a callable reward object, was imported from."""
    return inspect.getsourcefile(fn if inspect.isroutine(fn) else type(fn))


def demo_setup(args) -> Setup:
    """The demo's (its settings are the flags)."""
    tokenizer = load_tokenizer(args.model)
    prompts = load_prompt_dataset(DataConfig(train_file=args.data), tokenizer).prompts
    return Setup(model_dir=args.model, prompts=prompts, config=trl_config(args, str(Path(args.out).parent / "trl_out")),
                 dtype=torch.float32, score=lambda completions, rows: [
                     math_exact_match(c, p.answer) for c, p in zip(completions, rows)],
                 code={"math_exact_match": inspect.getsourcefile(math_exact_match)})


def config_setup(args) -> Setup:
    """From our config (``--config``, ``--set``) and the mapped ``--grpo-args``; the scoring is
    the trainer's ``RewardScorer`` on the config's ``reward:`` section."""
    cfg = load_config(args.config, args.sets)
    tokenizer = load_tokenizer(cfg.model.hf_dir)
    prompts = load_prompt_dataset(cfg.data, tokenizer).prompts
    scorer = RewardScorer(cfg.reward)
    grpo_args = json.loads(Path(args.grpo_args).read_text())
    if not grpo_args["use_cpu"] and not torch.cuda.is_available():
        raise SystemExit("bench_trl_worker: the GRPO arguments ask for a GPU but this python's torch sees no CUDA "
                         f"({torch.__version__}); accepted: a TRL venv with CUDA torch, or --device cpu")
    config = GRPOConfig(output_dir=str(Path(args.out).parent / "trl_out"), **grpo_args)
    return Setup(model_dir=cfg.model.hf_dir, prompts=prompts, config=config, dtype=DTYPES[cfg.model.dtype],
                 score=lambda completions, rows: scorer.score_samples(samples_of(completions, rows)).rewards,
                 code={f.label: source_file(f.call.fn) for f in scorer.functions}, cfg=cfg, scorer=scorer)


def samples_of(completions: list[str], prompts: list) -> list[RewardSample]:
    """What the trainer's reward functions see of TRL's decoded completions of ``prompts``."""
    return [RewardSample(prompt=p.text, response=c, answer=p.answer, prompt_ids=list(p.prompt_ids), row=p.fields)
            for c, p in zip(completions, prompts)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="our experiment YAML (with --grpo-args); replaces the demo flags")
    p.add_argument("--set", dest="sets", action="append", default=[], help="override of --config (repeatable)")
    p.add_argument("--grpo-args", default=None, help="JSON of GRPOConfig keyword arguments (bench_vs_trl.trl_grpo_args)")
    p.add_argument("--evaluate", action="store_true",
                   help="evaluate --config's greedy eval.sets at its eval steps (training clock without them)")
    p.add_argument("--save-model", default=None, help="write the trained model here as a Hugging Face folder")
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
    p.add_argument("--our-prompt-order", action="store_true",
                   help="--config: take the prompts in the trainer's sampler order for the seed (TRL's shuffle off)")
    p.add_argument("--in-order", action="store_true",
                   help="split each rollout batch into optimizer steps in generation order (whole prompt "
                        "groups per step, as megatron-grpo does) instead of TRL's shuffle")
    args = p.parse_args()
    if (args.config is None) != (args.grpo_args is None) or (args.config is None and None in (
            args.model, args.data, args.batches)):
        p.error("give --config with --grpo-args, or the demo's --model, --data and --batches")
    if args.evaluate and args.config is None:
        p.error("--evaluate: the held-out sets are --config's eval.sets; accepted with --config")
    if args.our_prompt_order and args.config is None:
        p.error("--our-prompt-order: the order is --config's sampler's; accepted with --config")
    return args


def steps_per_batch(config: GRPOConfig) -> int:
    """TRL's optimizer steps (its ``global_step``) per rollout batch."""
    return config.steps_per_generation // config.gradient_accumulation_steps


def check_tokenization(tokenizer, prompts: list, model_dir: str) -> None:
    """TRL tokenizes the prompt text again (``processing_class(text=prompts)``, special tokens
    added as the tokenizer adds them): it must give the trainer's ids."""
    for pr in prompts[:4]:
        if tokenizer(text=[pr.text])["input_ids"][0] != pr.prompt_ids:
            raise SystemExit(f"{model_dir}: TRL would tokenize prompt {pr.index} differently")


def main() -> None:
    args = parse_args()
    if args.in_order:  # TRL shuffles the rollout batch before splitting it into optimizer steps
        trl_grpo_module.shuffle_sequence_dict = lambda batch: batch
    setup = (demo_setup if args.config is None else config_setup)(args)
    config = setup.config
    tokenizer = load_tokenizer(setup.model_dir)
    check_tokenization(tokenizer, setup.prompts, setup.model_dir)
    # the reward looks each completion's prompt up by position: its row goes to the reward functions
    order = range(len(setup.prompts))
    if args.our_prompt_order:  # TRL's batch k is then our step k's prompts, as its sampler keeps the order
        order = our_order(setup.cfg, setup.prompts, config.max_steps // steps_per_batch(config))
        config.shuffle_dataset = False
    dataset = Dataset.from_list([{"prompt": setup.prompts[i].text, "prompt_index": i} for i in order])

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.open("w")

    def write(record: dict) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    write({"reward_code": setup.code, "python": sys.executable})
    clock = TrainClock()
    if not args.evaluate:
        clock.start()  # the other workloads' clock: from before TRL builds its model and trainer

    over = setup.cfg.rollout.overlong if setup.cfg is not None else None
    stop_ids = {tokenizer.eos_token_id}  # what TRL's generation stops on

    def reward(completions, prompt_index, completion_ids=None, **_):
        # called once per rollout batch, right after generation: the batch's clock tick
        rewards = setup.score(completions, [setup.prompts[i] for i in prompt_index])
        if over is not None and over.truncated_reward is not None:  # as rollout.overlong.truncated_reward
            cut = truncated_of(completion_ids, setup.cfg.rollout.max_new_tokens, stop_ids)
            rewards = [over.truncated_reward if c else r for r, c in zip(rewards, cut)]
        reward.calls += 1
        write({"batch": reward.calls, "reward_mean": sum(rewards) / len(rewards), "wall_s": clock()})
        return rewards

    reward.calls = 0
    torch.manual_seed(config.seed)
    model = AutoModelForCausalLM.from_pretrained(setup.model_dir, dtype=setup.dtype)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    if args.evaluate:
        evaluate = held_out_evaluator(setup.cfg, tokenizer, setup.scorer, clock, write)
        evaluate(0, trainer.model)  # the starting weights, on the trainer's device
        trainer.add_callback(HeldOutEval(evaluate, steps_per_batch(config), clock))
    if args.stop_after is not None:
        trainer.add_callback(StopAfter(args.stop_after * steps_per_batch(config)))
    trainer.train()
    wall_s = clock()
    if args.save_model is not None:  # before "done": the bench reads a run back only when it is complete
        save_model(trainer.accelerator.unwrap_model(trainer.model), setup.model_dir, Path(args.save_model))
    write({"done": True, "wall_s": wall_s})
    log.close()
    if setup.scorer is not None:
        setup.scorer.close()


if __name__ == "__main__":
    main()
