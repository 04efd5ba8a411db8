"""Crash-safe training checkpoints: model + optimizer + RNG + data position + step.

Layout under ``RUN_DIR/checkpoints/``::

    step_000020/            a complete checkpoint (megatron-core dist_checkpointing: model and
                            optimizer sharded state, loadable at another TP/PP for the model)
      trainer_state.json    step, data sampler position, metrics count   (extra_state too)
      rng/rank_00000.pt     each rank's RNG states (ranks differ, so one file a rank): the CPU
                            generator's, and with CUDA the device generator's and megatron's
                            model-parallel CUDA RNG tracker's (dropout, TP init streams)
      COMPLETE              written last: a directory without it is never resumed from
    latest                  text file naming the newest complete checkpoint (atomic replace)

Writing order: everything goes to ``.step_000020.tmp`` (models.checkpoint writes there and
renames), the COMPLETE marker is written inside before the rename, then ``latest`` is
replaced, then checkpoints beyond ``keep_last`` are deleted. A kill at any moment leaves
either the previous complete checkpoint or the new one: never a partial one that resume
would pick (partial temp directories are removed at the next save or resume).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_grpo.models.checkpoint import MARKER, STATE_FILE
from megatron_grpo.runtime.device import cuda_available
from megatron_grpo.runtime.files import write_text_atomic
from megatron_grpo.models import model_sharded_state_dict, save_megatron_checkpoint
from megatron_grpo.models.lora import has_lora, load_lora_state, lora_sharded_state_dict

CKPT_RE = re.compile(r"^step_(\d{6,})$")


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


def find_resume_dir(run_dir: str | Path, resume: str) -> Optional[Path]:
    """The checkpoint to resume from: ``never`` -> None; ``auto`` -> the ``latest`` pointer if
    it names a complete checkpoint, else the newest complete one, else None; or a path,
    which must be a complete checkpoint."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / MARKER).is_file():
            raise FileNotFoundError(f"checkpoint.resume: {path} is not a complete checkpoint (no {MARKER})")
        return path
    root = checkpoints_dir(run_dir)
    pointer = root / "latest"
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if (named / MARKER).is_file():
            return named
    complete = complete_checkpoints(run_dir)
    return complete[-1][1] if complete else None


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


def training_sharded_state_dict(model_chunks, optimizer, *, is_loading: bool = False) -> dict:
    """Model and optimizer sharded state of this rank (megatron-core dist_checkpointing);
    the optimizer's is megatron's sharded optimizer state dict, plain or distributed. A LoRA
    policy's model state is its adapters alone: the frozen base is where the run loaded it
    from (``model.hf_dir`` / ``model.megatron_ckpt``), not saved again."""
    model_sd = lora_sharded_state_dict(model_chunks) if has_lora(model_chunks) else model_sharded_state_dict(model_chunks)
    state = dict(model_sd)
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


def save_training_checkpoint(
    run_dir: str | Path, step: int, model_chunks, optimizer, trainer_state: dict[str, Any], keep_last: int
) -> Path:
    """Collective: save a complete checkpoint of ``step`` and rotate old ones."""
    rank = dist.get_rank()
    final = step_dir(run_dir, step)
    if rank == 0:
        remove_partial(run_dir)
        final.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    # RNG states go to a per-rank staging dir first; they are moved in before COMPLETE.
    staging = final.with_name(f".{final.name}.rng")
    if rank == 0:
        staging.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    torch.save(rng_state(cuda_available()), staging / f"rank_{rank:05d}.pt")
    dist.barrier()
    state = training_sharded_state_dict(model_chunks, optimizer)
    tmp_final = final.with_name(f".{final.name}.pending")
    save_megatron_checkpoint(model_chunks, tmp_final, extra_state=trainer_state, sharded_state_dict=state)
    if rank == 0:
        staging.rename(tmp_final / "rng")
        (tmp_final / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n")
        write_text_atomic(tmp_final / MARKER, f"{step}\n")
        if final.exists():
            shutil.rmtree(final)
        tmp_final.rename(final)
        write_text_atomic(checkpoints_dir(run_dir) / "latest", final.name + "\n")
        for _, old in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
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
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                state = opt.optimizer.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                state.setdefault("step", torch.tensor(0.0))

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
    trainer state (step, data position, ...)."""
    from megatron.core import dist_checkpointing

    with torch_adam_checkpoint_load(optimizer):
        state = training_sharded_state_dict(model_chunks, optimizer, is_loading=True)
        loaded = dist_checkpointing.load(state, str(ckpt_dir))
        if has_lora(model_chunks):
            load_lora_state(model_chunks, loaded)
        else:
            for key, chunk in zip([k for k in state if k.startswith("model")], model_chunks):
                chunk.load_state_dict(loaded[key], strict=True)
        optimizer.load_state_dict(loaded["optimizer"])
    rank_file = ckpt_dir / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if rank_file.is_file():  # absent when resuming with more ranks than were saved
        set_rng_state(torch.load(rank_file, weights_only=True, map_location="cpu"), cuda_available())
    return json.loads((ckpt_dir / STATE_FILE).read_text())
