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

A save is collective, and a failure on one rank (a read-only directory, a full disk, a killed
writer, a shard writer process killed) must not leave the others waiting at a barrier:
``AgreedSave`` runs each phase so that every rank ends with the same ``CheckpointError`` line
within seconds.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException  # a BaseException, not an Exception

from megatron_grpo.models.errors import CheckpointError, ModelError
from megatron_grpo.models.hf_config import load_hf_config, sidecar_files
from megatron_grpo.models.lora import LoraSpec, load_lora_state, lora_metadata, lora_sharded_state_dict
from megatron_grpo.runtime import parallel
from megatron_grpo.runtime.collectives import agree
from megatron_grpo.runtime.errors import one_line
from megatron_grpo.runtime.parallel import peer_failure
from megatron_grpo.runtime.process import fail_when_a_fork_dies, forks_die_with_this_process

HF_SUBDIR = "hf"
META_FILE = "megatron_grpo.json"
FORMAT = "megatron_grpo.model_checkpoint"
MARKER = "COMPLETE"
"""Written last into a training checkpoint (``trainer/checkpoint.py``): a directory without it
is never resumed from (the pre-flight checks ``checkpoint.resume`` for it)."""
STATE_FILE = "trainer_state.json"
"""The training checkpoint's step, data position and metrics count."""
STEP_DIR_RE = re.compile(r"^step_(\d{6,})$")
"""The name of a training checkpoint's directory under ``RUN_DIR/checkpoints/`` (``trainer/checkpoint.py``;
the pre-flight refuses anything else by that name)."""

MANIFEST = "manifest.json"
"""A training checkpoint's list of its files (``trainer/checkpoint.py`` writes it; a conversion
reads it to name the file a failed load tripped on)."""
MANIFEST_FORMAT = "megatron_grpo.checkpoint_manifest"
CRC_MAX_BYTES = 64 << 20
"""Files up to this size get a CRC-32 in the manifest, larger ones (model and optimizer shards
of a real model) their size only (module docstring)."""


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(ckpt_dir: Path) -> list[str]:
    """The checkpoint's files the manifest covers: all but itself and the COMPLETE marker."""
    return sorted(p.relative_to(ckpt_dir).as_posix() for p in ckpt_dir.rglob("*")
                  if p.is_file() and p.name not in (MANIFEST, MARKER))


def write_manifest(ckpt_dir: Path) -> None:
    """``ckpt_dir/manifest.json``: each file's size, and its CRC-32 up to ``CRC_MAX_BYTES``."""
    files = {}
    for rel in _files(ckpt_dir):
        size = (ckpt_dir / rel).stat().st_size
        files[rel] = {"size": size, "crc32": _crc32(ckpt_dir / rel)} if size <= CRC_MAX_BYTES else {"size": size}
    body = {"format": MANIFEST_FORMAT, "version": 1, "crc_max_bytes": CRC_MAX_BYTES, "files": files}
    (ckpt_dir / MANIFEST).write_text(json.dumps(body, indent=1) + "\n")


