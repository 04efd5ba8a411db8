"""megatron-grpo vs TRL's GRPOTrainer: wall time per rollout batch and time to a reward.

    bash tools/bench/setup_trl_venv.sh                     # once: .venv-trl with torch 2.13.0 + trl
    python -m tools.bench.bench_vs_trl [--batches 150] [--seeds 1234 1235] [--tp 1 2] [--engines embedded inprocess]
    python -m tools.bench.bench_vs_trl --workload reasoning [--device cuda] [--set rollout.max_new_tokens=64 ...]
    python -m tools.bench.bench_vs_trl --workload smollm2 [--seeds 1 2 3] [--ours-batches 80] [--skip-trl] [--heldout-rows N]

Both sides train the CPU demo's model (``tools/make_demo_model.py``: a tiny Qwen2 at chance
on single-token addition) on the same prompts with the same hyper-parameters: 16 prompts x
16 generations per rollout batch, 4 optimizer steps of 64 sequences per batch, Adam lr 5e-4
(5 warm-up steps, cosine to 5e-5), clip 0.2/0.28, token-mean loss, entropy bonus 0.02, no KL,
group-normalised advantages. megatron-grpo runs ``yaml_configs/demo_cpu.yaml`` (TP ranks over
gloo) at each ``--tp`` with each ``--engines`` (embedded: the engine in its own process, the
default; inprocess: in trainer rank 0's process); TRL runs in one process
with both cores (``--trl-threads``; ``tools/bench/bench_trl_worker.py``, in ``.venv-trl``), generating with
``model.generate`` between optimizer steps.

Reported per run (median over ``--seeds``): wall seconds per rollout batch (the median gap
between consecutive batches, start-up and the first batch excluded), the batch at which the
``--window``-batch rolling mean reward first reaches ``--target``, and the wall time from the
first batch to that one; then the ratio of each megatron-grpo run to TRL. Where our step's
time goes is printed from the trainer's own ``time/*_s`` metrics. Every departure between the
two setups is listed in docs/benchmarks.md#departures-the-cpu-demo.

``--workload reasoning`` trains the reasoning workload instead (``tools/make_reasoning_model.py``:
multi-digit addition with a written-out chain of thought, responses of tens of tokens) with
``yaml_configs/reasoning_cpu.yaml``'s hyper-parameters on both sides: the TRL side gets its
``GRPOConfig`` from that same config, loaded by the trainer's own ``load_config`` and mapped by
``trl_grpo_args`` (which refuses what it cannot map), and scores with the trainer's
``RewardScorer`` built from the config's ``reward:`` section, imported from this checkout
(the worker's log names the file, and the run stops if it is another copy). ``--set KEY=VALUE``
overrides the config for both sides. ``reasoning_departures`` lists what still differs; it is
printed, written to the summary and pinned to docs/benchmarks.md by a test.

``--workload smollm2`` trains a real pretrained model, SmolLM2-135M-Instruct, on reasoning-gym's
chain_sum as ``launch/smollm2_cpu.sh`` does (``yaml_configs/smollm2_135m_chain_sum_cpu.yaml``:
ours DP2 with the in-process engine, 40 rollout batches; TRL mapped and scored as for
``reasoning``), and measures held-out greedy accuracy against training seconds: both sides
evaluate the config's greedy set on the 200 held-out problems at the start, every
``eval_every`` batches and at the end (ours on its engine in training, TRL in its process with
``tools/score_with_transformers.py``'s ``greedy_accuracy``; neither clock counts evaluations),
then both final models are re-scored by ``tools/score_with_transformers.py``. Per seed and the
median: each side's accuracy at the start and the end, its training seconds, and the seconds at
which ours reaches TRL's re-scored final accuracy as a fraction of TRL's training seconds.
``smollm2_departures`` lists what differs, like ``reasoning_departures``. ``--ours-batches N``
trains our side for N rollout batches against TRL's ``--batches`` (the time ours takes to reach
TRL's final accuracy, past TRL's length; a listed departure), and ``--skip-trl`` runs our side
alone and prints its held-out curve per seed.

``--device cuda`` runs both sides on GPU 0 (our side at TP=1; with the launched embedded engine
the weights go over ``sync.transport=tensor``, as ``tools/bench/gpu_smoke.py`` does;
TRL's model on cuda); ``--device cpu`` hides any GPU from both. Every run writes a JSON summary
(``--json``, default ``OUT/summary.json``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_grpo.config import ExperimentConfig, load_config
from megatron_grpo.data import PromptDataset, PromptSampler

from tools.bench.common import ROOT, fmt, reward_rows, run_records

EXIT_NO_CUDA = 2


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What both sides train: our config, the tools that build its model and prompts, and the
    reward target that fits it."""

    config: str
    """Our experiment YAML, relative to the repository root."""

    build: tuple[tuple[str, ...], ...]
    """Commands writing ``DIR/model`` and ``DIR/<train_file>``: each a script (relative to the
    repository root) and its arguments, ``{out}`` standing for DIR."""

    train_file: str
    """File name of the training prompts in the built directory."""

    target: float
    """Default ``--target``: the rolling mean training reward to reach."""

    window: int
    """Default ``--window``: batches in that rolling mean."""

    micro_batch_size: int | None
    """Default ``--micro-batch-size`` (None: the config's)."""

    batches: int = 150
    """Default ``--batches``."""

    dp: int = 1
    """Data-parallel ranks of our side: its world size is TP x dp."""

    engine: str = "embedded"
    """Default ``--engines``."""

    heldout_file: str | None = None
    """Held-out prompts in the built directory. When set, both sides evaluate them greedily
    (``HELDOUT_SET``) at the start, every ``eval_every`` rollout batches and at the end, and both
    final models are re-scored by tools/score_with_transformers.py; None: neither evaluates."""

    eval_every: int = 0
    """``eval.every_n_steps`` of both sides with ``heldout_file`` (0: start and end only)."""

    our_prompt_order: bool = False
    """TRL takes the prompts in our sampler's order for the seed (its dataset written in that
    order, its shuffle off: the worker's ``--our-prompt-order``), so both sides train on the same
    prompts batch for batch; False: each side shuffles with its own generator."""


HELDOUT_SET = "greedy"
"""Name of the held-out set both sides evaluate (temperature 0, one response a prompt)."""

CHAIN_SUM_DATA = ("--task", "chain_sum", "--size", "2000", "--heldout", "200", "--seed", "0", "--split", "natural",
                  "--task-config", '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}',
                  "--prompt-template", "plain")
"""tools/make_reasoning_gym_data.py's arguments in launch/smollm2_cpu.sh (a test checks they agree)."""

