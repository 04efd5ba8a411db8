"""Megatron distributed checkpoints of the model (loadable at any TP/PP/EP), with HF metadata.

Layout of a checkpoint directory::

    CKPT_DIR/
      metadata.json, common.pt, *.distcp    megatron-core dist_checkpointing (torch_dist)
      hf/config.json + tokenizer files      copied from the HF directory: enough to rebuild
                                            the model and export to HF without the original
      megatron_grpo.json                    format marker + provenance (saved tp/pp/ep, dtype)

The state dict is ``model_sharded_state_dict(chunks)`` (``{"model": ...}``, or
``{"model0": ..., "model1": ...}`` with several chunks, Megatron-LM's convention); the trainer
passes a superset (model + optimizer) as ``sharded_state_dict``. Writes go to a sibling temp
directory renamed at the end, so an interrupted save leaves no half checkpoint.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from megatron_grpo.models.errors import ModelError
from megatron_grpo.models.hf_config import load_hf_config, sidecar_files
from megatron_grpo.models.lora import load_lora_state, lora_metadata, lora_sharded_state_dict
from megatron_grpo.runtime.process import forks_die_with_this_process

HF_SUBDIR = "hf"
META_FILE = "megatron_grpo.json"
FORMAT = "megatron_grpo.model_checkpoint"
MARKER = "COMPLETE"
"""Written last into a training checkpoint (``trainer/checkpoint.py``): a directory without it
is never resumed from (the pre-flight checks ``checkpoint.resume`` for it)."""
STATE_FILE = "trainer_state.json"
"""The training checkpoint's step, data position and metrics count."""


def model_sharded_state_dict(model_chunks: list) -> dict:
    """The chunks' megatron-core sharded state dict, keyed ``model`` / ``model{i}``."""
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(model_chunks)}


def save_megatron_checkpoint(model_chunks: list, ckpt_dir: str | Path, extra_state=None, *,
                             hf_dir: str | Path | None = None, sharded_state_dict=None) -> Path:
    """Save the chunks (collective over all ranks) to ``ckpt_dir``, replacing it if it exists.

    ``extra_state``: plain data (dicts, lists, numbers, strings, tensors), identical on every
    rank, stored once and returned by ``load_megatron_checkpoint``. ``hf_dir``: where
    config.json and the tokenizer files are copied from; default: the directory the chunks'
    ``hf_config`` was read from (``build_model`` records it).
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    hf_config = model_chunks[0].hf_config
    source = Path(hf_dir or hf_config.name_or_path)
    final = Path(ckpt_dir)
    tmp = final.with_name(f".{final.name}.tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of an interrupted save
        tmp.mkdir(parents=True)
    dist.barrier()
    state = sharded_state_dict if sharded_state_dict is not None else model_sharded_state_dict(model_chunks)
    if extra_state is not None:
        state = {**state, "extra_state": extra_state}  # a common (non-sharded) entry
    with forks_die_with_this_process():  # megatron's forked writers must not outlive a killed rank
        dist_checkpointing.save(state, str(tmp))
    dist.barrier()
    if rank == 0:
        _write_hf_sidecar(tmp / HF_SUBDIR, source, hf_config)
        meta = {
            "format": FORMAT,
            "version": 1,
            "model_type": hf_config.model_type,
            "saved_tp": parallel_state.get_tensor_model_parallel_world_size(),
            "saved_pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "saved_ep": parallel_state.get_expert_model_parallel_world_size(),
            "dtype": str(next(model_chunks[0].parameters()).dtype).removeprefix("torch."),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        lora = lora_metadata(model_chunks)
        if lora is not None:  # the checkpoint holds adapters only: say what they adapt and where the base is
            meta["lora"] = lora
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        replace_dir(tmp, final)
    dist.barrier()
    return final


def load_megatron_checkpoint(model_chunks: list, ckpt_dir: str | Path):
    """Load the model weights of ``ckpt_dir`` (saved at any TP/PP) into this rank's chunks.
    Extra entries (optimizer state) are ignored. Returns the saved ``extra_state`` or None."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    path = checkpoint_path(ckpt_dir)
    state = model_sharded_state_dict(model_chunks)
    try:
        loaded = dist_checkpointing.load(state, str(path))
    except CheckpointingException as e:
        raise ModelError(f"{path}: {str(e).splitlines()[0]}") from None
    for key, chunk in zip(state, model_chunks):
        chunk.load_state_dict(loaded[key], strict=True)
    return loaded.get("extra_state")


def load_lora_adapters(model_chunks: list, ckpt_dir: str | Path) -> None:
    """Load the LoRA adapters of ``ckpt_dir`` (a LoRA training checkpoint, saved at any TP/PP)
    into ``model_chunks`` (already adapted: ``lora.apply_lora``). Collective."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    path = checkpoint_path(ckpt_dir)
    try:
        loaded = dist_checkpointing.load(lora_sharded_state_dict(model_chunks), str(path))
    except CheckpointingException as e:
        raise ModelError(f"{path}: {str(e).splitlines()[0]}") from None
    load_lora_state(model_chunks, loaded)


def checkpoint_path(ckpt_dir: str | Path) -> Path:
    """``ckpt_dir`` if it is a megatron-grpo checkpoint; ModelError naming what is missing."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        raise ModelError(f"{path}: checkpoint directory not found")
    if not (path / "metadata.json").is_file():
        raise ModelError(f"{path}: not a megatron-core distributed checkpoint (no metadata.json)")
    if not (path / HF_SUBDIR / "config.json").is_file():
        raise ModelError(f"{path / HF_SUBDIR / 'config.json'}: not found (was the checkpoint "
                         "written by megatron-grpo's save_megatron_checkpoint?)")
    return path


def checkpoint_hf_config(ckpt_dir: str | Path):
    """The HF config stored in a checkpoint (its ``name_or_path`` is ``CKPT_DIR/hf``)."""
    return load_hf_config(checkpoint_path(ckpt_dir) / HF_SUBDIR)


def checkpoint_lora(ckpt_dir: str | Path) -> dict | None:
    """The ``lora`` entry of a checkpoint holding LoRA adapters (``lora.lora_metadata``), else None."""
    meta = checkpoint_path(ckpt_dir) / META_FILE
    return json.loads(meta.read_text()).get("lora") if meta.is_file() else None


def checkpoint_dtype(ckpt_dir: str | Path) -> torch.dtype | None:
    meta = checkpoint_path(ckpt_dir) / META_FILE
    if not meta.is_file():
        return None
    return getattr(torch, json.loads(meta.read_text())["dtype"])


def _write_hf_sidecar(out: Path, source: Path, hf_config) -> None:
    out.mkdir(parents=True)
    if (source / "config.json").is_file():
        shutil.copy2(source / "config.json", out / "config.json")  # verbatim: exact round trip
    else:
        hf_config.to_json_file(str(out / "config.json"))
    for f in sidecar_files(source):
        shutil.copy2(f, out / f.name)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move the finished ``tmp`` directory to ``final``; an existing ``final`` is removed only
    after the new one is in place."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def dir_bytes(path: str | Path) -> int:
    """Total size of the files under ``path``."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
