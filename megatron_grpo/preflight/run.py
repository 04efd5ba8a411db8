"""The run's pre-flight on this machine: every input a run reads at start-up, checked before
anything is written to the run directory or any rank starts.

Imports the model and data code (torch, transformers): ``megatron_grpo.preflight`` itself
does not, so loading a config stays fast.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional

import torch

from megatron_grpo.config.base import ConfigError
from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.data import DataError, load_prompt_dataset
from megatron_grpo.models import ModelError, get_architecture, load_hf_config
from megatron_grpo.models.hf_config import split_problem
from megatron_grpo.models.builder import (check_context_parallel, check_packing, resolve_attention_backend,
                                         use_transformer_engine)
from megatron_grpo.models.lora import lora_problem, spec_from_config
from megatron_grpo.models.checkpoint import MARKER, STEP_DIR_RE, checkpoint_path
from megatron_grpo.models.tokenizer import load_tokenizer
from megatron_grpo.models.weights import SafetensorsReader
from megatron_grpo.preflight.layout import layout_problem
from megatron_grpo.preflight.report import reward_build_deadline
from megatron_grpo.generation.adapters import ENGINES
from megatron_grpo.rewards import RewardScorer
from megatron_grpo.rollout.episodes.agent.runner import check_agent
from megatron_grpo.rollout.episodes.environment import check_environment
from megatron_grpo.rollout.episodes.environment.worker import shutdown_fork_server
from megatron_grpo.rollout.episodes.function.source import RolloutFunction
from megatron_grpo.runtime.device import cuda_available
from megatron_grpo.runtime.errors import one_line
from megatron_grpo.runtime.placement import ranks_on_this_node

# Vocabulary files of the tokenizer formats transformers reads (one is enough).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "*.tiktoken", "spiece.model")


def _in_key(key: str, error: BaseException | str) -> ConfigError:
    """``error`` (about a file named by config key ``key``) as a ConfigError naming the key."""
    return ConfigError(key, " ".join(str(error).split()))


def check_model_dir(cfg: ExperimentConfig):
    """config.json (supported architecture, sizes that split over tp/pp), the safetensors
    weights and the tokenizer of ``model.hf_dir``; returns (hf_config, tokenizer)."""
    hf_config = _check_hf_config(cfg.model.hf_dir, "model.hf_dir", cfg)
    if cfg.model.lora is not None:
        problem = lora_problem(spec_from_config(cfg.model.lora), hf_config, tp=cfg.parallel.tp,
                               attention_backend=resolve_attention_backend(cfg.model.attention_backend),
                               sequence_parallel=cfg.parallel.sequence_parallel)
        if problem:
            raise ConfigError(*problem)
    if cfg.parallel.pack_sequences:
        try:
            check_packing(hf_config, cfg.model.attention_backend)
        except ModelError as e:
            raise _in_key("parallel.pack_sequences", str(e).removeprefix("parallel.pack_sequences ")) from None
    _check_weights(cfg.model.hf_dir, "model.hf_dir")
    return hf_config, _check_tokenizer(cfg.model.hf_dir, "model.hf_dir", hf_config)


def check_teacher(cfg: ExperimentConfig, tokenizer) -> None:
    """``distillation.teacher``: a model folder as ``check_model_dir`` checks the policy's (its
    weights unless ``teacher_megatron_ckpt`` gives them), whose tokenizer and chat template are
    the student's (``tokenizer``): the teacher scores the student's token ids as they are."""
    distill = cfg.distillation
    if not distill.enabled:
        return
    hf_config = _check_hf_config(distill.teacher, "distillation.teacher", cfg)
    if distill.teacher_megatron_ckpt:
        try:
            checkpoint_path(distill.teacher_megatron_ckpt)
        except ModelError as e:
            raise _in_key("distillation.teacher_megatron_ckpt", e) from None
    else:
        _check_weights(distill.teacher, "distillation.teacher")
    theirs = _check_tokenizer(distill.teacher, "distillation.teacher", hf_config)
    difference = tokenizer_difference(tokenizer, theirs)
    if difference:
        raise ConfigError("distillation.teacher", f"{distill.teacher}'s tokenizer is not the student's "
                                                  f"({cfg.model.hf_dir}): {difference}; the teacher must score the "
                                                  "student's token ids as they are")


def tokenizer_difference(student, teacher) -> Optional[str]:
    """What differs between two tokenizers that a teacher scoring a student's ids cannot have
    (the vocabulary: id for id; the special tokens; the chat template), or None."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine != theirs:
        changed = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
        return (f"vocabularies differ ({len(mine)} vs {len(theirs)} tokens; first difference: "
                f"{changed[0][0]!r} id {changed[0][1]})")
    for name in ("eos_token_id", "bos_token_id"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            return f"{name} differs ({getattr(student, name, None)} vs {getattr(teacher, name, None)})"
    if getattr(student, "chat_template", None) != getattr(teacher, "chat_template", None):
        return "chat templates differ"
    return None


def _check_hf_config(hf_dir: str, key: str, cfg: ExperimentConfig):
    """``hf_dir``'s config.json: readable, a supported architecture, sizes that split over
    parallel.tp/pp, and context parallelism it can run (``key`` names the folder's config key)."""
    try:
        hf_config = load_hf_config(hf_dir)
    except ModelError as e:
        raise _in_key(key, e) from None
    except Exception as e:  # noqa: BLE001 - transformers rejects a malformed config.json many ways
        raise ConfigError(key, f"{hf_dir}/config.json: transformers cannot read it: {one_line(e, 200)}") from None
    try:
        get_architecture(hf_config.model_type).transformer_config_kwargs(hf_config)
    except ModelError as e:
        raise _in_key(key, f"{hf_dir}/config.json: {e}") from None
    problem = split_problem(hf_config, cfg.parallel.tp, cfg.parallel.pp)
    if problem:
        flag, why = problem
        raise ConfigError(f"parallel.{flag}", why.replace("(config.json)", f"({hf_dir}/config.json)"))
    try:
        check_context_parallel(hf_config, cfg.model.attention_backend, cfg.parallel.cp)
    except ModelError as e:
        raise _in_key("parallel.cp", str(e).removeprefix("parallel.cp=")) from None
    return hf_config


def _check_weights(hf_dir: str, key: str) -> None:
    """The safetensors of ``hf_dir`` are all there and readable."""
    # A partial download (config.json but no or unreadable weights) must fail here, not after
    # the ranks and the rollout engine have started.
    try:
        reader = SafetensorsReader(hf_dir)
        missing = sorted({f for f in reader.weight_map.values() if not (reader.dir / f).is_file()})
    except ModelError as e:
        raise _in_key(key, e) from None
    except Exception as e:  # noqa: BLE001 - a corrupt safetensors header or index
        raise ConfigError(key, f"{hf_dir}: unreadable weights: {type(e).__name__}: "
                               f"{' '.join(str(e).split())[:200]}") from None
    if missing:
        raise ConfigError(key, f"{hf_dir}: {missing[0]} is listed in model.safetensors.index.json "
                               f"but missing ({len(missing)} shard(s) missing: a partial download?)")


def _check_tokenizer(hf_dir: str, key: str, hf_config):
    """The tokenizer of ``hf_dir``: there, loadable, and within config.json's vocabulary."""
    # Without vocabulary files transformers silently builds an empty tokenizer for the
    # model_type (every prompt would tokenize to nothing): require one.
    if not any(any(Path(hf_dir).glob(pattern)) for pattern in TOKENIZER_FILES):
        raise ConfigError(key, f"{hf_dir}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = load_tokenizer(hf_dir)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a bad dir
        raise ConfigError(key, f"{hf_dir}: cannot load the tokenizer: {' '.join(str(e).split())[:200]}") from None
    if len(tokenizer) > hf_config.vocab_size:
        raise ConfigError(
            key, f"{hf_dir}: the tokenizer has {len(tokenizer)} tokens but config.json's vocab_size is "
            f"{hf_config.vocab_size}: tokenizer and model do not belong together")
    return tokenizer


def check_checkpoints(cfg: ExperimentConfig) -> None:
    """``model.megatron_ckpt`` and an explicit ``checkpoint.resume`` path must be checkpoints, and
    ``<trainer.run_dir>/checkpoints``, when there, a directory with no step name taken by anything else."""
    if cfg.model.megatron_ckpt:
        try:
            checkpoint_path(cfg.model.megatron_ckpt)
        except ModelError as e:
            raise _in_key("model.megatron_ckpt", e) from None
    root = Path(cfg.trainer.run_dir) / "checkpoints"
    if os.path.lexists(root) and not root.is_dir():
        # a link to a scratch disk that is not mounted, or a file: the run would start over at
        # step 0 without a word and fail at its first save, the steps in between lost
        what = f"a link to {os.readlink(root)}, which is not a directory" if root.is_symlink() else "not a directory"
        raise ConfigError("trainer.run_dir", f"{root} is {what}: no checkpoint can be resumed from or saved there")
    blocked = sorted(p for p in root.iterdir() if STEP_DIR_RE.match(p.name) and not p.is_dir()) if root.is_dir() else []
    if blocked:  # the run would resume from an older checkpoint, train up to that step and fail to save it
        raise ConfigError("trainer.run_dir", f"{blocked[0]} is not a checkpoint directory (a file, or a link to "
                                             "nothing): its step could not be saved; remove it")
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "never") and not (Path(resume) / MARKER).is_file():
        raise ConfigError("checkpoint.resume", f"{resume} is not a complete checkpoint (no {MARKER} file); "
                                               "expected auto, never or a checkpoint directory")


def check_machine(cfg: ExperimentConfig, ranks_on_node: int | None = None) -> None:
    """The GPU layout of ``cfg`` can work on this machine (``layout.layout_problem``)."""
    cuda = cuda_available()
    problem = layout_problem(cfg, cuda=cuda, num_gpus=torch.cuda.device_count() if cuda else 0,
                             ranks_on_node=ranks_on_this_node() if ranks_on_node is None else ranks_on_node,
                             transformer_engine=use_transformer_engine())
    if problem is not None:
        raise ConfigError(*problem)


def check_run(cfg: ExperimentConfig, ranks_on_node: int | None = None) -> None:
    """Check, without writing anything, every input the run reads at start-up: the rollout
    engine's environment (an SGLang to launch), the GPU layout on this machine
    (``ranks_on_node`` trainer ranks, default torchrun's LOCAL_WORLD_SIZE), the model
    directory (config, weights, tokenizer vs vocabulary, tp/pp vs head and layer counts),
    checkpoints to load, the dataset (every line), the reward functions, environment and
    rollout function (imported and checked) and the logging sinks. Raises ConfigError,
    DataError, ModelError, RewardError or EnvContractError (one line each)."""
    engine_problem = ENGINES[cfg.engine.kind].preflight(cfg.engine)
    if engine_problem:
        raise ConfigError("", engine_problem)  # the problem names its key
    check_machine(cfg, ranks_on_node)
    hf_config, tokenizer = check_model_dir(cfg)
    check_teacher(cfg, tokenizer)
    check_checkpoints(cfg)
    dataset = load_prompt_dataset(cfg.data, tokenizer)
    context = getattr(hf_config, "max_position_embeddings", None)
    too_long = [p for p in dataset.prompts if context and len(p.prompt_ids) >= context]
    if too_long:  # the engine would reject it mid-run; say which line now
        raise DataError(f"{too_long[0].where}: prompt is {len(too_long[0].prompt_ids)} tokens, no room to generate "
                        f"in the model's context of {context} (max_position_embeddings, {cfg.model.hf_dir}/config.json)")
    if context and cfg.episodes.multi_turn:
        if cfg.episodes.max_episode_tokens is not None:  # null: what the context leaves, which fits
            check_fits(dataset.prompts, cfg.episodes.max_episode_tokens, "episodes.max_episode_tokens",
                       context, cfg.model.hf_dir)
    elif context:
        check_fits(dataset.prompts, cfg.rollout.max_new_tokens, "rollout.max_new_tokens", context, cfg.model.hf_dir)
    for i, s in enumerate(cfg.eval.sets):
        eval_prompts = load_prompt_dataset(cfg.data, tokenizer, s.path, key=f"eval.sets[{i}].path").prompts
        if context and not cfg.episodes.multi_turn:
            check_fits(eval_prompts, s.max_new_tokens or cfg.rollout.max_new_tokens,
                       f"eval.sets[{i}].max_new_tokens" if s.max_new_tokens else "rollout.max_new_tokens",
                       context, cfg.model.hf_dir)
    with reward_build_deadline(cfg.reward):
        RewardScorer(cfg.reward).close()
    check_plugins(cfg, tokenizer, getattr(hf_config, "vocab_size", None))
    if cfg.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb_project", "is set but wandb is not installed; pip install wandb or set it to null")


def check_plugins(cfg: ExperimentConfig, tokenizer, vocab_size: int | None) -> None:
    """``episodes.source`` of its ``episodes.kind`` loaded and checked (the file
    imports, the class or function exists with the right methods or arguments), in a worker
    process as during the run, before anything is written; EnvContractError or ConfigError,
    one line naming the file, otherwise."""
    episodes = cfg.episodes
    if episodes.kind is None:
        return
    try:
        if episodes.kind == "environment":
            # prepare: what the episodes share starts here too (an OpenEnv server, stopped below),
            # so an app that raises on import or a server nobody runs is refused before the run
            # directory is written (it was refused by the run's own pre-flight, after; issue 64)
            check_environment(episodes.source, episodes.deadline_s, prepare=True)
        elif episodes.kind == "agent":
            check_agent(episodes.source)
        else:
            RolloutFunction.load(episodes.source, tokenizer, vocab_size=vocab_size,
                                 timeout_s=episodes.deadline_s).close()
    finally:
        shutdown_fork_server()  # the run starts its own; the launcher keeps no worker process


def check_fits(prompts, new_tokens: int, key: str, context: int, hf_dir: str) -> None:
    """The longest prompt plus ``new_tokens`` (``key``: a response's ``rollout.max_new_tokens``,
    or a whole episode's model and observation tokens) fits the model's context; else one line
    naming the key and that prompt's line. An engine would cut or refuse it mid-run."""
    if not prompts:
        return
    longest = max(prompts, key=lambda p: len(p.prompt_ids))
    need = len(longest.prompt_ids) + new_tokens
    if need > context:
        raise ConfigError(key, (
            f"{new_tokens} after the longest prompt ({len(longest.prompt_ids)} tokens, {longest.where}) is "
            f"{need} tokens, more than the model's context of {context} (max_position_embeddings, "
            f"{hf_dir}/config.json); set it to at most {context - len(longest.prompt_ids)} or lower "
            "data.max_prompt_length"))
