"""Issue 48: a damaged checkpoint is not resumed from, and checkpoint I/O fails in one line.

Real checkpoints: a 2-rank save of the tiny model (``trainer.checkpoint.save_training_checkpoint``,
steps 2 and 4), damaged on disk as a disk, a copy or a hand would (a cut shard, a flipped byte,
garbage ``trainer_state.json``, a cut RNG file), then chosen (``choose_resume``: unit level) and
loaded on 2 ranks (``agreed_resume`` + ``load_training_checkpoint``). Saves that fail (a full disk
on one rank, in each phase of the collective save; root ignores a read-only directory, so the
failure is injected) must end both ranks with the same line within seconds and leave the
previous checkpoint and ``latest`` as they were. The run itself, through ``megatron-grpo train``:
``test_train_falls_back_and_fails_in_one_line`` (slow).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatron_grpo.config import ConfigError
from megatron_grpo.models.errors import CheckpointError
from megatron_grpo.trainer.checkpoint import (CRC_MAX_BYTES, MANIFEST, MARKER, checkpoint_problem, choose_resume,
                                              complete_checkpoints, step_dir)
from tests.support.demo_run import ENV, ROOT, read_metrics, train_cmd
from tests.support.distributed import run_distributed

SAMPLER = {"epoch": 0, "position": 8, "seed": 1, "shuffle": True, "num_prompts": 64, "fingerprint": "f"}
SAVE_S = 60.0
"""A failed save (the whole save of step 4, writing included) must end every rank within this
(seconds): 0.5-3 s measured, 12 s once at a load average of 48 on the 2 cores. A rank left in a
collective would wait for the group's timeout (600 s) and run into run_distributed's deadline."""
HUNG_SAVE_TIMEOUT_S = 5.0
"""checkpoint.save_timeout_s in the hung-writer case: short, so that the test is."""


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tools.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("hf"), "qwen2", seed=1))


def _policy(hf_dir):
    from megatron_grpo.config import ModelConfig, OptimizerConfig
    from tests.support.policy import build_test_policy

    return build_test_policy(ModelConfig(hf_dir=hf_dir), OptimizerConfig())


def _enospc(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@contextlib.contextmanager
def _failing(mode, rank):
    """A full disk on one rank, in one phase of the save: ``rng_rank1`` (each rank's RNG file:
    a phase of the trainer's own), ``common_rank0`` (megatron-core's common.pt, written by rank
    0 alone while rank 1 goes on into the save's collectives), ``shard_rank1`` (rank 1's shard
    writer, which megatron-core reports to every rank); ``manager_killed_rank1``: the process
    that collects rank 1's write results (megatron-core's manager, forked) killed with -9;
    ``writer_killed_rank1``: a shard writer process rank 1 forks killed with -9 as it starts
    writing (megatron-core waits for its writers in ``JoinableQueue.join()``: for ever);
    ``writer_hangs_rank1``: one that never finishes (``checkpoint.save_timeout_s``)."""
    import torch
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    saved_save, saved_write = torch.save, filesystem_async._write_item

    def save(obj, f, *args, **kwargs):
        name = str(f)
        if (mode == "rng_rank1" and rank == 1 and ".rng" in name) or (
                mode == "common_rank0" and rank == 0 and name.endswith("common.pt")):
            raise _enospc(name)
        return saved_save(obj, f, *args, **kwargs)

    def write_item(*args, **kwargs):
        raise _enospc("__1_0.distcp")

    def killed_writer(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    def hung_writer(*args, **kwargs):
        time.sleep(3600)  # a stalled filesystem: alive, never done

    torch.save = save
    if mode == "shard_rank1" and rank == 1:
        filesystem_async._write_item = write_item
    saved_writer = filesystem_async.FileSystemWriterAsync.write_preloaded_data
    if mode == "writer_killed_rank1" and rank == 1:  # the forked writer's target, looked up as it starts
        filesystem_async.FileSystemWriterAsync.write_preloaded_data = staticmethod(killed_writer)
    if mode == "writer_hangs_rank1" and rank == 1:
        filesystem_async.FileSystemWriterAsync.write_preloaded_data = staticmethod(hung_writer)
    if mode == "manager_killed_rank1" and rank == 1:  # the process rank 1's writer reports through
        manager = filesystem_async._results_queue._manager
        manager._process.kill()
        manager._process.join()
    try:
        yield
    finally:
        torch.save, filesystem_async._write_item = saved_save, saved_write
        filesystem_async.FileSystemWriterAsync.write_preloaded_data = staticmethod(saved_writer)


def _save_steps(rank, world, hf_dir, run_dir, steps, fail=None):
    """Save ``steps`` (the last one with ``fail`` injected); the last save's error and time."""
    from megatron_grpo.trainer.checkpoint import save_training_checkpoint

    from tests.support.step_equivalence import policy_step

    policy = _policy(hf_dir)
    policy_step(policy)  # Adam's moments exist, as in a run's checkpoint
    for step in steps[:-1]:
        save_training_checkpoint(run_dir, step, policy.modules, policy.optimizer,
                                 {"step": step, "sampler": SAMPLER}, keep_last=3)
    started = time.monotonic()
    with _failing(fail, rank):
        try:
            save_training_checkpoint(run_dir, steps[-1], policy.modules, policy.optimizer,
                                     {"step": steps[-1], "sampler": SAMPLER}, keep_last=3,
                                     timeout_s=HUNG_SAVE_TIMEOUT_S if fail == "writer_hangs_rank1" else None)
        except CheckpointError as e:
            return {"error": str(e), "seconds": time.monotonic() - started}
    return {"error": None}


