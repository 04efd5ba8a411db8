"""Crash-safe training checkpoints: model + optimizer + RNG + data position + step.

Under ``RUN_DIR/checkpoints/``: ``step_000020/`` (megatron-core dist_checkpointing of model and
optimizer, ``trainer_state.json``, ``rng/rank_00000.pt`` per rank, ``manifest.json``, and
``COMPLETE`` written last) and ``latest``, naming the newest complete checkpoint. Entry points:
``save_training_checkpoint``, ``agreed_resume`` / ``choose_resume``, ``checkpoint_problem``,
``load_training_checkpoint``.

* A directory without ``COMPLETE`` is never resumed from. Everything goes to
  ``.step_000020.tmp`` (manifest and COMPLETE inside) and is renamed; then ``latest`` is replaced
  atomically, then checkpoints beyond ``keep_last`` are deleted. A kill at any moment leaves the
  previous complete checkpoint or the new one; partial temp directories go at the next save or resume.
* ``checkpoint_problem`` verifies before loading: every file's size, a CRC-32 of each up to
  ``CRC_MAX_BYTES`` (larger shards: size only), the keys of ``trainer_state.json`` the trainer
  reads, and, for a checkpoint without a manifest (older ones are accepted), the RNG files.
* ``choose_resume`` (``checkpoint.resume: auto``) takes the newest intact checkpoint, ``latest``'s
  first, saying in one line what it skips; when complete ones exist and none is intact the run
  stops rather than start from step 0. A damaged explicit ``resume: PATH`` stops the run.
* ``save_training_checkpoint`` runs its phases through ``models.checkpoint.AgreedSave``: a failure
  on any rank ends every rank with the same one-line ``CheckpointError``, and ``latest`` and the
  older checkpoints are left untouched.

Layout, the manifest, why large shards get no CRC, the messages:
docs/checkpoints.md#checkpoints-and-resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException  # a BaseException, not an Exception

from megatron_grpo.config import ConfigError
from megatron_grpo.models.checkpoint import (CRC_MAX_BYTES, MANIFEST, MARKER, STATE_FILE, STEP_DIR_RE, AgreedSave,
                                             failure_reason, lora_mismatch, manifest_problem,
                                             write_manifest)
from megatron_grpo.models.errors import CheckpointError
from megatron_grpo.runtime.collectives import agree, broadcast
from megatron_grpo.runtime.device import cuda_available
from megatron_grpo.runtime.parallel import peer_failure
from megatron_grpo.runtime.files import write_text_atomic
from megatron_grpo.models import model_sharded_state_dict, save_megatron_checkpoint
from megatron_grpo.models.lora import has_lora, load_lora_state, lora_sharded_state_dict

CKPT_RE = STEP_DIR_RE


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:06d}"


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = CKPT_RE.match(p.name)
        if m and p.is_dir() and (p / MARKER).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


STATE_KEYS = ("step", "sampler")
"""What the trainer reads of ``trainer_state.json`` on resume (``trainer._resume``)."""
SAMPLER_KEYS = ("epoch", "position", "seed", "shuffle", "num_prompts", "fingerprint")


def _state_problem(ckpt_dir: Path, step: Optional[int]) -> Optional[str]:
    try:
        state = json.loads((ckpt_dir / STATE_FILE).read_text())
    except OSError:
        return f"{STATE_FILE} is missing"
    except ValueError:
        return f"{STATE_FILE} is not valid JSON"
    if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS):
        return f"{STATE_FILE} lacks {', '.join(k for k in STATE_KEYS if not isinstance(state, dict) or k not in state)}"
    if not isinstance(state["step"], int) or (step is not None and state["step"] != step):
        return f"{STATE_FILE} says step {state['step']!r}, the directory step {step}"
    sampler = state["sampler"]
    if not isinstance(sampler, dict) or any(k not in sampler for k in SAMPLER_KEYS):
        return f"{STATE_FILE}'s sampler position is incomplete"
    return None


def _rng_problem(ckpt_dir: Path) -> Optional[str]:
    """Each rank's RNG file loads (for a checkpoint without a manifest, whose CRC covers them)."""
    for path in sorted((ckpt_dir / "rng").glob("rank_*.pt")):
        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
            assert isinstance(state, dict) and isinstance(state.get("torch"), torch.Tensor)
        except Exception:  # noqa: BLE001 - whatever torch.load makes of a damaged file
            return f"rng/{path.name} is unreadable"
    return None