WORKLOADS = {
    # chance is 0.09; 16 prompts x 16 per batch
    "demo": Workload(config="yaml_configs/demo_cpu.yaml", build=(("tools.make_demo_model", "--out", "{out}"),),
                     train_file="arithmetic.jsonl", target=0.5, window=10, micro_batch_size=64),
    # the warm-up starts near 0.3 on the training split and the 20-step mean of docs/reasoning.md's
    # 150-step run ranges 0.30-0.35: 16 prompts a batch make the training reward noisy, so the
    # window is wide and the target the top of that range
    "reasoning": Workload(config="yaml_configs/reasoning_cpu.yaml",
                          build=(("tools.make_reasoning_model", "--out", "{out}"),),
                          train_file="train.jsonl", target=0.35, window=20, micro_batch_size=None),
    # SmolLM2-135M-Instruct on chain_sum, as launch/smollm2_cpu.sh: DP2 with the in-process engine,
    # its 40 steps; the measure is held-out greedy accuracy (0.170 for the base model), the
    # rolling training reward (4 prompts x 8 a batch) only a side figure
    "smollm2": Workload(config="yaml_configs/smollm2_135m_chain_sum_cpu.yaml",
                        build=(("tools.fetch_smollm2", "--out", "{out}/model"),
                               ("tools.make_reasoning_gym_data", *CHAIN_SUM_DATA, "--out", "{out}")),
                        train_file="train.jsonl", target=0.5, window=10, micro_batch_size=None, batches=40, dp=2,
                        engine="inprocess", heldout_file="heldout.jsonl", eval_every=10, our_prompt_order=True),
}


class TrainClock:
    """Seconds of training (the TRL worker's clock): from ``start()``, less the evaluations given
    to ``exclude`` once it has started. An evaluation before the start (the starting weights')
    is not training time to take off: subtracting it put every batch of the first run of the
    smollm2 workload ~175 s below zero."""

    def __init__(self):
        self.started_at: float | None = None
        self.excluded_s = 0.0

    def start(self) -> None:
        self.started_at = time.monotonic()

    def exclude(self, seconds: float) -> None:
        if self.started_at is not None:
            self.excluded_s += seconds

    def __call__(self) -> float:
        return 0.0 if self.started_at is None else time.monotonic() - self.started_at - self.excluded_s


def our_order(cfg: ExperimentConfig, prompts: list, batches: int) -> list[int]:
    """The indices of ``prompts`` in the order the trainer's ``PromptSampler`` hands them out
    for ``cfg``'s seed over ``batches`` rollout batches (the sampler itself: epoch after epoch,
    each reshuffled)."""
    sampler = PromptSampler(PromptDataset(prompts, "order"), cfg.rollout.prompts_per_step, cfg.trainer.seed,
                            cfg.data.shuffle)
    return [i for _ in range(batches) for i in sampler.next_indices()]


def truncated_of(completion_ids: list[list[int]], max_new_tokens: int, stop_ids: set[int]) -> list[bool]:
    """Which of TRL's completions its generation cut at ``max_new_tokens`` (our engine's finish
    reason ``length``): as long as the cap and not ending on a stop token. TRL hands a reward
    function each completion's ids up to its first EOS, included. E.g. cap 3, stop {2}:
    [[5, 6, 7], [5, 6, 2], [5, 2]] -> [True, False, False]."""
    return [len(ids) >= max_new_tokens and (not ids or ids[-1] not in stop_ids) for ids in completion_ids]


def rolling_hit(rewards: list[float], window: int, target: float) -> int | None:
    """Index (0-based) of the first batch whose trailing ``window``-batch mean reward is >=
    ``target``; None when never."""
    for i in range(window - 1, len(rewards)):
        if sum(rewards[i - window + 1:i + 1]) / window >= target:
            return i
    return None


def summarize(walls: list[float], rewards: list[float], window: int, target: float) -> dict:
    """walls[i]: wall clock (s) at batch i's rollout; rewards[i]: its mean reward."""
    gaps = [b - a for a, b in zip(walls[1:], walls[2:])]  # batch 1 pays one-off start-up costs
    hit = rolling_hit(rewards, window, target)
    return {
        "s_per_batch": statistics.median(gaps) if gaps else float("nan"),
        "hit_batch": None if hit is None else hit + 1,
        "s_to_target": None if hit is None else walls[hit] - walls[0],
        "final_reward": sum(rewards[-window:]) / min(window, len(rewards)),
    }


def heldout_overrides(wl: Workload, data_dir: Path, rows: int | None) -> list[str]:
    """Both sides' held-out evaluation: only the greedy set, on the built held-out file (its first
    ``rows`` prompts; None: all), every ``wl.eval_every`` batches. [] without ``heldout_file``."""
    if wl.heldout_file is None:
        return []
    greedy = {"name": HELDOUT_SET, "path": str(data_dir / wl.heldout_file), "n": 1, "temperature": 0.0,
              "max_samples": rows}
    return [f"eval.sets={json.dumps([greedy])}", "eval.pass_k=[1]", f"eval.every_n_steps={wl.eval_every}",
            "eval.at_start=true", "eval.at_end=true"]


def shared_overrides(workload: str, data_dir: Path, *, batches: int, seed: int, mbs: int | None,
                     sets: list[str], heldout_rows: int | None = None) -> list[str]:
    """Overrides of the workload's config that both sides read (the TRL side through
    ``trl_grpo_args`` and its worker's ``load_config``); ``sets``: the user's ``--set``, last."""
    wl = WORKLOADS[workload]
    overrides = [f"model.hf_dir={data_dir}/model", f"data.train_file={data_dir}/{wl.train_file}",
                 f"trainer.num_steps={batches}", f"trainer.seed={seed}",
                 *([] if mbs is None else [f"parallel.micro_batch_size={mbs}"]),
                 *heldout_overrides(wl, data_dir, heldout_rows)]
    if workload == "demo":
        # the TRL worker's demo schedule (its --lr / --min-lr defaults); the demo itself now runs
        # 2e-4 (yaml_configs/demo_cpu.yaml), and both sides must share one
        overrides += ["optimizer.lr=5.0e-4", "optimizer.min_lr=5.0e-5",
                      # the TRL worker's entropy bonus (its --entropy-coef default); the demo's is 0.05 now
                      "algorithm.entropy_coef=0.02"]
    return overrides + list(sets)


