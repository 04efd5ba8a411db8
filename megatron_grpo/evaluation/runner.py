"""Held-out evaluation through the rollout engine: what the trainer does every
``eval.every_n_steps`` and what ``megatron-grpo eval`` does for a saved model.

    evaluator = Evaluator(cfg, tokenizer, engine, scorer, sampling)   # loads every set
    results = [evaluator.run_round(step, r) for r in evaluator.rounds()]
    metrics = evaluator.summarize(results)                             # eval/<set>/... keys

Work is cut into rounds of ``eval.prompts_per_round`` prompts so that, in training, the other
ranks wait in one bounded collective per round (like a rollout) rather than for the whole
evaluation. Every response is scored by the run's reward functions; it is *correct* when the
``eval.correct_function`` (default: the first function) reaches ``eval.correct_threshold``.
The per-set metrics are pass@k (``passk.py``, for each k <= the set's n), the mean response
length in tokens, the truncated fraction, and the mean total and per-function rewards.
Sampling seeds depend on (trainer.seed, step, set, prompt position) only, so an evaluation
repeated on the same weights (a resumed run, or ``megatron-grpo eval`` on the checkpoint)
draws the same responses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from megatron_grpo.config import ExperimentConfig
from megatron_grpo.data import Prompt, load_prompt_dataset
from megatron_grpo.evaluation.passk import mean_pass_at_k
from megatron_grpo.rewards.sample import reward_samples
from megatron_grpo.runtime.files import write_text_atomic

SEED_MODULUS = 2**31 - 1


@dataclass(frozen=True)
class EvalRound:
    """Prompts ``start:stop`` of set ``set_index``."""

    set_index: int
    start: int
    stop: int


@dataclass
class RoundResult:
    """The scored responses of one round, one dict per response (prompt-major)."""

    set_index: int
    rows: list[dict]


@dataclass
class EvalSet:
    name: str
    n: int
    prompts: list[Prompt]
    sampling: object  # rollout.types.SamplingParams


def eval_seed(seed: int, step: int, set_index: int) -> int:
    """Base sampling seed of one set's evaluation at ``step`` (apart from the training seeds)."""
    return (seed * 1_000_003 + step * 7_919 + (set_index + 1) * 104_729 + 12_345_701) % SEED_MODULUS


def load_sets(cfg: ExperimentConfig, tokenizer, sampling) -> list[EvalSet]:
    """Every ``eval.sets[i]``, tokenized like the training data; DataError naming ``eval.sets[i].path``."""
    sets = []
    for i, s in enumerate(cfg.eval.sets):
        prompts = load_prompt_dataset(cfg.data, tokenizer, s.path, key=f"eval.sets[{i}].path").prompts
        if s.max_samples is not None:
            prompts = prompts[: s.max_samples]
        set_sampling = replace(sampling, temperature=s.temperature,
                               max_new_tokens=s.max_new_tokens or sampling.max_new_tokens)
        sets.append(EvalSet(s.name, s.n, prompts, set_sampling))
    return sets


def set_metrics(name: str, n: int, rows: list[dict], pass_k: list[int]) -> dict[str, float]:
    """Metrics of one set from its scored responses (``rows``: prompt-major, n per prompt)."""
    num_prompts = len(rows) // n
    correct = [sum(r["correct"] for r in rows[i * n:(i + 1) * n]) for i in range(num_prompts)]
    out = {f"eval/{name}/pass@{k}": mean_pass_at_k(n, correct, k) for k in sorted(pass_k) if k <= n}
    out[f"eval/{name}/response_len_mean"] = float(np.mean([r["length"] for r in rows]))
    out[f"eval/{name}/truncated_ratio"] = float(np.mean([r["finish_reason"] == "length" for r in rows]))
    out[f"eval/{name}/reward_mean"] = float(np.mean([r["reward"] for r in rows]))
    for label in rows[0]["rewards"]:
        out[f"eval/{name}/reward/{label}_mean"] = float(np.mean([r["rewards"][label] for r in rows]))
    out[f"eval/{name}/num_prompts"] = num_prompts
    return out


class Evaluator:
    """Rank 0's evaluation machinery (see the module docstring). ``engine``: what generates
    (a ``rollout.protocol.RolloutEngine``, or anything with its ``generate``); ``sampling``: the
    run's SamplingParams (stop ids, top-p/k); each set sets its temperature and length."""

    def __init__(self, cfg: ExperimentConfig, tokenizer, engine, scorer, sampling):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.engine = engine
        self.scorer = scorer
        self.sets = load_sets(cfg, tokenizer, sampling)
        labels = cfg.reward.labels
        self.correct_label = cfg.eval.correct_function or labels[0]

    def rounds(self) -> list[EvalRound]:
        per = self.cfg.eval.prompts_per_round
        return [EvalRound(i, start, min(start + per, len(s.prompts)))
                for i, s in enumerate(self.sets) for start in range(0, len(s.prompts), per)]

    def run_round(self, step: int, rnd: EvalRound) -> RoundResult:
        """Generate and score one round's responses on the engine's current weights."""
        s = self.sets[rnd.set_index]
        prompts = s.prompts[rnd.start:rnd.stop]
        seed = (eval_seed(self.cfg.trainer.seed, step, rnd.set_index) + rnd.start * s.n) % SEED_MODULUS
        samples = self.engine.generate([p.prompt_ids for p in prompts], s.n, s.sampling, sampling_seed=seed)
        to_score = reward_samples(prompts, samples, self.tokenizer)
        texts = [r.response for r in to_score]
        scored = self.scorer.score_samples(to_score)
        threshold = self.cfg.eval.correct_threshold
        rows = []
        for j, (x, text) in enumerate(zip(samples, texts)):
            values = {label: v[j] for label, v in scored.per_function.items()}
            rows.append({"prompt_index": rnd.start + x.prompt_index, "sample_index": x.sample_index,
                         "answer": prompts[x.prompt_index].answer, "response": text,
                         "finish_reason": x.finish_reason, "length": len(x.output_ids),
                         "reward": scored.rewards[j], "rewards": values,
                         "correct": values[self.correct_label] >= threshold})
        return RoundResult(rnd.set_index, rows)

    def summarize(self, results: list[RoundResult]) -> dict[str, float]:
        """``eval/<set>/...`` metrics of a whole evaluation (every round of every set)."""
        out: dict[str, float] = {}
        for i, s in enumerate(self.sets):
            rows = [row for r in results if r.set_index == i for row in r.rows]
            out.update(set_metrics(s.name, s.n, rows, self.cfg.eval.pass_k))
        return out

    def write_samples(self, out_dir: str | Path, step: int, results: list[RoundResult]) -> list[Path]:
        """Every scored response to ``out_dir/<set>/step_NNNNNN.jsonl`` (atomic), for inspection."""
        paths = []
        for i, s in enumerate(self.sets):
            rows = [row for r in results if r.set_index == i for row in r.rows]
            path = Path(out_dir) / s.name / f"step_{step:06d}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
            paths.append(path)
        return paths