def checkpoint_problem(ckpt_dir: str | Path) -> Optional[str]:
    """What is wrong with the training checkpoint ``ckpt_dir``, in a few words; None if it is
    intact as far as can be told without loading it (module docstring: "Verified before
    loading")."""
    path = Path(ckpt_dir)
    if not (path / MARKER).is_file():
        return f"not a complete checkpoint (no {MARKER} file)"
    m = CKPT_RE.match(path.name)
    step = int(m.group(1)) if m else None
    if (path / MANIFEST).is_file():
        problem = manifest_problem(path)
    elif not (path / "metadata.json").is_file():  # written before the manifest: the marker, and these
        problem = "metadata.json is missing"
    else:
        problem = _rng_problem(path)
    return problem or _state_problem(path, step)


@dataclasses.dataclass
class ResumeChoice:
    """The checkpoint to resume from (None: start at step 0) and, when damaged checkpoints were
    skipped to find it, the one line that says so."""

    path: Optional[Path]
    note: Optional[str] = None


def _names(skipped: list[tuple[Path, str]]) -> str:
    parts = [f"{p.name} ({problem})" for p, problem in skipped]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def choose_resume(run_dir: str | Path, resume: str) -> ResumeChoice:
    """The checkpoint to resume from. ``never``: none. A path: it, if intact (else a
    ``ConfigError`` on ``checkpoint.resume``, no fallback). ``auto``: the ``latest`` pointer's
    checkpoint, then the other complete ones newest first, the first intact one; damaged ones
    are skipped with a note; none at all: start at step 0; complete ones but none intact: a
    ``CheckpointError`` (a run is not silently started over)."""
    if resume == "never":
        return ResumeChoice(None)
    if resume != "auto":
        path = Path(resume)
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ConfigError("checkpoint.resume", f"{path} cannot be resumed from: {problem}")
        return ResumeChoice(path)
    root = checkpoints_dir(run_dir)
    candidates = [p for _, p in reversed(complete_checkpoints(run_dir))]
    pointer = root / "latest"
    if pointer.is_file():
        try:
            named = root / pointer.read_text().strip()
        except (OSError, ValueError):
            named = None
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    skipped: list[tuple[Path, str]] = []
    for path in candidates:
        problem = checkpoint_problem(path)
        if problem is None:
            note = None
            if skipped:
                verb = "is" if len(skipped) == 1 else "are"
                note = (f"checkpoint{'s' if len(skipped) > 1 else ''} {_names(skipped)} in {root} {verb} damaged: "
                        f"resuming from {path.name} instead")
            return ResumeChoice(path, note)
        skipped.append((path, problem))
    if skipped:
        raise CheckpointError(
            f"no intact checkpoint to resume from in {root}: {_names(skipped)}; restore one, or set "
            "checkpoint.resume: never to start over from step 0")
    return ResumeChoice(None)


def agreed_resume(run_dir: str | Path, resume: str) -> ResumeChoice:
    """Collective: rank 0's ``choose_resume`` (it reads the files; after removing what
    interrupted saves left), the same on every rank; its error, if any, raised on every rank."""
    answer: Any = None
    if dist.get_rank() == 0:
        try:
            remove_partial(run_dir)
            answer = choose_resume(run_dir, resume)
        except ConfigError as e:  # sent as plain data: these exceptions do not unpickle from their args
            answer = ("config", e.where, e.message)
        except CheckpointError as e:
            answer = ("checkpoint", str(e))
    answer = broadcast(answer)
    if isinstance(answer, tuple) and answer[0] == "config":
        raise ConfigError(answer[1], answer[2])
    if isinstance(answer, tuple):
        raise CheckpointError(answer[1])
    return answer