def ours_overrides(shared: list[str], *, run_dir: Path, tp: int, shuffled: bool, engine: str,
                   device: str, dp: int = 1, evaluate: bool = False) -> list[str]:
    """Our run's overrides: the shared ones, then this run's layout (``tp`` x ``dp`` ranks) and
    bookkeeping. Without ``evaluate`` it evaluates no held-out set (TRL's run has none); the
    checkpoint is the last step's only."""
    overrides = [
        *shared, f"trainer.run_dir={run_dir}", f"parallel.tp={tp}", f"parallel.world_size={tp * dp}",
        *([] if evaluate else ["eval.sets=[]"]),
        "checkpoint.save_every=0", "checkpoint.resume=never", "logging.progress_bar=false", "logging.plot=false",
        f"algorithm.shuffle_mini_batches={str(shuffled).lower()}", f"engine.kind={engine}",
    ]
    if device == "cuda" and engine == "embedded":
        # the launched engine shares the trainer's GPU: CUDA IPC, as tools/bench/gpu_smoke.py; the
        # distributed transport would put two NCCL ranks on one GPU (refused by the preflight)
        overrides.append("sync.transport=tensor")
    return overrides


def device_env(device: str, threads: int) -> dict:
    """A side's environment: this checkout first on PYTHONPATH (both sides run its code),
    ``threads`` OpenMP threads, and no GPU in sight for ``--device cpu``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


LR_SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine_with_min_lr", "linear": "linear"}
"""Our ``optimizer.lr_decay_style`` -> transformers' ``lr_scheduler_type`` (warm-up included)."""