def _resume(rank, world, hf_dir, run_dirs):
    """For each run directory: what ``agreed_resume`` chose and the step the load returned (or
    the error)."""
    from megatron_grpo.trainer.checkpoint import agreed_resume, load_training_checkpoint

    out = []
    for run_dir in run_dirs:
        policy = _policy(hf_dir)
        try:
            choice = agreed_resume(run_dir, "auto")
            state = load_training_checkpoint(choice.path, policy.modules, policy.optimizer)
            out.append({"path": choice.path.name, "note": choice.note, "step": state["step"]})
        except CheckpointError as e:
            out.append({"error": str(e)})
    return out


@pytest.fixture(scope="module")
def saved(tiny_hf, tmp_path_factory):
    """A run directory with complete checkpoints of steps 2 and 4 (2 ranks, TP=2)."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    results = run_distributed(_save_steps, 2, tiny_hf, str(run_dir), [2, 4], tp=2, pp=1, timeout_s=300)
    assert results == [{"error": None}] * 2
    return run_dir


@pytest.fixture
def run(saved, tmp_path):
    """A copy of ``saved`` to damage."""
    return Path(shutil.copytree(saved, tmp_path / "run", symlinks=True))


def _shard(ckpt: Path) -> Path:
    return sorted(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)[-1]


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated_shard": (lambda c: _cut(_shard(c)), "bytes, the manifest says"),
    "flipped_byte_in_shard": (lambda c: _flip(_shard(c)), "does not match its CRC-32"),
    "flipped_byte_in_common": (lambda c: _flip(c / "common.pt"), "common.pt does not match its CRC-32"),
    "garbage_trainer_state": (lambda c: (c / "trainer_state.json").write_text('{"step": 4, "sampl'),
                              "trainer_state.json"),
    "truncated_rng": (lambda c: _cut(c / "rng" / "rank_00001.pt"), "rng/rank_00001.pt has"),
    "missing_metadata": (lambda c: (c / ".metadata").unlink(), ".metadata is missing"),
}


def test_the_manifest_covers_every_file(saved):
    ckpt = step_dir(saved, 4)
    manifest = json.loads((ckpt / MANIFEST).read_text())["files"]
    files = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {MANIFEST, MARKER}
    assert set(manifest) == files
    assert {"trainer_state.json", "common.pt", "metadata.json", ".metadata", "rng/rank_00000.pt",
            "rng/rank_00001.pt"} <= files and any(f.endswith(".distcp") for f in files)
    for rel, entry in manifest.items():  # the tiny model's files are all small: each has its CRC
        assert entry["size"] == (ckpt / rel).stat().st_size and ("crc32" in entry) == (entry["size"] <= CRC_MAX_BYTES)
    assert checkpoint_problem(ckpt) is None and checkpoint_problem(step_dir(saved, 2)) is None


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_in_one_line(run, damage):
    hurt, problem = DAMAGE[damage]
    hurt(step_dir(run, 4))
    found = checkpoint_problem(step_dir(run, 4))
    assert found is not None and problem in found, found
    choice = choose_resume(run, "auto")
    assert choice.path == step_dir(run, 2)
    assert "\n" not in choice.note and "step_000004" in choice.note and problem in choice.note
    assert choice.note.endswith("resuming from step_000002 instead"), choice.note


def test_the_crc_catches_what_the_sizes_cannot(run):
    """The checker can fail: a byte flipped in place keeps every size; without the CRC the
    checkpoint would pass."""
    shard = _shard(step_dir(run, 4))
    size = shard.stat().st_size
    _flip(shard)
    assert shard.stat().st_size == size
    assert "does not match its CRC-32" in checkpoint_problem(step_dir(run, 4))


def test_a_checkpoint_without_a_manifest_is_accepted_on_its_marker(run):
    (step_dir(run, 4) / MANIFEST).unlink()  # as written before the manifest existed
    assert checkpoint_problem(step_dir(run, 4)) is None
    assert choose_resume(run, "auto").path == step_dir(run, 4)
    _cut(step_dir(run, 4) / "rng" / "rank_00000.pt")  # still: its RNG files must load
    assert checkpoint_problem(step_dir(run, 4)) == "rng/rank_00000.pt is unreadable"


def test_latest_is_tried_first_then_the_newest(run):
    (run / "checkpoints" / "latest").write_text("step_000002\n")
    assert choose_resume(run, "auto").path == step_dir(run, 2)
    (run / "checkpoints" / "latest").write_text("step_999999\n")  # names nothing complete
    assert choose_resume(run, "auto").path == step_dir(run, 4)


def test_an_explicit_damaged_checkpoint_is_a_user_error(run):
    _cut(_shard(step_dir(run, 4)))
    with pytest.raises(ConfigError) as e:
        choose_resume(run, str(step_dir(run, 4)))
    assert e.value.where == "checkpoint.resume" and "cannot be resumed from" in str(e.value)
    assert "\n" not in str(e.value)


def test_no_intact_checkpoint_stops_instead_of_starting_over(run):
    _cut(_shard(step_dir(run, 4)))
    (step_dir(run, 2) / "trainer_state.json").write_text("garbage")
    with pytest.raises(CheckpointError) as e:
        choose_resume(run, "auto")
    text = str(e.value)
    assert "\n" not in text and "no intact checkpoint" in text and "step_000004" in text and "step_000002" in text
    assert "checkpoint.resume: never" in text
    shutil.rmtree(run / "checkpoints")
    assert choose_resume(run, "auto").path is None  # nothing saved yet: a fresh start


def test_eval_refuses_a_damaged_checkpoint_as_a_resume_would(run, tmp_path):
    from megatron_grpo.evaluation.cli import resolve_weights

    _cut(_shard(step_dir(run, 4)))
    with pytest.raises(CheckpointError, match=r"^--checkpoint .*step_000004: .*bytes, the manifest says"):
        resolve_weights(step_dir(run, 4), tmp_path)
    (step_dir(run, 2) / "trainer_state.json").write_text("[]")
    with pytest.raises(CheckpointError, match="no intact checkpoint to resume from"):
        resolve_weights(run, tmp_path)


@pytest.mark.slow
def test_ranks_resume_the_older_checkpoint_and_load_it(saved, tiny_hf, tmp_path):
    """2 ranks: a cut shard of step 4 -> both load step 2 (and the half-written directory of an
    interrupted save is removed); step 4 without a manifest -> it loads; a checkpoint that
    passes the check and still fails megatron-core's load -> one line on both ranks."""
    damaged, legacy, unloadable = (Path(shutil.copytree(saved, tmp_path / n)) for n in ("a", "b", "c"))
    _cut(_shard(step_dir(damaged, 4)))
    (damaged / "checkpoints" / ".step_000006.pending").mkdir()
    (step_dir(legacy, 4) / MANIFEST).unlink()
    (step_dir(unloadable, 4) / MANIFEST).unlink()
    (step_dir(unloadable, 4) / ".metadata").write_bytes(b"not a pickle")
    (step_dir(unloadable, 2) / ".metadata").write_bytes(b"not a pickle")
    results = run_distributed(_resume, 2, tiny_hf, [str(damaged), str(legacy), str(unloadable)], tp=2, pp=1,
                              timeout_s=300)
    assert results[0] == results[1]
    fallback, old, broken = results[0]
    assert fallback.get("path") == "step_000002" and fallback["step"] == 2, results[0]
    assert "step_000004" in fallback["note"] and "resuming from step_000002" in fallback["note"]
    assert not (damaged / "checkpoints" / ".step_000006.pending").exists()
    assert old == {"path": "step_000004", "note": None, "step": 4}
    assert broken["error"].startswith(f"could not load checkpoint {step_dir(unloadable, 4)}: ")
    assert "\n" not in broken["error"]