def remove_partial(run_dir: str | Path) -> None:
    """Delete leftovers of interrupted saves (rank 0 only)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.name.startswith(".") and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        elif CKPT_RE.match(p.name) and p.is_dir() and not (p / MARKER).is_file():
            shutil.rmtree(p, ignore_errors=True)


# How megatron-core's DistributedOptimizer lays out its state in a checkpoint: gathered over
# the dp ranks and unflattened into model-space tensors (one per parameter and moment), so a
# checkpoint reshards across tp/pp/dp like the plain optimizer's. ("fully_sharded_model_space",
# the parallel-save format, is refused by megatron-core 0.16's own sharded-tensor checks
# ("ShardedTensor.flattened_range is not supported"), found on a GPU; "dp_reshardable",
# Megatron-LM's default, cannot change tp/pp.) The plain optimizer ignores the key.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def materialize_adam_state(optimizer) -> None:
    """Give every parameter of ``optimizer``'s torch Adam(s) the state torch would create at
    its first step (zero moments, ``step`` 0) where that is missing. Equivalent for training:
    torch's lazy initialisation makes the same.

    Why: megatron-core builds the state dict it loads from an optimizer whose state it first
    initialises (``init_state_fn``: zero moments), so a checkpoint must hold the moments. One
    written before the first optimizer step (every step so far skipped for want of a learning
    signal, or a stop before the first update) held none, and resuming from it failed with
    ``KeyError: optimizer.state.exp_avg...``. And megatron saves a step of 0 as no step at all
    (``if step:``), so a state loaded from such a checkpoint has moments without a ``step``,
    which torch's Adam refuses to load: ``with_step_zero`` gives it back before the load.
    (Only torch's Adam and AdamW: apex's and TransformerEngine's fused Adams keep their own.)"""
    from torch.optim.optimizer import _get_scalar_dtype

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group.get("amsgrad"):
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if "step" not in state:  # where torch's Adam keeps it (adam.py's lazy initialisation)
                    on_device = group.get("capturable") or group.get("fused")
                    state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")),
                                                 device=p.device) if on_device
                                     else torch.tensor(0.0, dtype=_get_scalar_dtype()))


def stateless_init_state(optimizer) -> None:
    """Give each megatron optimizer of ``optimizer`` that has no ``init_state_fn`` a no-op one.

    Why: megatron-core calls ``init_state_fn`` before it builds the state dict a checkpoint is
    loaded into, and sets none for SGD (plain SGD keeps no per-parameter state), so resuming an
    ``optimizer.name: sgd`` run raised ``TypeError: 'NoneType' object is not callable``."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "init_state_fn") and opt.init_state_fn is None:
            opt.init_state_fn = lambda inner, config=None: None


def with_step_zero(optimizer_state: Any) -> Any:
    """``optimizer_state`` (megatron's loaded optimizer state dict; a chained optimizer's nests
    one per optimizer) with ``step`` 0 in every parameter's Adam state of a torch optimizer state
    that has moments but neither a step nor megatron's ``common_step``: a checkpoint written
    before the first optimizer step (megatron saves a step of 0 as none, ``if step:``), which
    torch's Adam refuses to load (``KeyError: 'step'``). And an empty ``state`` where the
    checkpoint has none (plain SGD keeps no per-parameter state, and an empty dict is not saved),
    which megatron's load reads (``KeyError: 'state'``). Changed in place; returned."""
    if isinstance(optimizer_state, dict):
        if "param_groups" in optimizer_state:
            optimizer_state.setdefault("state", {})
        per_param = optimizer_state.get("state")
        if isinstance(per_param, dict) and "param_groups" in optimizer_state and "common_step" not in per_param:
            for state in per_param.values():
                if isinstance(state, dict) and "exp_avg" in state and "step" not in state:
                    state["step"] = torch.tensor(0.0)  # torch's lazy initialisation; megatron's load moves it
        for value in optimizer_state.values():
            with_step_zero(value)
    elif isinstance(optimizer_state, list):
        for value in optimizer_state:
            with_step_zero(value)
    return optimizer_state