def trl_grpo_args(cfg: ExperimentConfig, *, batches: int, device: str) -> dict:
    """Keyword arguments of TRL's ``GRPOConfig`` (less ``output_dir``) that train as ``cfg``
    does for ``batches`` rollout batches. TRL's micro-batch is ``parallel.micro_batch_size``
    sequences, accumulated to ``parallel.global_batch_size`` per optimizer step; a rollout
    batch of ``prompts_per_step * num_generations`` is ``steps_per_generation`` micro-batches.
    ValueError, one line naming the key, for a setting TRL cannot be given here."""
    r, a, o, par = cfg.rollout, cfg.algorithm, cfg.optimizer, cfg.parallel
    unsupported = {
        "algorithm.advantage_estimator": (a.advantage_estimator, "grpo"),
        "algorithm.policy_loss_type": (a.policy_loss_type, "ppo"),
        "algorithm.loss_reduction": (a.loss_reduction, "token_mean"),
        "algorithm.kl_loss_coef": (a.kl_loss_coef, 0.0),
        "algorithm.entropy_coef_end": (a.entropy_coef_end, None),  # TRL's bonus is constant
        "algorithm.clip_ratio_c": (a.clip_ratio_c, None),
        "optimizer.name": (o.name, "adam"),
        "rollout.mode": (r.mode, "sync"),
        "rollout.top_p": (r.top_p, 1.0),
        "rollout.top_k": (r.top_k, -1),
        "rollout.min_p": (r.min_p, 0.0),
        "rollout.dynamic_sampling.enabled": (r.dynamic_sampling.enabled, False),
        "rollout.overlong.buffer_length": (r.overlong.buffer_length, None),
        "rollout.overlong.filter": (r.overlong.filter, False),
        "model.dtype": (cfg.model.dtype in ("float32", "bfloat16"), True),
    }
    for key, (value, accepted) in unsupported.items():
        if value != accepted:
            raise ValueError(f"{key}: {value!r} has no mapping to TRL's GRPOConfig here; accepted: {accepted!r}")
    if o.lr_decay_style == "linear" and o.min_lr != 0:
        raise ValueError(f"optimizer.min_lr: {o.min_lr} with lr_decay_style linear; TRL's linear schedule "
                         "ends at 0, accepted: 0 (or constant / cosine)")
    rollout_batch = r.prompts_per_step * r.num_generations
    mbs, gbs = par.micro_batch_size, par.global_batch_size
    assert rollout_batch % gbs == 0 and gbs % mbs == 0, "load_config checks both"
    args = dict(
        per_device_train_batch_size=mbs,
        gradient_accumulation_steps=gbs // mbs,
        steps_per_generation=rollout_batch // mbs,
        num_generations=r.num_generations,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_k=0,  # TRL's "off" (ours: -1)
        top_p=1.0,
        learning_rate=o.lr,
        lr_scheduler_type=LR_SCHEDULES[o.lr_decay_style],
        warmup_steps=o.lr_warmup_steps,
        max_steps=batches * (rollout_batch // gbs),
        max_grad_norm=o.clip_grad,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_epsilon=o.adam_eps,
        beta=0.0,  # no KL term (kl_loss_coef 0, checked above)
        epsilon=a.eps_clip_low,
        epsilon_high=a.eps_clip_high,
        loss_type="dapo",  # token mean over the optimizer step's sequences, as loss_reduction: token_mean
        scale_rewards="group",  # (r - mean) / std per prompt group, as advantage_estimator: grpo
        mask_truncated_completions=False,  # no overlong filter (checked above)
        entropy_coef=a.entropy_coef,
        num_iterations=a.num_iterations,
        seed=cfg.trainer.seed,
        use_cpu=device == "cpu",
        bf16=cfg.model.dtype == "bfloat16",
        gradient_checkpointing=cfg.model.recompute_activations,  # TRL's default is True
        logging_steps=10**9,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if o.lr_decay_style == "cosine":
        args["lr_scheduler_kwargs"] = {"min_lr": o.min_lr}
    return args


GENERATION = ("Generation: TRL calls model.generate on each rollout batch inside its training process "
              "(padded, until the longest response ends); ours samples on the engine of --engines "
              "(continuous batching) and syncs the weights into it every batch.")
MICRO_BATCHES = ("Micro-batches: ours cuts each optimizer step into length-sorted micro-batches of at most "
                 "parallel.micro_batch_size sequences and parallel.max_tokens_per_microbatch tokens (with "
                 "parallel.pack_sequences, rows packed without padding; with parallel.share_prefix, each "
                 "group's prompt run once); TRL into fixed micro-batches of parallel.micro_batch_size "
                 "sequences padded to their longest. The gradient is the same; the work is not.")
TOKEN_MEAN = ("Token-mean normaliser: ours divides an optimizer step's summed token loss by that step's "
              "own response tokens; TRL's dapo divides by the rollout batch's response tokens over its "
              "optimizer steps per batch, so with responses of unequal length a step of longer "
              "responses weighs more on TRL's side.")
MINI_BATCH_ORDER = ("Mini-batch order: TRL shuffles each rollout batch across its optimizer steps; ours cuts "
                    "it in generation order (algorithm.shuffle_mini_batches: false) unless --ours-shuffled.")
WARM_UP = ("Warm-up: ours trains optimizer step k (from 0) at lr (k+1)/lr_warmup_steps of the peak; "
           "transformers' schedule at k/lr_warmup_steps, so TRL's first step has lr 0 and its "
           "warm-up ends one step later.")
ADVANTAGES = "Advantages: the std epsilon is 1e-6 on ours and 1e-4 on TRL's."
PROMPT_ORDER = ("Prompt order: each side shuffles the prompts with its own generator from the same seed "
                "number, so the batches hold different prompts.")
SKIPPED_STEPS = ("Steps without signal: ours skips the optimizer step of a rollout batch whose every group "
                 "scored alike (algorithm.skip_zero_advantage_steps); TRL takes it with a zero loss, and "
                 "Adam's momentum still moves the weights.")


def config_departures(cfg: ExperimentConfig, device: str) -> list[str]:
    """The departures that follow from ``cfg``'s precision and correction and from ``device``."""
    out = []
    if cfg.algorithm.off_policy_correction.tis_ratio_type is not None:
        out.append("Off-policy correction: ours applies the config's TIS "
                   f"({cfg.algorithm.off_policy_correction.tis_ratio_type}); TRL applies none without "
                   "vLLM. In fp32 the ratios are 1 within 1e-6, so it is close to a no-op.")
    if cfg.model.dtype == "bfloat16":
        out.append("bf16: ours keeps bf16 parameters with fp32 main weights (megatron-core); TRL "
                   "autocasts fp32 weights to bf16 (bf16=True).")
    if device == "cuda":
        out.append("GPU: both sides share one GPU; ours at TP=1, a launched embedded engine on the same "
                   "GPU receiving the weights over CUDA IPC (sync.transport: tensor).")
    return out


def reasoning_departures(cfg: ExperimentConfig, device: str) -> list[str]:
    """Every way the two sides of ``--workload reasoning`` still differ with ``cfg``, one
    sentence each (printed, written to the summary, and listed in docs/benchmarks.md)."""
    return [
        GENERATION,
        "Processes: TRL runs one process with --trl-threads torch threads; ours runs TP trainer "
        "ranks with one thread each (plus the engine's process with the embedded engine).",
        MICRO_BATCHES, TOKEN_MEAN, MINI_BATCH_ORDER, WARM_UP, ADVANTAGES, PROMPT_ORDER,
        "No held-out evaluation on either side (ours runs with eval.sets=[]): the target is on "
        "the training reward, which docs/reasoning.md shows moves little in 150 steps.",
        *config_departures(cfg, device),
    ]


def smollm2_departures(cfg: ExperimentConfig, device: str) -> list[str]:
    """The same for ``--workload smollm2``: what differs between the two sides, including how
    each evaluates held-out accuracy and counts training time."""
    r, par = cfg.rollout, cfg.parallel
    one_step = r.prompts_per_step * r.num_generations == par.global_batch_size  # no order, one normaliser
    return [
        GENERATION,
        "Processes: TRL runs one process with --trl-threads torch threads; ours runs "
        "parallel.world_size data-parallel ranks with one thread each, each taking an equal share of every "
        "optimizer step's sequences; the in-process engine generates in rank 0's process, the embedded "
        "one in its own.",
        MICRO_BATCHES,
        *([] if one_step else [TOKEN_MEAN, MINI_BATCH_ORDER]),
        *([WARM_UP] if cfg.optimizer.lr_warmup_steps else []),
        ADVANTAGES,
        *([] if WORKLOADS["smollm2"].our_prompt_order else [PROMPT_ORDER]),
        *([SKIPPED_STEPS] if cfg.algorithm.skip_zero_advantage_steps else []),
        "Held-out evaluation: ours generates the greedy set on its rollout engine; TRL with "
        "transformers' model.generate in its training process (left-padded batches of 32, the "
        "code of tools/score_with_transformers.py). Both final models are re-scored by that tool, "
        "the yardstick of the comparison.",
        "Training clock: ours is train_elapsed_s, from the first step's start; TRL's from its "
        "trainer's on_train_begin. Neither counts start-up (model load, engine start, TRL's "
        "trainer construction), evaluations or the final save.",
        *config_departures(cfg, device),
    ]


def length_departures(args: argparse.Namespace) -> list[str]:
    """With --ours-batches: the two sides train for different numbers of rollout batches."""
    if args.ours_batches == args.batches:
        return []
    return [f"Length: ours trains {args.ours_batches} rollout batches, TRL {args.batches} (--ours-batches): the "
            "measure is the training seconds ours takes to reach TRL's final accuracy; TRL's curve past its "
            f"{args.batches} batches is not measured. Ours' first {min(args.batches, args.ours_batches)} batches "
            "are the same prompts as TRL's (the sampler's order continues epoch after epoch)."]


DEPARTURES = {"reasoning": reasoning_departures, "smollm2": smollm2_departures}
"""Workloads whose TRL side is mapped from our config -> the departures they list."""


def run_ours(tp: int, mbs: int | None, seed: int, batches: int, data_dir: Path, out: Path,
             reuse: bool = False, shuffled: bool = False, engine: str = "embedded", *,
             workload: str = "demo", device: str = "cpu", sets: list[str] = (),
             heldout_rows: int | None = None, trl_batches: int | None = None) -> tuple[dict, dict, Path]:
    """Our side's run: (walls and rewards per batch, median seconds per step of each ``time/*_s``
    metric, the run directory). A run of another length than TRL's ``trl_batches``
    (``--ours-batches``) gets a directory of its own."""
    wl = WORKLOADS[workload]
    tag = "" if engine == "embedded" else f"_{engine}"  # the embedded runs keep their directories (--reuse)
    prefix = "" if workload == "demo" else f"{workload}_"
    tag += "" if device == "cpu" else f"_{device}"
    tag += "" if batches == trl_batches or trl_batches is None else f"_b{batches}"  # --ours-batches: its own (--reuse)
    run_dir = out / f"{prefix}ours_tp{tp}_mbs{mbs or 'cfg'}_seed{seed}{'_shuffled' if shuffled else ''}{tag}"
    shared = shared_overrides(workload, data_dir, batches=batches, seed=seed, mbs=mbs, sets=sets,
                              heldout_rows=heldout_rows)
    overrides = ours_overrides(shared, run_dir=run_dir, tp=tp, shuffled=shuffled, engine=engine, device=device,
                               dp=wl.dp, evaluate=wl.heldout_file is not None)
    rows = reward_rows(run_records(run_dir)) if reuse else []
    if not rows or rows[-1]["step"] != batches:
        subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "train", "--config",
                        str(ROOT / wl.config), *overrides],
                       check=True, cwd=ROOT, env=device_env(device, 1), stdout=subprocess.DEVNULL)
        rows = reward_rows(run_records(run_dir))
    times = {k: statistics.median(r[k] for r in rows[1:]) for k in rows[-1]
             if k.startswith("time") and k.endswith("_s") and all(k in r for r in rows[1:])}
    return {"walls": [r["train_elapsed_s"] for r in rows], "rewards": [r["reward_mean"] for r in rows]}, times, run_dir


