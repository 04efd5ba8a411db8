"""``megatron-grpo eval --config FILE --checkpoint DIR [--out-dir OUT] [section.key=value ...]``

Evaluates a saved model on the config's ``eval.sets`` without training, through the same
rollout engine and reward functions as the trainer. ``DIR`` is one of

* a Hugging Face model directory (``config.json`` + safetensors + tokenizer);
* a megatron-grpo checkpoint (a trainer's ``checkpoints/step_NNNNNN`` or a
  ``convert-hf-to-megatron`` output): converted to a temporary HF directory first (one
  process, the conversion code of ``models/``);
* a run directory: its newest intact checkpoint (``trainer.checkpoint.choose_resume``, as a
  resumed run picks it: damaged ones are skipped with one line on stderr).

The engine named by ``engine.kind`` is launched on those weights. A checkpoint's step
(from its ``trainer_state.json``; 0 otherwise) seeds the sampling exactly as the trainer's
evaluation at that step did, so the numbers can be compared one to one. One JSON line per
set goes to stdout and to ``OUT/eval_metrics.jsonl``; the scored responses to
``OUT/<set>/step_NNNNNN.jsonl``. OUT defaults to ``<trainer.run_dir>/evaluations/<DIR's name>``.

The engine runs with ``OMP_NUM_THREADS`` torch threads, 1 when it is unset: what ``megatron-grpo
train`` gives each rank, so the evaluation runs as the training's does (``THREADS_DEFAULT``).

Exit codes: 0 success, 2 bad input (one line on stderr), 1 the engine failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from megatron_grpo.config import ConfigError, ExperimentConfig
from megatron_grpo.evaluation.runner import Evaluator, load_sets
from megatron_grpo.models.checkpoint import STATE_FILE
from megatron_grpo.models.convert_cli import megatron_to_hf, megatron_to_hf_parser
from megatron_grpo.models.errors import CheckpointError, ModelError
from megatron_grpo.models.tokenizer import load_tokenizer
from megatron_grpo.preflight import load_experiment
from megatron_grpo.preflight.errors import USER_ERRORS, describe_user_error
from megatron_grpo.wire.samples import RolloutError, SamplingParams
from megatron_grpo.runtime import parallel
from megatron_grpo.runtime.files import write_text_atomic
from megatron_grpo.runtime.library_warnings import quiet_library_warnings
from megatron_grpo.sync.factory import build_engine
from megatron_grpo.trainer import checkpoint as ckpt
from megatron_grpo.trainer.components import build_rollout_side

METRICS_FILE = "eval_metrics.jsonl"
EXIT_USER_ERROR, EXIT_FAILED = 2, 1
THREADS_DEFAULT = 1
"""torch threads when OMP_NUM_THREADS is unset, as for the trainer's ranks (launcher/cli.py).
torch's own default, a thread per core, made this command 3-7x slower than the training's
evaluation on a 2-core machine with other work on it: the decode's small matrix products gain
nothing from a second thread and lose much to OpenMP's waits when a core is busy (measured in
docs/evaluation.md)."""


@dataclasses.dataclass
class Weights:
    """The HF directory the engine serves, and the training step it holds (0 if unknown)."""

    hf_dir: Path
    step: int


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron-grpo eval", description="Evaluate a saved model on eval.sets.")
    p.add_argument("--config", required=True, help="experiment YAML with an eval section")
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="HF model directory, megatron-grpo checkpoint directory or run directory")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where metrics and responses go (default <trainer.run_dir>/evaluations/<checkpoint name>)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.pass_k=[1,4]")
    return p.parse_args(argv)


def checkpoint_kind(path: Path) -> str:
    """``hf``, ``megatron`` or ``run`` for what ``path`` holds; CheckpointError otherwise."""
    if not path.exists():
        raise CheckpointError(f"--checkpoint {path}: not found")
    if (path / "config.json").is_file():
        return "hf"
    if (path / "metadata.json").is_file():
        return "megatron"
    if (path / "checkpoints").is_dir():
        return "run"
    raise CheckpointError(f"--checkpoint {path}: not a Hugging Face model directory (no config.json), a megatron-grpo "
                          "checkpoint (no metadata.json) or a run directory (no checkpoints/)")


def _step_of(ckpt: Path) -> int:
    state = ckpt / STATE_FILE
    return int(json.loads(state.read_text())["step"]) if state.is_file() else 0


def megatron_to_hf_dir(ckpt: Path, out: Path) -> Path:
    """Convert Megatron checkpoint ``ckpt`` into the HF directory ``out`` (this process, tp=pp=1)."""
    # the converter's own parser: every option it reads gets its default
    args = megatron_to_hf_parser().parse_args(["--ckpt-dir", str(ckpt), "--output-dir", str(out),
                                               "--no-self-check"])
    quiet_library_warnings()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the metrics only
            megatron_to_hf(args)
    except ModelError as e:
        raise CheckpointError(f"--checkpoint {ckpt}: {' '.join(str(e).split())}") from None
    finally:
        parallel.destroy()
    return out


def resolve_weights(path: Path, scratch: Path) -> Weights:
    """The HF weights to evaluate for ``--checkpoint path`` (converted into ``scratch`` if needed)."""
    kind = checkpoint_kind(path)
    if kind == "hf":
        return Weights(path, 0)
    if kind == "run":
        choice = ckpt.choose_resume(path, "auto")
        if choice.path is None:
            raise CheckpointError(f"--checkpoint {path}: the run directory has no complete checkpoint")
        if choice.note:
            print(f"warning: {choice.note}", file=sys.stderr, flush=True)
        path = choice.path
    elif (path / ckpt.MARKER).is_file():  # a training checkpoint: verified as a resume would
        problem = ckpt.checkpoint_problem(path)
        if problem is not None:
            raise CheckpointError(f"--checkpoint {path}: {problem}")
    return Weights(megatron_to_hf_dir(path, scratch / "hf"), _step_of(path))


def evaluate_weights(cfg: ExperimentConfig, weights: Weights, out_dir: Path) -> list[dict]:
    """Start the engine on ``weights``, evaluate every set; returns one metrics dict per set."""
    run_cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, hf_dir=str(weights.hf_dir), megatron_ckpt=None),
        trainer=dataclasses.replace(cfg.trainer, run_dir=str(out_dir)))
    tokenizer = load_tokenizer(str(weights.hf_dir))
    load_sets(run_cfg, tokenizer, SamplingParams())  # bad eval data fails before the engine starts
    side = build_rollout_side(run_cfg, tokenizer, sampler=None)
    try:
        engine = build_engine(run_cfg, synced=False)  # the checkpoint's fixed weights: no sync
    except BaseException:
        side.close()
        raise
    try:
        evaluator = Evaluator(run_cfg, tokenizer, engine, side.scorer, side.sampling, side.episode_source)
        results = [evaluator.run_round(weights.step, r) for r in evaluator.rounds()]
    finally:
        engine.close()
        side.close()
    evaluator.write_samples(out_dir, weights.step, results)
    metrics = evaluator.summarize(results)
    return [{"set": s.name, "step": weights.step,
             **{k: v for k, v in metrics.items() if k.startswith(f"eval/{s.name}/")}} for s in evaluator.sets]


def _fail(message: str, code: int = EXIT_USER_ERROR) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str]) -> int:
    args = _parse(argv)
    quiet_library_warnings()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or THREADS_DEFAULT))
    try:
        cfg = load_experiment(args.config, args.overrides)
        if not cfg.eval.sets:
            raise ConfigError("eval.sets", "is empty: nothing to evaluate (list held-out sets: name, path, n, ...)",
                              args.config)
        if cfg.engine.urls:
            raise ConfigError("engine.urls", "is set, but megatron-grpo eval launches its own engine on the "
                                             "checkpoint's weights; leave engine.urls empty", args.config)
        out_dir = args.out_dir or Path(cfg.trainer.run_dir) / "evaluations" / args.checkpoint.resolve().name
        with tempfile.TemporaryDirectory(prefix="megatron-grpo-eval-") as scratch:
            weights = resolve_weights(args.checkpoint, Path(scratch))
            rows = evaluate_weights(cfg, weights, out_dir)
    except CheckpointError as e:
        return _fail(str(e))
    except USER_ERRORS as e:
        return _fail(describe_user_error(e, args.config, overrides=args.overrides))
    except RolloutError as e:
        return _fail(" ".join(str(e).split()), EXIT_FAILED)
    lines = [json.dumps({"checkpoint": str(args.checkpoint), **row}) for row in rows]
    write_text_atomic(out_dir / METRICS_FILE, "".join(line + "\n" for line in lines))
    for line in lines:
        print(line, flush=True)
    return 0