@pytest.mark.slow
@pytest.mark.parametrize("fail", ["rng_rank1", "common_rank0", "shard_rank1", "manager_killed_rank1",
                                  "writer_killed_rank1", "writer_hangs_rank1"])
def test_a_failed_save_ends_every_rank_in_one_line(tiny_hf, tmp_path, fail):
    run_dir = tmp_path / "run"
    # a failure inside megatron-core's save destroys the process group of the ranks it ends
    # (models.checkpoint.AgreedSave): fresh ranks for those, not the pool's
    results = run_distributed(_save_steps, 2, tiny_hf, str(run_dir), [2, 4], fail, tp=2, pp=1, timeout_s=300,
                              fresh=fail != "rng_rank1")
    print(fail, [round(r["seconds"], 2) for r in results], results[0]["error"])
    errors = {r["error"] for r in results}
    assert len(errors) == 1, errors  # the same line on both ranks
    (line,) = errors
    assert line.startswith(f"could not save checkpoint step 4 to {run_dir / 'checkpoints'}: rank "), line
    reason = {"manager_killed_rank1": "[Errno 32] Broken pipe",
              "writer_killed_rank1": "a checkpoint writer process (pid ",
              "writer_hangs_rank1": f"rank 1: DeadlinePassed: not finished within checkpoint.save_timeout_s "
                                    f"({HUNG_SAVE_TIMEOUT_S:g} s); ",  # then how many writers were killed
              }.get(fail, "No space left on device")
    assert reason in line and "\n" not in line and len(line) < 500, line
    assert line.endswith("; the last complete checkpoint step_000002 is intact"), line
    if fail == "writer_hangs_rank1":  # killed, not left writing into the removed directory
        assert re.search(r"; \d+ checkpoint writer process(es)? still running killed;", line), line
    assert max(r["seconds"] for r in results) < SAVE_S, results
    # the previous checkpoint and latest as they were; nothing half-written left
    assert [s for s, _ in complete_checkpoints(run_dir)] == [2]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert checkpoint_problem(step_dir(run_dir, 2)) is None
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000002"]