def trl_log_dir(out: Path, seed: int, in_order: bool, workload: str, device: str) -> Path:
    """Where a TRL run writes its log (``batches.jsonl``), GRPO arguments and model."""
    prefix = "" if workload == "demo" else f"{workload}_"
    tag = "" if device == "cpu" else f"_{device}"
    return out / f"{prefix}trl{'_inorder' if in_order else ''}_seed{seed}{tag}"


def trl_command(log: Path, *, workload: str, seed: int, batches: int, data_dir: Path, device: str,
                mbs: int | None, sets: list[str], heldout_rows: int | None) -> list[str]:
    """The worker's arguments but for --in-order and --stop-after: the demo's flags, or our
    config with the shared overrides and the mapped GRPOConfig (written beside the log), and
    with a held-out set, its evaluation and the trained model's folder (``LOG_DIR/hf``)."""
    if workload == "demo":
        return ["--model", f"{data_dir}/model", "--data", f"{data_dir}/arithmetic.jsonl", "--batches", str(batches),
                "--seed", str(seed), "--out", str(log)]
    # the worker reads our config, as the trainer does, and trains with the mapped GRPOConfig
    shared = shared_overrides(workload, data_dir, batches=batches, seed=seed, mbs=mbs, sets=sets,
                              heldout_rows=heldout_rows)
    cfg = load_config(ROOT / WORKLOADS[workload].config, shared)
    args_file = log.parent / "grpo_args.json"
    args_file.write_text(json.dumps(trl_grpo_args(cfg, batches=batches, device=device), indent=1) + "\n")
    evaluate = ["--evaluate", "--save-model", str(log.parent / "hf")] if WORKLOADS[workload].heldout_file else []
    order = ["--our-prompt-order"] if WORKLOADS[workload].our_prompt_order else []
    return ["--config", str(ROOT / WORKLOADS[workload].config), *(f"--set={o}" for o in shared),
            "--grpo-args", str(args_file), "--out", str(log), *evaluate, *order]


def run_trl(python: str, threads: int, seed: int, batches: int, data_dir: Path, out: Path,
            in_order: bool = False, reuse: bool = False, stop_after: int | None = None, *,
            workload: str = "demo", device: str = "cpu", mbs: int | None = None, sets: list[str] = (),
            heldout_rows: int | None = None) -> tuple[dict, list[dict]]:
    """TRL's side's run: (walls and rewards per batch, every line of its log)."""
    log = trl_log_dir(out, seed, in_order, workload, device) / "batches.jsonl"
    done = reuse and log.exists() and any('"done"' in line for line in log.read_text().splitlines())
    if not done:
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [*trl_command(log, workload=workload, seed=seed, batches=batches, data_dir=data_dir, device=device,
                            mbs=mbs, sets=sets, heldout_rows=heldout_rows),
               *(["--in-order"] if in_order else []),
               *([] if stop_after is None else ["--stop-after", str(stop_after)])]
        stderr = log.parent / "worker.log"
        with open(stderr, "w") as err:
            proc = subprocess.run([python, "-m", "tools.bench.bench_trl_worker", *cmd], cwd=ROOT,
                                  env=device_env(device, threads), stdout=err, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            tail = " | ".join(stderr.read_text().strip().splitlines()[-2:])
            raise SystemExit(f"TRL worker exited {proc.returncode} ({stderr}): {tail[-600:]}")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    code = next((r for r in lines if "reward_code" in r), None)
    if code is not None and not all(Path(f).resolve().is_relative_to(ROOT) for f in code["reward_code"].values()):
        raise SystemExit(f"{log}: the TRL worker scored with {code['reward_code']}, not this checkout's ({ROOT})")
    rows = [r for r in lines if "batch" in r]
    return {"walls": [r["wall_s"] for r in rows], "rewards": [r["reward_mean"] for r in rows]}, lines


def export_ours(run_dir: Path, reuse: bool = False) -> Path:
    """Our run's last checkpoint as a Hugging Face folder, ``RUN_DIR/hf`` (as launch/smollm2_cpu.sh)."""
    hf = run_dir / "hf"
    if not (reuse and (hf / "config.json").is_file()):
        checkpoints = run_dir / "checkpoints"
        subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "convert-megatron-to-hf", "--ckpt-dir",
                        str(checkpoints / (checkpoints / "latest").read_text().strip()), "--output-dir", str(hf),
                        "--overwrite"], check=True, cwd=ROOT, env=device_env("cpu", 2), stdout=subprocess.DEVNULL)
    return hf


def rescore(model_dir: Path, config: str, shared: list[str], reuse: bool = False) -> float:
    """Held-out greedy accuracy of the Hugging Face folder ``model_dir`` by
    tools/score_with_transformers.py (the one grader of both sides' final models), on two
    threads; written beside the folder as ``transformers_greedy.json``."""
    result = model_dir.parent / "transformers_greedy.json"
    if not (reuse and result.is_file()):
        subprocess.run([sys.executable, "-m", "tools.score_with_transformers", "--config", str(ROOT / config),
                        "--model", str(model_dir), "--set", HELDOUT_SET, "--out", str(result), *shared],
                       check=True, cwd=ROOT, env=device_env("cpu", 2), stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())["accuracy"]


def ours_heldout_curve(metrics: list[dict]) -> list[dict]:
    """``{"step", "train_s", "accuracy"}`` of each held-out evaluation in our metrics.jsonl rows
    (step 0, the start, at 0 s; ``train_s``: ``train_elapsed_s``, evaluations excluded)."""
    key = f"eval/{HELDOUT_SET}/pass@1"
    return [{"step": r["step"], "train_s": r["train_elapsed_s"] if r["step"] else 0.0, "accuracy": r[key]}
            for r in metrics if key in r]


def trl_heldout_curve(lines: list[dict]) -> list[dict]:
    """The same from the TRL worker's log lines (its ``--evaluate`` records)."""
    return [{"step": r["eval_step"], "train_s": r["train_s"], "accuracy": r["accuracy"]}
            for r in lines if r.get("set") == HELDOUT_SET]