def training_sharded_state_dict(model_chunks, optimizer, *, is_loading: bool = False) -> dict:
    """Model and optimizer sharded state of this rank (megatron-core dist_checkpointing);
    the optimizer's is megatron's sharded optimizer state dict, plain or distributed. A LoRA
    policy's model state is its adapters alone: the frozen base is where the run loaded it
    from (``model.hf_dir`` / ``model.megatron_ckpt``), not saved again."""
    model_sd = lora_sharded_state_dict(model_chunks) if has_lora(model_chunks) else model_sharded_state_dict(model_chunks)
    state = dict(model_sd)
    if not is_loading:
        materialize_adam_state(optimizer)  # a save before the first optimizer step holds the moments too
    else:
        stateless_init_state(optimizer)
    state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                      metadata=dict(OPTIMIZER_METADATA))
    return state


def rng_state(cuda: bool) -> dict[str, Any]:
    """This rank's RNG states: ``torch`` (CPU generator) always; with ``cuda`` also ``cuda``
    (the current device's generator) and ``tracker`` (megatron's CUDA RNG tracker streams)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if cuda:
        from megatron.core import tensor_parallel

        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def set_rng_state(state: dict[str, Any], cuda: bool) -> None:
    """Restore what ``rng_state`` saved. The CUDA entries are skipped without ``cuda`` (a GPU
    run's checkpoint resumed on a CPU machine) and absent entries are left alone (a CPU run's
    checkpoint resumed on a GPU)."""
    torch.set_rng_state(state["torch"])
    if cuda and "cuda" in state:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_failure_line(run_dir: str | Path, step: int, reason: str) -> str:
    """The one line of a save that failed, naming what is still there to resume from."""
    complete = complete_checkpoints(run_dir)
    kept = (f"the last complete checkpoint {complete[-1][1].name} is intact" if complete
            else "there is no complete checkpoint yet")
    return f"could not save checkpoint step {step} to {checkpoints_dir(run_dir)}: {reason}; {kept}"


def save_training_checkpoint(
    run_dir: str | Path, step: int, model_chunks, optimizer, trainer_state: dict[str, Any], keep_last: int,
    timeout_s: float | None = None,
) -> Path:
    """Collective: save a complete checkpoint of ``step`` and rotate old ones. A failure on
    any rank raises the same ``CheckpointError`` on every rank (``AgreedSave``); ``latest`` and
    the older checkpoints are then as they were. ``timeout_s``: megatron-core's part of the
    save on a rank past which it fails so (``checkpoint.save_timeout_s``; None: none)."""
    rank = dist.get_rank()
    final = step_dir(run_dir, step)
    # RNG states go to a per-rank staging dir first; they are moved in before COMPLETE.
    staging = final.with_name(f".{final.name}.rng")
    tmp_final = final.with_name(f".{final.name}.pending")

    def cleanup() -> None:
        for leftover in (staging, tmp_final, tmp_final.with_name(f".{tmp_final.name}.tmp")):
            shutil.rmtree(leftover, ignore_errors=True)

    agreed = AgreedSave(str(final), lambda reason: save_failure_line(run_dir, step, reason), cleanup)

    def prepare() -> None:
        if rank == 0:
            remove_partial(run_dir)
            staging.mkdir(parents=True, exist_ok=True)

    agreed.local(prepare)
    # every rank writes here first: a directory it cannot write to fails before megatron's save
    agreed.local(lambda: torch.save(rng_state(cuda_available()), staging / f"rank_{rank:05d}.pt"))
    state = training_sharded_state_dict(model_chunks, optimizer)
    save_megatron_checkpoint(model_chunks, tmp_final, extra_state=trainer_state, sharded_state_dict=state,
                             agreed=agreed, timeout_s=timeout_s)

    def finish() -> None:
        if rank != 0:
            return
        staging.rename(tmp_final / "rng")
        (tmp_final / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n")
        write_manifest(tmp_final)
        write_text_atomic(tmp_final / MARKER, f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        tmp_final.rename(final)
        write_text_atomic(checkpoints_dir(run_dir) / "latest", final.name + "\n")
        for _, old in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    agreed.local(finish)
    return final


def _torch_adam_distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers in ``optimizer`` that step a plain torch Adam: megatron-core
    0.16 without apex or TransformerEngine. Empty otherwise (and for the plain optimizer)."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return []
    return [opt for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(opt, distrib_optimizer.DistributedOptimizer) and opt.optimizer is not None]


@contextlib.contextmanager
def torch_adam_checkpoint_load(optimizer):
    """Let megatron-core 0.16 load a DistributedOptimizer checkpoint into a torch Adam.

    Two defects of that path (no apex/TE; both found on a GPU), mended for this load only:

    * ``DistributedOptimizer.state_dict()``, which building the sharded state dict calls,
      reads every parameter's Adam ``step``; a fresh torch Adam has no state until its first
      step (``assert len(steps) == 1``). Zero moments and ``step`` 0 are created as torch
      would; the load overwrites them all (``step`` from the saved param groups);
    * the ``fully_reshardable`` format saves param, exp_avg and exp_avg_sq per parameter,
      while ``_set_main_param_and_optimizer_states`` copies every key of the torch state,
      ``step`` included (``KeyError: 'step'``): the step megatron has just restored is kept.
    """
    opts = _torch_adam_distributed_optimizers(optimizer)
    for opt in opts:
        materialize_adam_state(opt)

    def keeping_step(opt, original):
        def set_states(model_param, tensors):
            if "step" not in tensors:
                group_index, group_order = opt.model_param_group_index_map[model_param]
                main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
                tensors = {**tensors, "step": opt.optimizer.state[main_param]["step"]}
            original(model_param, tensors)
        return set_states

    for opt in opts:
        opt._set_main_param_and_optimizer_states = keeping_step(opt, opt._set_main_param_and_optimizer_states)
    try:
        yield
    finally:
        for opt in opts:
            del opt._set_main_param_and_optimizer_states  # back to the class's method


def load_training_checkpoint(ckpt_dir: Path, model_chunks, optimizer) -> dict[str, Any]:
    """Collective: load model + optimizer (+ this rank's RNG) from ``ckpt_dir``; returns the
    trainer state (step, data position, ...). A checkpoint that fails to load (damage the
    manifest could not see, a checkpoint of another model) raises the same ``CheckpointError``
    on every rank: the ranks agree after the load (megatron-core's load gathers its own read
    errors, so no rank is left in a collective)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException  # with dist_checkpointing

    spec = next((c.lora_spec for c in model_chunks if getattr(c, "lora_spec", None) is not None), None)
    mismatch = lora_mismatch(ckpt_dir, spec)
    if mismatch:  # every rank reads the same file: the same line everywhere, before any collective
        raise CheckpointError(f"could not load checkpoint {ckpt_dir}: {mismatch}")
    error: Optional[str] = None
    state: dict[str, Any] = {}
    with torch_adam_checkpoint_load(optimizer):
        sharded = training_sharded_state_dict(model_chunks, optimizer, is_loading=True)
        try:
            loaded = dist_checkpointing.load(sharded, str(ckpt_dir))
            if has_lora(model_chunks):
                load_lora_state(model_chunks, loaded)
            else:
                for key, chunk in zip([k for k in sharded if k.startswith("model")], model_chunks):
                    chunk.load_state_dict(loaded[key], strict=True)
            optimizer.load_state_dict(with_step_zero(loaded["optimizer"]))
            rank_file = ckpt_dir / "rng" / f"rank_{dist.get_rank():05d}.pt"
            if rank_file.is_file():  # absent when resuming with more ranks than were saved
                set_rng_state(torch.load(rank_file, weights_only=True, map_location="cpu"), cuda_available())
            state = json.loads((ckpt_dir / STATE_FILE).read_text())
        except (Exception, CheckpointException, CheckpointingException) as e:  # noqa: BLE001 - one line
            if peer_failure(e):
                raise
            error = failure_reason(e)
    failure = agree(error)
    if failure is not None:
        where = f"rank {failure.rank}: " if failure.world > 1 and not failure.line.startswith("rank ") else ""
        raise CheckpointError(f"could not load checkpoint {ckpt_dir}: {where}{first_line(failure.line)}")
    return state


def first_line(text: str, limit: int = 300) -> str:
    """``text`` cut to one line of at most ``limit`` characters (megatron-core's messages list
    every tensor)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