def _error_lines(out) -> list[str]:
    """The run's error lines; none may be a traceback (the engine's progress bars may be there)."""
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    return [line for line in out.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.slow
def test_train_falls_back_and_fails_in_one_line(demo, tmp_path):
    """Through ``megatron-grpo train``: a cut shard of the newest checkpoint -> the run resumes
    from the older one with one warning line and finishes; the damaged checkpoint named as
    ``checkpoint.resume`` -> exit 2, one line. (A checkpoints path that cannot be written, a
    file where the directory must be, is the pre-flight's one line since issue 48's second
    round: test_hostile_inputs.py::test_a_run_dir_that_cannot_hold_the_run_is_refused, in
    process; it was a third launch here.)"""
    run_dir = tmp_path / "run"
    fast = ("checkpoint.save_every=1", "eval.every_n_steps=0", "engine.kind=inprocess")
    timings = {}

    def train(steps, *extra):
        started = time.monotonic()
        out = subprocess.run(train_cmd(demo, run_dir, steps, *fast, *extra), cwd=ROOT, env=ENV,
                             capture_output=True, text=True, timeout=600)
        timings[len(timings)] = round(time.monotonic() - started, 1)
        return out

    out = train(2)
    assert out.returncode == 0, out.stderr[-3000:]
    _cut(_shard(step_dir(run_dir, 2)))
    out = train(3)
    assert out.returncode == 0, out.stderr[-3000:]
    warnings = [line for line in out.stderr.splitlines() if "damaged" in line]
    assert len(warnings) == 1 and "step_000002" in warnings[0] and "resuming from step_000001" in warnings[0], \
        out.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]  # step 2 trained again from step 1's state

    _cut(_shard(step_dir(run_dir, 3)))
    out = train(4, f"checkpoint.resume={step_dir(run_dir, 3)}")
    lines = _error_lines(out)
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert "checkpoint.resume" in lines[0] and "cannot be resumed from" in lines[0], lines

    print("timings (s):", timings)


def _sgd_save_and_resume(rank, world, hf_dir, run_dir):
    """A step of plain SGD (no per-parameter state), saved, then loaded into a fresh policy:
    the weights it loads are the saved ones."""
    import torch

    from megatron_grpo.config import ModelConfig, OptimizerConfig
    from megatron_grpo.trainer.checkpoint import load_training_checkpoint, save_training_checkpoint
    from tests.support.policy import build_test_policy
    from tests.support.step_equivalence import policy_step

    sgd = OptimizerConfig(name="sgd", lr=0.5)
    policy = build_test_policy(ModelConfig(hf_dir=hf_dir), sgd)
    policy_step(policy)
    path = save_training_checkpoint(run_dir, 1, policy.modules, policy.optimizer, {"step": 1, "sampler": SAMPLER},
                                    keep_last=1)
    fresh = build_test_policy(ModelConfig(hf_dir=hf_dir), sgd)
    state = load_training_checkpoint(path, fresh.modules, fresh.optimizer)
    same = all(torch.equal(a, b) for a, b in zip(policy.modules[0].parameters(), fresh.modules[0].parameters()))
    return {"step": state["step"], "same": same}


def test_a_plain_sgd_checkpoint_resumes(tiny_hf, tmp_path):
    """megatron-core sets no ``init_state_fn`` for SGD and saves no empty state: the load raised
    ``TypeError: 'NoneType' object is not callable``, then ``KeyError: 'state'``."""
    results = run_distributed(_sgd_save_and_resume, 2, tiny_hf, str(tmp_path / "run"), tp=2, pp=1, timeout_s=300)
    assert results == [{"step": 1, "same": True}] * 2