def manifest_problem(ckpt_dir: Path) -> Optional[str]:
    """What differs between ``ckpt_dir``'s files and its manifest, in a few words (the first
    file cut, missing or changed); None when they agree."""
    try:
        manifest = json.loads((ckpt_dir / MANIFEST).read_text())
        files = manifest["files"]
        assert isinstance(files, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return f"{MANIFEST} is unreadable"
    for rel, want in files.items():
        path = ckpt_dir / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != want.get("size"):
            return f"{rel} has {size} bytes, the manifest says {want.get('size')}"
        if "crc32" in want and _crc32(path) != want["crc32"]:
            return f"{rel} does not match its CRC-32 in the manifest"
    return None



def failure_reason(e: BaseException) -> str:
    """One line for what went wrong in a save: an OSError's own text (``[Errno 28] No space
    left on device: PATH``), else ``Type: text``. torch.distributed.checkpoint's
    ``CheckpointException`` (what megatron-core raises when a rank's shard writer failed, or
    was killed) gives the first failed rank's wrapped error."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _trace) = sorted(failures.items(), key=lambda kv: kv[0])[0]
        cause = inner.__cause__ if isinstance(inner, RuntimeError) and inner.__cause__ is not None else None
        return f"rank {rank}: {failure_reason(cause or inner)}"
    text = " ".join(str(e).split())
    if isinstance(e, OSError):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class AgreedSave:
    """The phases of one collective save, run so that a failure on any rank ends every rank
    with the same ``CheckpointError(line(reason))``, within seconds, instead of a traceback on
    one rank and the others blocked at the next barrier until the group's timeout.

    * ``local(fn)``: this rank's file work (rank 0 alone, or every rank), then an
      ``all_gather_object`` of each rank's error, which every rank reaches: the lowest failed
      rank's reason is the line. It is also the phase's barrier.
    * ``collective(fn)``: work that holds collectives of its own (megatron-core's
      ``dist_checkpointing.save``). A rank that fails inside it may leave the others waiting
      in a collective it will never join, so the ranks agree through the c10d store instead:
      each failed rank writes its reason there, then destroys its process groups, which
      unblocks its peers ("Connection closed by peer"; on the CPU path the checkpoint writer's
      forked manager closes the copies of the rank's sockets it inherited, or they would stay
      open: ``runtime.cpu_shim``); they write an empty reason and do the same, and every rank
      reads all the reasons back. A peer failure with no reason anywhere
      (a rank really died) is raised as it is (the lost-peer line, ``trainer/rank.py``).

    ``cleanup`` runs on rank 0 after a failure (best effort: the half-written directories,
    which would otherwise wait for the next save or resume, on a full disk most of all).
    """

    WAIT_S = 15.0
    """How long a failed rank waits for its peers' reasons through the store."""
    LOST_S = 2.0
    """How long a rank that lost a peer looks for a failed save's reason before taking it for a
    peer that died (a rank that fails writes its reason before it gives its groups up)."""

    def __init__(self, name: str, line: Callable[[str], str], cleanup: Optional[Callable[[], None]] = None):
        self.line = line
        self.cleanup = cleanup
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.key = f"megatron_grpo/save/{name}"  # the same on every rank: the checkpoint's path

    def _fail(self, reason: str) -> CheckpointError:
        if self.rank == 0 and self.cleanup is not None:
            try:
                self.cleanup()
            except Exception:  # noqa: BLE001 - best effort; the next save or resume removes them
                pass
        return CheckpointError(self.line(reason))

    def local(self, fn: Callable[[], Any]) -> Any:
        error, result = None, None
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - any failure of a save is the save's one line
            error = failure_reason(e)
        failure = agree(error)
        if failure is not None:
            raise self._fail(self._with_rank(failure.rank, failure.line))
        return result

    def _with_rank(self, rank: int, text: str) -> str:
        return f"rank {rank}: {text}" if self.world > 1 and not text.startswith("rank ") else text

    def collective(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failure of a save is its one line
            own = None if peer_failure(e) else failure_reason(e)
            lost = _without_tracebacks(e) if own is None else None
        # Out of the except block: the traceback's frames are gone, and with them the references
        # they held to the process groups, which destroying them must close (_agree_through_store).
        reason = self._agree_through_store(own)
        if reason is None:
            raise lost
        raise self._fail(reason) from None

    def _agree_through_store(self, own: Optional[str]) -> Optional[str]:
        """Every rank's reason (``own``, None for "a peer went away") through the c10d store;
        the line's reason, or None when no rank had one of its own."""
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - no store: nothing to agree through
            return own
        # "1" marks a reason that says what failed; megatron-core's CheckpointException on the
        # ranks that are not its coordinator names no failure (its details are on rank 0)
        weak = own is not None and own.startswith("CheckpointException")
        tag = "" if own is None else ("0" if weak else "1") + self._with_rank(self.rank, own)
        try:
            store.set(f"{self.key}/rank{self.rank}", tag)
            if own is not None:
                store.add(f"{self.key}/failed", 1)
            store.add(f"{self.key}/told", 1)
        except Exception:  # noqa: BLE001 - the store's host is gone too
            return own
        # peers blocked in a collective with this rank get an error now ("Connection closed by
        # peer"): every group goes, megatron-core's too, and is collected, which closes its
        # connections (a group still referenced, from a traceback's frame, stays open)
        parallel.destroy()
        gc.collect()
        started = time.monotonic()
        deadline = started + self.WAIT_S
        tags: list[tuple[int, str]] = []
        try:
            while store.add(f"{self.key}/told", 0) < self.world and time.monotonic() < deadline:
                if (own is None and time.monotonic() > started + self.LOST_S
                        and store.add(f"{self.key}/failed", 0) == 0):
                    return None  # no rank failed a save: a peer really went away (it wrote first)
                time.sleep(0.05)
            for r in range(self.world):
                if store.check([f"{self.key}/rank{r}"]):
                    tags.append((r, store.get(f"{self.key}/rank{r}").decode()))
            store.add(f"{self.key}/read", 1)
            # rank 0 may host the store (a bare torchrun's TCPStore): it stays until all have read
            while self.rank == 0 and store.add(f"{self.key}/read", 0) < self.world and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store's host is gone: what was read so far
            pass
        ranked = [(tag[0] != "1", r, tag[1:]) for r, tag in tags if tag]
        return min(ranked)[2] if ranked else own


def _without_tracebacks(e: BaseException) -> BaseException:
    """``e`` with no traceback along its chain: kept to be raised again, it holds no frame."""
    seen = e
    while seen is not None:
        seen.__traceback__ = None
        seen = seen.__cause__ or seen.__context__
    return e


def model_sharded_state_dict(model_chunks: list) -> dict:
    """The chunks' megatron-core sharded state dict, keyed ``model`` / ``model{i}``."""
    if len(model_chunks) == 1:
        return {"model": model_chunks[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(model_chunks)}


def save_megatron_checkpoint(model_chunks: list, ckpt_dir: str | Path, extra_state=None, *,
                             hf_dir: str | Path | None = None, sharded_state_dict=None,
                             agreed: Optional[AgreedSave] = None, timeout_s: Optional[float] = None,
                             timeout_name: str = "checkpoint.save_timeout_s") -> Path:
    """Save the chunks (collective over all ranks) to ``ckpt_dir``, replacing it if it exists.

    ``extra_state``: plain data (dicts, lists, numbers, strings, tensors), identical on every
    rank, stored once and returned by ``load_megatron_checkpoint``. ``hf_dir``: where
    config.json and the tokenizer files are copied from; default: the directory the chunks'
    ``hf_config`` was read from (``build_model`` records it). ``agreed``: the save's phases
    (``AgreedSave``; the trainer passes its own, whose line names the training step); a
    failure on any rank raises the same ``CheckpointError`` on every rank. ``timeout_s``: the
    longest megatron-core's save may take on this rank (its writers killed and the save failed
    as above past it; ``timeout_name`` is the setting the line names); None: no deadline.
    """
    from megatron.core import dist_checkpointing, parallel_state

    hf_config = model_chunks[0].hf_config
    source = Path(hf_dir or hf_config.name_or_path)
    final = Path(ckpt_dir)
    tmp = final.with_name(f".{final.name}.tmp")
    rank = dist.get_rank()
    if agreed is None:
        agreed = AgreedSave(str(final), lambda reason: f"could not save checkpoint {final}: {reason}",
                            cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True))

    def prepare() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftover of an interrupted save
            tmp.mkdir(parents=True)

    agreed.local(prepare)
    state = sharded_state_dict if sharded_state_dict is not None else model_sharded_state_dict(model_chunks)
    if extra_state is not None:
        state = {**state, "extra_state": extra_state}  # a common (non-sharded) entry

    def write() -> None:
        # megatron's forked writers must not outlive a killed rank, and one killed or hung
        # must not leave the rank waiting for it for ever (it waits in JoinableQueue.join())
        with forks_die_with_this_process(), fail_when_a_fork_dies("a checkpoint writer", timeout_s, timeout_name):
            dist_checkpointing.save(state, str(tmp))

    agreed.collective(write)

    def finish() -> None:
        if rank != 0:
            return
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

    agreed.local(finish)
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
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - whatever the reader makes of a damaged file
        raise unreadable(path, e) from None
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
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - whatever the reader makes of a damaged file
        raise unreadable(path, e) from None
    load_lora_state(model_chunks, loaded)


def unreadable(path: Path, e: BaseException) -> ModelError:
    """The one line of a load that failed on a file: the file its manifest finds cut or changed
    (a truncated shard made torch's reader raise a bare ``EOFError``, issue 64), else the reader's
    own line."""
    problem = manifest_problem(path) if (path / MANIFEST).is_file() else None
    return ModelError(f"{path}: cannot be loaded: {problem or one_line(e, 300) + ' (a file cut or damaged?)'}")


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


def lora_mismatch(ckpt_dir: str | Path, spec: Optional[LoraSpec]) -> Optional[str]:
    """Why a model adapted by ``spec`` (None: no ``model.lora``) cannot load the training
    checkpoint ``ckpt_dir``, in one line with the way out; None when both hold the same kind of
    weights. A LoRA checkpoint holds adapters only and a full one the whole model, so a resume
    with the other kind failed inside megatron-core ("Cannot merge two lists with different
    lengths", issue 64) without naming LoRA."""
    meta_file = Path(ckpt_dir) / META_FILE
    try:
        saved = json.loads(meta_file.read_text()).get("lora")
    except (OSError, ValueError, AttributeError):
        return None  # no provenance to compare: the load says what is wrong
    run_config = Path(ckpt_dir).parent.parent / "config.yaml"
    as_saved = f"as in the run's {run_config}" if run_config.is_file() else "as when it was saved"
    way_out = f"{as_saved} to resume it, or checkpoint.resume: never to start over"
    if saved is not None and spec is None:
        return (f"it holds LoRA adapters (rank {saved['rank']}, targets {', '.join(saved['targets'])}) and the config "
                f"sets no model.lora: set model.lora {way_out}")
    if saved is None and spec is not None:
        return f"it holds the whole model (a run without LoRA) and the config sets model.lora: unset it {way_out}"
    if saved is not None and (saved["rank"], tuple(saved["targets"])) != (spec.rank, spec.targets):
        return (f"its LoRA adapters have rank {saved['rank']} and targets {', '.join(saved['targets'])}, model.lora "
                f"here rank {spec.rank} and targets {', '.join(spec.targets)}: set model.lora {way_out}")
    return None


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