def seconds_to_reach(curve: list[dict], accuracy: float) -> float | None:
    """Training seconds at the first evaluation of ``curve`` at or above ``accuracy`` (an upper
    bound: it may have been reached between evaluations); None when none is."""
    return next((p["train_s"] for p in curve if p["accuracy"] >= accuracy), None)


def heldout_record(ours: list[dict], trl: list[dict], ours_rescored: float, trl_rescored: float) -> dict:
    """One seed's held-out comparison of our curve with TRL's. The target is TRL's final model
    re-scored by the independent grader; ``ratio``: the seconds ours takes to reach it over
    TRL's whole training seconds (goal: at most 0.5)."""
    reach = seconds_to_reach(ours, trl_rescored)
    return {
        "trl_start": trl[0]["accuracy"], "trl_end": trl[-1]["accuracy"], "trl_rescored": trl_rescored,
        "trl_train_s": trl[-1]["train_s"],
        "ours_start": ours[0]["accuracy"], "ours_end": ours[-1]["accuracy"], "ours_rescored": ours_rescored,
        "ours_train_s": ours[-1]["train_s"],
        "ours_s_to_trl_final": reach, "ratio": None if reach is None else reach / trl[-1]["train_s"],
        "curves": {"trl": trl, "ours": ours},
    }


HELDOUT_KEYS = ("trl_start", "trl_end", "trl_rescored", "trl_train_s", "ours_start", "ours_end", "ours_rescored",
                "ours_train_s", "ours_s_to_trl_final", "ratio")
"""The per-seed figures of ``heldout_record`` that get a median."""


def heldout_medians(records: list[dict]) -> dict:
    """Median over seeds of each figure (None where a seed never reached TRL's final accuracy)."""
    return {k: median_of(records, k) for k in HELDOUT_KEYS}


def first(raw: dict, n: int | None) -> dict:
    """The first ``n`` batches of a run's walls and rewards (all when ``n`` is None)."""
    return {k: v[:n] for k, v in raw.items()}


