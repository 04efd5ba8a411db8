"""``tools/bench_gpu.py`` without a GPU: its ``--smoke`` mode runs every part's code path on
CPU at tiny sizes (the CUDA-only parts print one line each), writes one JSON file per finished
part, and a re-run skips the parts whose file exists (without touching their files).

83-104 s measured on 2 cores shared with other jobs (load average ~14); three process starts that
import megatron-core and transformers take most of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# one train part: the other runs the same code on another shape
PARTS = ["logprobs", "train_qwen2.5-0.5b", "rollout", "weight_sync", "trl"]


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "tools/bench_gpu.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stdout.splitlines() if ln.strip()]


def test_every_train_arm_is_a_valid_config_at_full_size():
    """The arms (config overrides) load on the full-size batch's base config: a typo in a key
    fails here, not on a lent GPU."""
    from tools.bench_gpu import FULL, TRAIN_ARMS, train_config

    for name, arm in TRAIN_ARMS.items():
        cfg = train_config("unused_model_dir", FULL.train_sequences, FULL.dtype, arm)
        assert cfg.parallel.global_batch_size == FULL.train_sequences and cfg.model.dtype == "bfloat16", name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a machine without CUDA")
def test_without_cuda_and_without_smoke_it_says_so_and_exits_2(tmp_path):
    proc = _bench("--out", str(tmp_path))
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr and not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="--smoke on CPU")
def test_smoke_writes_each_part_and_a_rerun_skips_the_finished_ones(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    first = _bench("--smoke", "--out", str(out), "--work", str(work), "--parts", ",".join(PARTS))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    lines = _lines(first)
    assert all(ln.startswith("[cpu] ") for ln in lines), lines
    assert lines[-1] == "[cpu] PASS"
    assert sorted(p.name for p in out.iterdir()) == ["logprobs.json", "rollout.json", "train_qwen2.5-0.5b.json"]
    for part in ("weight_sync", "trl"):
        assert sum(ln.startswith(f"[cpu] {part}: skipped, needs CUDA") for ln in lines) == 1

    logprobs = json.loads((out / "logprobs.json").read_text())
    methods = {r["method"] for r in logprobs["rows"]}
    assert {"megatron CE (log-prob only)", "megatron CE + entropy", "ours"} <= methods
    train = json.loads((out / "train_qwen2.5-0.5b.json").read_text())
    assert train["failed_arms"] == [] and len(train["arms"]) == 2
    for arm in train["arms"].values():
        assert arm["update_tokens_per_s"] > 0 and arm["logprob_tokens_per_s"] > 0 and arm["update_mfu"] is None
        assert arm["tokens"] == sum(train["response_lengths"]) + len(train["response_lengths"]) * train["sizes"]["prompt_len"]
    rollout = json.loads((out / "rollout.json").read_text())
    assert [r["concurrency"] for r in rollout["rows"]] == [4] and rollout["rows"][0]["engine_tokens_per_s"] > 0
    # the static decode path beside the engine, on the same seeded requests (fp32 here: the same tokens)
    assert rollout["rows"][0]["static_tokens_per_s"] > 0 and rollout["rows"][0]["static_sequences_equal_to_engine"] == 4

    kept = {p: (out / f"{p}.json").stat().st_mtime_ns for p in ("logprobs", "train_qwen2.5-0.5b", "rollout")}
    second = _bench("--smoke", "--out", str(out), "--work", str(work), "--parts", ",".join(PARTS))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    lines = _lines(second)
    for part in kept:
        assert sum(ln.startswith(f"[cpu] {part}: done before") for ln in lines) == 1, lines
        assert (out / f"{part}.json").stat().st_mtime_ns == kept[part]
    assert lines[-1] == "[cpu] PASS"


def test_kernel_rows_report_their_difference_from_the_torch_op_with_the_same_settings():
    """bench_logprobs pairs each "triton..." row with the "ours..." row of the same entropy and
    in-place settings and reports max |diff| of log-prob, entropy and gradient (hand values);
    rows without a twin, and the torch rows themselves, report nothing."""
    from tools.bench_logprobs import _diffs_vs_ours

    t = torch.tensor
    outputs = {
        "ours": (t([-1.0, -2.0]), t([0.5, 0.25]), t([[0.1, -0.1]])),
        "ours inplace": (t([-1.0, -2.0]), t([0.5, 0.25]), t([[0.1, -0.1]])),
        "triton": (t([-1.0, -2.5]), t([0.5, 0.0]), t([[0.1, 0.3]])),
        "triton inplace": (t([-1.0, -2.0]), None, t([[0.1, -0.1]])),
        "triton, no twin": (t([0.0]), None, t([[0.0]])),
    }
    diffs = _diffs_vs_ours(outputs)
    assert set(diffs) == {"triton", "triton inplace"}
    assert diffs["triton"] == pytest.approx((0.5, 0.25, 0.4))
    assert diffs["triton inplace"][0] == 0.0 and diffs["triton inplace"][2] == 0.0
    assert diffs["triton inplace"][1] != diffs["triton inplace"][1]  # nan: no entropy to compare


def test_trl_part_needs_trl_in_this_interpreter(tmp_path):
    """The trl part runs TRL with the bench's own interpreter (a GPU machine's CUDA torch);
    where trl is not importable it fails in one line naming what to carry, before starting
    anything (this CPU machine keeps TRL in .venv-trl only)."""
    import importlib.util

    from tools.bench_gpu import SMOKE, part_trl

    if importlib.util.find_spec("trl") is not None:
        pytest.skip("trl is importable here")
    with pytest.raises(RuntimeError, match="trl is not importable in this interpreter: carry its wheels"):
        part_trl(SMOKE, tmp_path)