def median_of(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r[key] is not None]
    if len(vals) < len(runs):
        return None  # a seed never reached the target: no honest median
    return statistics.median(vals)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="demo",
                   help="demo: the CPU demo's one-token addition; reasoning: multi-digit addition with a chain "
                        "of thought (yaml_configs/reasoning_cpu.yaml's hyper-parameters on both sides); smollm2: "
                        "SmolLM2-135M-Instruct on reasoning-gym chain_sum (yaml_configs/smollm2_135m_chain_sum_cpu"
                        ".yaml), held-out greedy accuracy against training seconds")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: both sides on GPU 0 (our side at TP=1); cpu: no GPU visible to either")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override of the workload's config for both sides (--workload reasoning or smollm2; "
                        "repeatable)")
    p.add_argument("--batches", type=int, default=None, help="rollout batches per run (default: smollm2 40, else 150)")
    p.add_argument("--ours-batches", type=int, default=None,
                   help="--workload smollm2: rollout batches of our side (default: --batches; TRL's stays --batches), "
                        "to see whether and when ours reaches TRL's final accuracy past TRL's length")
    p.add_argument("--skip-trl", action="store_true",
                   help="--workload smollm2: run only our side and print its held-out curve per seed (no comparison)")
    p.add_argument("--heldout-rows", type=int, default=None,
                   help="--workload smollm2: evaluate the first N held-out prompts (default: all 200)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1234])
    p.add_argument("--tp", type=int, nargs="+", default=None,
                   help="megatron-grpo TP sizes to run (default: 1 2 on cpu, 1 on cuda and with smollm2's DP2)")
    p.add_argument("--micro-batch-size", type=int, nargs="+", default=None,
                   help="megatron-grpo micro-batch sizes to run (default: demo 64, one micro-batch per optimizer "
                        "step, as TRL's per-device batch, where the demo config uses 16; reasoning: the config's "
                        "8). With --workload reasoning TRL's micro-batch is the first of them")
    p.add_argument("--engines", nargs="+", default=None, choices=["embedded", "inprocess", "sglang"],
                   help="megatron-grpo rollout engines to run (engine.kind): embedded in its own process, "
                        "inprocess in trainer rank 0's (default: smollm2 inprocess, else embedded)")
    p.add_argument("--target", type=float, default=None,
                   help="rolling mean reward to reach (default: demo 0.5, reasoning 0.35, smollm2 0.5)")
    p.add_argument("--window", type=int, default=None,
                   help="batches in the rolling mean (default: demo 10, reasoning 20, smollm2 10)")
    p.add_argument("--trl-python", default=str(ROOT / ".venv-trl/bin/python"),
                   help="python of the TRL venv (tools/bench/setup_trl_venv.sh)")
    p.add_argument("--trl-threads", type=int, default=2,
                   help="torch threads of the TRL process (default: the machine's 2 cores, as the "
                        "trainer's rank + engine processes use one each)")
    p.add_argument("--trl-in-order", action="store_true",
                   help="also run TRL with each rollout batch split into optimizer steps in generation "
                        "order (whole prompt groups per step, as megatron-grpo) instead of shuffled")
    p.add_argument("--ours-shuffled", action="store_true",
                   help="also run megatron-grpo with algorithm.shuffle_mini_batches=true (each rollout batch "
                        "shuffled across its optimizer steps, as TRL does)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="compare only the first N batches (TRL stops there; the lr schedules of both "
                        "sides still span --batches)")
    p.add_argument("--reuse", action="store_true",
                   help="read a run whose output in --out is complete (metrics up to the last batch; TRL's "
                        "log marked done) instead of running it again")
    p.add_argument("--out", default=str(ROOT / "runs/bench_vs_trl"))
    p.add_argument("--json", default=None, help="JSON summary file (default: OUT/summary.json)")
    args = p.parse_args(argv)
    wl = WORKLOADS[args.workload]
    if args.tp is None:
        args.tp = [1] if args.device == "cuda" or wl.dp > 1 else [1, 2]
    if args.micro_batch_size is None:
        args.micro_batch_size = [wl.micro_batch_size]
    args.batches = wl.batches if args.batches is None else args.batches
    if wl.heldout_file is None and (args.ours_batches is not None or args.skip_trl):
        flag = "--ours-batches" if args.ours_batches is not None else "--skip-trl"
        p.error(f"{flag}: --workload {args.workload} compares the two sides batch for batch; accepted with "
                "--workload smollm2")
    args.ours_batches = args.batches if args.ours_batches is None else args.ours_batches
    if min(args.batches, args.ours_batches) < 1:
        p.error(f"--batches {args.batches} / --ours-batches {args.ours_batches}: at least 1")
    args.engines = [wl.engine] if args.engines is None else args.engines
    args.target = wl.target if args.target is None else args.target
    args.window = wl.window if args.window is None else args.window
    if args.device == "cuda" and args.tp != [1]:
        p.error(f"--tp {' '.join(map(str, args.tp))}: --device cuda runs on one GPU; accepted: --tp 1")
    if args.device == "cuda" and wl.dp > 1:
        p.error(f"--device cuda: one GPU, and --workload {args.workload} trains {wl.dp} data-parallel ranks; "
                "accepted: --device cpu")
    if args.sets and args.workload == "demo":
        p.error("--set: the demo's settings are the TRL worker's flags; accepted with --workload reasoning or smollm2")
    if wl.heldout_file is None and args.heldout_rows is not None:
        p.error(f"--heldout-rows: --workload {args.workload} evaluates no held-out set; accepted with --workload "
                "smollm2")
    if wl.heldout_file is not None and args.stop_after is not None:
        p.error(f"--stop-after: --workload {args.workload} evaluates at the end of the run; accepted: --batches")
    return args


def summary_record(args: argparse.Namespace, results: dict[str, list[dict]], breakdown: dict[str, dict],
                   departures: list[str], heldout: dict[str, list[dict]] | None = None) -> dict:
    """The JSON summary: the run's settings, each setup's per-seed figures and medians, and with
    a held-out set each of our setups' held-out comparison with TRL (per seed and median)."""
    return {
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "workload": args.workload, "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "batches": args.batches, "stop_after": args.stop_after, "seeds": args.seeds,
        "target": args.target, "window": args.window, "sets": args.sets, "heldout_rows": args.heldout_rows,
        "load_average": list(os.getloadavg()),
        "setups": {name: {"median": {k: median_of(runs, k) for k in ("s_per_batch", "hit_batch", "s_to_target")}
                          | {"final_reward": statistics.median(r["final_reward"] for r in runs)},
                          "per_seed": runs, "time_per_step_s": breakdown.get(name, {})}
                   for name, runs in results.items()},
        "ours_batches": args.ours_batches, "skip_trl": args.skip_trl,
        "heldout": {name: ({"per_seed": records} if args.skip_trl else
                           {"median": heldout_medians(records), "per_seed": records})
                    for name, records in (heldout or {}).items()},
        "departures": departures,
    }


def build_workload(wl: Workload, data_dir: Path) -> None:
    """Run the workload's build commands into ``data_dir`` (each skips what is already written
    or writes the same files again)."""
    for module, *module_args in wl.build:
        proc = subprocess.run([sys.executable, "-m", module, *(a.replace("{out}", str(data_dir)) for a in module_args)],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{module} exited {proc.returncode}: {proc.stderr.strip()[-600:]}")


TRL_NAME = "TRL GRPOTrainer (1 process)"


def ours_name(engine: str, tp: int, mbs: int | None, shuffled: bool) -> str:
    return (f"megatron-grpo {engine}, TP={tp}, micro-batch {mbs or 'of the config'}"
            + (", shuffled mini-batches" if shuffled else ""))


def run_seed(args: argparse.Namespace, seed: int, data_dir: Path, out: Path, results: dict, breakdown: dict,
             heldout: dict) -> None:
    """Every setup of one seed, one after the other (TRL first); appends to ``results`` (the
    reward summary per setup), ``breakdown`` (our step's times) and, with a held-out set,
    ``heldout`` (each of our setups against TRL, both final models re-scored)."""
    wl = WORKLOADS[args.workload]
    side = dict(workload=args.workload, device=args.device, sets=args.sets, heldout_rows=args.heldout_rows)
    trl = None if args.skip_trl else run_trl_side(args, seed, data_dir, out, results, side)
    for engine, tp, mbs, shuffled in itertools.product(args.engines, args.tp, args.micro_batch_size,
                                                       [False, True] if args.ours_shuffled else [False]):
        raw, times, run_dir = run_ours(tp, mbs, seed, args.ours_batches, data_dir, out, args.reuse, shuffled, engine,
                                       trl_batches=args.batches, **side)
        name = ours_name(engine, tp, mbs, shuffled)
        results.setdefault(name, []).append(summarize(**first(raw, args.stop_after), window=args.window,
                                                      target=args.target))
        breakdown[name] = times
        if wl.heldout_file is not None:
            shared = shared_overrides(args.workload, data_dir, batches=args.ours_batches, seed=seed, mbs=mbs,
                                      sets=args.sets, heldout_rows=args.heldout_rows)
            ours_rescored = rescore(export_ours(run_dir, args.reuse), wl.config, shared, args.reuse)
            curve = ours_heldout_curve(run_records(run_dir))
            heldout.setdefault(name, []).append(
                {"curve": curve, "rescored": ours_rescored} if trl is None
                else heldout_record(curve, trl_heldout_curve(trl[0]), ours_rescored, trl[1]))


def run_trl_side(args: argparse.Namespace, seed: int, data_dir: Path, out: Path, results: dict,
                 side: dict) -> tuple[list[dict], float] | None:
    """TRL's runs of one seed, their reward summaries appended to ``results``; with a held-out
    set, (its log lines, its final model's re-scored accuracy), else None."""
    wl = WORKLOADS[args.workload]
    trl_mbs = args.micro_batch_size[0]
    raw, trl_lines = run_trl(args.trl_python, args.trl_threads, seed, args.batches, data_dir, out, reuse=args.reuse,
                             stop_after=args.stop_after, mbs=trl_mbs, **side)
    results.setdefault(TRL_NAME, []).append(summarize(**first(raw, args.stop_after), window=args.window,
                                                      target=args.target))
    if args.trl_in_order:
        raw, _ = run_trl(args.trl_python, args.trl_threads, seed, args.batches, data_dir, out, in_order=True,
                         reuse=args.reuse, stop_after=args.stop_after, mbs=trl_mbs, **side)
        results.setdefault("TRL, optimizer steps in generation order", []).append(
            summarize(**first(raw, args.stop_after), window=args.window, target=args.target))
    if wl.heldout_file is not None:
        shared = shared_overrides(args.workload, data_dir, batches=args.batches, seed=seed, mbs=trl_mbs,
                                  sets=args.sets, heldout_rows=args.heldout_rows)
        trl_dir = trl_log_dir(out, seed, False, args.workload, args.device)
        return trl_lines, rescore(trl_dir / "hf", wl.config, shared, args.reuse)
    return None


def print_reward_tables(args: argparse.Namespace, results: dict[str, list[dict]], breakdown: dict[str, dict]) -> None:
    """The training-reward tables: median per setup, then per seed, then our step's times."""
    trl = results.get(TRL_NAME)  # None with --skip-trl
    trl_s, trl_hit = (None, None) if trl is None else (median_of(trl, "s_per_batch"), median_of(trl, "s_to_target"))
    shown = args.batches if args.stop_after is None else f"first {args.stop_after} of {args.batches}"
    shown = shown if args.ours_batches == args.batches else f"TRL {args.batches}, ours {args.ours_batches}"
    print(f"\n{args.workload} workload on {args.device}: {shown} rollout batches x {len(args.seeds)} seed(s); "
          f"target: {args.window}-batch rolling mean reward >= {args.target}\n")
    print("| setup | s / batch | speed-up vs TRL | batch reaching target | s to target | reward, last "
          f"{args.window} |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        s, hit_s = median_of(runs, "s_per_batch"), median_of(runs, "s_to_target")
        speed = "-" if trl_s is None else f"{trl_s / s:.2f}x" if s else "nan"
        print(f"| {name} | {s:.2f} | {speed} | {fmt(median_of(runs, 'hit_batch'), '.0f', 'never')} | "
              f"{fmt(hit_s, '.0f', 'never')} | {statistics.median(r['final_reward'] for r in runs):.2f} |")
    if trl is not None and trl_hit is None:
        print("\nTRL never reached the target.")
    print(f"\nPer seed (s / batch, batch reaching target, reward last {args.window}):\n")
    print("| setup | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean |")
    print("|---|" + "---|" * (len(args.seeds) + 1))
    for name, runs in results.items():
        cells = [f"{r['s_per_batch']:.2f}, {fmt(r['hit_batch'], '.0f', 'never')}, {r['final_reward']:.2f}" for r in runs]
        hits = [r["hit_batch"] for r in runs]
        mean_hit = fmt(None if None in hits else statistics.fmean(hits), ".0f", "never")
        mean = (f"{statistics.fmean(r['s_per_batch'] for r in runs):.2f}, {mean_hit}, "
                f"{statistics.fmean(r['final_reward'] for r in runs):.2f}")
        print(f"| {name} | " + " | ".join(cells) + f" | {mean} |")
    for name, times in breakdown.items():
        print(f"\n{name}, median seconds per step: " + ", ".join(f"{k}={v:.2f}" for k, v in times.items()))


def heldout_row(label: str, r: dict) -> str:
    """One table row of a ``heldout_record`` (or of their medians)."""
    seconds = r["ours_s_to_trl_final"]
    reach = ("never" if seconds is None else "at the start: TRL ended no higher than ours began" if seconds == 0
             else f"{seconds:.0f} s = {r['ratio']:.2f}x TRL's")
    return (f"| {label} | {r['trl_start']:.3f} -> {r['trl_end']:.3f} ({r['trl_rescored']:.3f}) | "
            f"{r['trl_train_s']:.0f} | {r['ours_start']:.3f} -> {r['ours_end']:.3f} ({r['ours_rescored']:.3f}) | "
            f"{r['ours_train_s']:.0f} | {reach} |")


def print_curves(args: argparse.Namespace, curves: dict[str, list[dict]]) -> None:
    """--skip-trl: per our setup and seed, each held-out evaluation (accuracy and training
    seconds to it) and the final model's re-scored accuracy."""
    for name, records in curves.items():
        print(f"\nHeld-out greedy accuracy ({HELDOUT_SET} set) of {name}, at each evaluation (training s), and the "
              "final model re-scored by tools/score_with_transformers.py\n")
        for seed, r in zip(args.seeds, records):
            points = ", ".join(f"step {p['step']}: {p['accuracy']:.3f} ({p['train_s']:.0f} s)" for p in r["curve"])
            print(f"seed {seed}: {points}; re-scored {r['rescored']:.3f}")


def print_heldout(args: argparse.Namespace, heldout: dict[str, list[dict]]) -> None:
    """Per our setup: held-out greedy accuracy at the start and the end of each side, training
    seconds, and when ours reaches TRL's final accuracy; per seed and the median."""
    for name, records in heldout.items():
        print(f"\nHeld-out greedy accuracy ({HELDOUT_SET} set), TRL against {name}: start -> end of the run's "
              "own evaluation (the final model re-scored by tools/score_with_transformers.py); training s: "
              "evaluation excluded; ours reaching TRL's re-scored final accuracy: at the first of our evaluations "
              "at or above it\n")
        print("| seed | TRL accuracy | TRL training s | ours accuracy | ours training s | ours reaches TRL's final |")
        print("|---|---|---|---|---|---|")
        for seed, r in zip(args.seeds, records):
            print(heldout_row(str(seed), r))
        if len(records) > 1:
            print(heldout_row("median", heldout_medians(records)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_vs_trl: --device cuda but torch.cuda.is_available() is False on this machine; "
              "accepted here: --device cpu", file=sys.stderr)
        return EXIT_NO_CUDA
    if not args.skip_trl and not Path(args.trl_python).exists():
        print(f"--trl-python {args.trl_python}: not found; run `bash tools/bench/setup_trl_venv.sh` first",
              file=sys.stderr)
        return 2

    out = Path(args.out).resolve()  # the sides run from the repository root
    wl = WORKLOADS[args.workload]
    data_dir = out / args.workload  # the demo's stays out/demo, as --reuse expects
    build_workload(wl, data_dir)
    departures = []
    if args.workload in DEPARTURES:
        cfg = load_config(ROOT / wl.config, shared_overrides(args.workload, data_dir, batches=args.batches,
                                                             seed=args.seeds[0], mbs=args.micro_batch_size[0],
                                                             sets=args.sets, heldout_rows=args.heldout_rows))
        trl_grpo_args(cfg, batches=args.batches, device=args.device)  # refuse an unmappable config up front
        departures = DEPARTURES[args.workload](cfg, args.device) + length_departures(args)
    results: dict[str, list[dict]] = {}
    breakdown: dict[str, dict] = {}
    heldout: dict[str, list[dict]] = {}
    for seed in args.seeds:  # interleaved, so drifting machine load hits every setup alike
        run_seed(args, seed, data_dir, out, results, breakdown, heldout)
        print(f"seed {seed} done", flush=True)
    print_reward_tables(args, results, breakdown)
    (print_curves if args.skip_trl else print_heldout)(args, heldout)
    if departures:
        print("\nDepartures between the two sides:\n" + "\n".join(f"* {d}" for d in departures))
    summary = Path(args.json or out / "summary.json")
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(json.dumps(summary_record(args, results, breakdown, departures, heldout), indent=1) + "\n")
    print(f"\nsummary: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
