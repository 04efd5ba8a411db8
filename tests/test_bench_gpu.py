"""``tools/bench/bench_gpu.py`` without a GPU: its ``--smoke`` mode runs every part's code path on
CPU at tiny sizes (the CUDA-only parts print one line each), writes one JSON file per finished
part, and a re-run skips the parts whose file exists (without touching their files); the
smollm2_grpo part's run, stopped by SIGTERM as a spent budget stops it, saves its step and the
next call resumes it to its last step (a CI test: the smoke itself is in the extended tier).
Also: tools/bench/device_pieces.py's split/stash/join (a damaged piece or joined file refused in one
line), the GPU run's config, the summary of a run's metrics and the budget's answers.

The smoke test: 83-104 s measured on 2 cores shared with other jobs (load average ~14) before the
smollm2_grpo and lora_1.5b parts; process starts that import megatron-core and transformers take
most of it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# one train part: the other runs the same code on another shape
PARTS = ["rollout", "smollm2_grpo", "lora_1.5b", "trl", "logprobs", "train_qwen2.5-0.5b", "weight_sync"]


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tools.bench.bench_gpu", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def _lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in proc.stdout.splitlines() if ln.strip()]


def test_every_train_arm_is_a_valid_config_at_full_size():
    """The arms (config overrides) load on the full-size batch's base config: a typo in a key
    fails here, not on a lent GPU."""
    from tools.bench.bench_gpu import FULL, TRAIN_ARMS, train_config

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
    written = ["logprobs", "lora_1.5b", "rollout", "smollm2_grpo", "train_qwen2.5-0.5b"]
    assert sorted(p.name for p in out.iterdir()) == [f"{p}.json" for p in written]
    for part in ("weight_sync", "trl"):
        assert sum(ln.startswith(f"[cpu] {part}: skipped, needs CUDA") for ln in lines) == 1

    rollout = json.loads((out / "rollout.json").read_text())
    assert [(r["model"], r["concurrency"]) for r in rollout["rows"]] == [("qwen2.5-0.5b", 4), ("qwen2.5-1.5b", 4)]
    for row in rollout["rows"]:
        # the static decode path beside the engine, on the same seeded requests (fp32 here: the same tokens)
        assert row["engine_tokens_per_s"] > 0 and row["static_tokens_per_s"] > 0
        assert row["static_sequences_equal_to_engine"] == 4
    grpo = json.loads((out / "smollm2_grpo.json").read_text())
    assert grpo["steps_logged"] == 3 and [s for s, _ in grpo["accuracy_curve"]] == [0, 1, 2, 3]
    assert grpo["time_split_median_s"]["step"] > 0 and grpo["generated_tokens_per_s_median"] > 0
    lora = json.loads((out / "lora_1.5b.json").read_text())
    assert lora["full"]["update_s"] > 0 and lora["lora_results"]["update_s"] > 0
    assert lora["lora_results"]["trainable"] < lora["full"]["trainable"]
    assert lora["lora_results"]["sync_bytes"] < lora["full"]["sync_bytes"]
    logprobs = json.loads((out / "logprobs.json").read_text())
    methods = {r["method"] for r in logprobs["rows"]}
    assert {"megatron CE (log-prob only)", "megatron CE + entropy", "ours"} <= methods
    train = json.loads((out / "train_qwen2.5-0.5b.json").read_text())
    assert train["failed_arms"] == [] and len(train["arms"]) == 2
    for arm in train["arms"].values():
        assert arm["update_tokens_per_s"] > 0 and arm["logprob_tokens_per_s"] > 0 and arm["update_mfu"] is None
        assert arm["tokens"] == sum(train["response_lengths"]) + len(train["response_lengths"]) * train["sizes"]["prompt_len"]

    kept = {p: (out / f"{p}.json").stat().st_mtime_ns for p in written}
    second = _bench("--smoke", "--out", str(out), "--work", str(work), "--parts", ",".join(PARTS))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    lines = _lines(second)
    for part in kept:
        assert sum(ln.startswith(f"[cpu] {part}: done before") for ln in lines) == 1, lines
        assert (out / f"{part}.json").stat().st_mtime_ns == kept[part]
    assert lines[-1] == "[cpu] PASS"


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke's tiny CPU run")
def test_the_grpo_run_stopped_by_sigterm_saves_its_step_and_the_next_call_resumes_it(tmp_path):
    """smollm2_grpo's stop, as a spent budget makes it (SIGTERM once step 1 is logged: the test
    hook of the same path): the run finishes its step, saves it although no checkpoint was due
    (the config saves every 10 steps) and exits; the part fails with the one line saying where it
    resumes, and the next call resumes there (not from the start) and runs to the last step."""
    from dataclasses import replace

    from megatron_grpo.trainer.checkpoint import complete_checkpoints
    from tools.bench.bench_gpu import SMOKE, Budget, PartTimeUp, part_smollm2_grpo

    # the tiny run's steps take ~0.1 s: 40 of them, so that the SIGTERM surely lands mid-run
    sizes, work = replace(SMOKE, grpo_steps=40), tmp_path / "work"
    with pytest.raises(PartTimeUp) as stopped:
        part_smollm2_grpo(sizes, work, Budget(600), stop_after_step=1)
    (saved, _), = complete_checkpoints(work / "smollm2_grpo" / "run")
    line = str(stopped.value)
    assert "\n" not in line and line.startswith("asked to stop after step 1: SIGTERM at step"), line
    assert 1 <= saved < sizes.grpo_steps and saved % 10 != 0  # not one of the config's own saves
    assert line.endswith(f"resumes on the next call from step {saved} (saved on the stop)"), line
    out = part_smollm2_grpo(sizes, work, Budget(600))
    assert [launch["from_step"] for launch in out["launches"]] == [None, saved]
    assert out["steps_logged"] == sizes.grpo_steps and out["accuracy_before"] is not None
    assert out["accuracy_after"] is not None


def test_the_gpu_run_config_validates_at_load_with_and_without_the_smoke_overrides():
    """yaml_configs/smollm2_135m_chain_sum_gpu.yaml is what smollm2_grpo runs on the GPU: strict
    loading accepts it (bf16, the in-process engine decoding statically, chain-of-thought lengths,
    a reward that needs no package the lent machine lacks) and the smoke's CPU overrides of it."""
    from megatron_grpo.config.experiment import load_config
    from tools.bench.bench_gpu import SMOKE_GRPO_OVERRIDES, SMOLLM2_CONFIG

    cfg = load_config(ROOT / SMOLLM2_CONFIG, [], world_size=1)
    assert cfg.model.dtype == "bfloat16" and cfg.engine.kind == "inprocess" and cfg.engine.embedded.decode == "static"
    assert cfg.rollout.max_new_tokens == 512 and cfg.trainer.num_steps >= 100
    assert cfg.rollout.prompts_per_step * cfg.rollout.num_generations == cfg.engine.embedded.max_batch_size
    assert [f.name for f in cfg.reward.functions] == ["math_exact_match"]
    assert cfg.checkpoint.resume == "auto" and 0 < cfg.checkpoint.save_every <= 10 and cfg.eval.at_start
    smoke = load_config(ROOT / SMOLLM2_CONFIG, list(SMOKE_GRPO_OVERRIDES), world_size=1)
    assert smoke.model.dtype == "float32" and smoke.parallel.global_batch_size == 4


def _pieces(tmp_path, size=300_000, max_mib=0.1):
    from tools.bench.device_pieces import split

    blob = tmp_path / "blob.gguf"
    blob.write_bytes(os.urandom(size))
    return blob, split(blob, tmp_path / "carry", max_mib)


def test_pieces_split_stash_and_join_round_trip(tmp_path):
    """Three pieces, carried one per call: each stashed as it comes, the file joined once all came
    (byte for byte), a missing one named."""
    from tools.bench.device_pieces import PieceError, join, stash

    blob, pieces = _pieces(tmp_path)
    assert [p.name for p in pieces] == [f"blob.gguf.part-{i}-of-3" for i in (1, 2, 3)]
    assert all(p.stat().st_size < 0.1 * 2**20 + 4096 for p in pieces)
    stash_dir = tmp_path / "stash"
    for piece in pieces[:2]:  # calls 1 and 2: a piece each
        call = tmp_path / f"call_{piece.name}"
        call.mkdir()
        piece.rename(call / piece.name)
        stash(call, stash_dir)
    with pytest.raises(PieceError, match=r"piece\(s\) blob.gguf.part-3-of-3 not carried yet"):
        join("blob.gguf", tmp_path / "out" / "blob.gguf", [stash_dir])
    assert not (tmp_path / "out").exists()
    dest = join("blob.gguf", tmp_path / "out" / "blob.gguf", [tmp_path / "carry", stash_dir])  # call 3's piece
    assert dest.read_bytes() == blob.read_bytes()


def test_a_damaged_piece_or_joined_file_is_refused_in_one_line(tmp_path):
    from tools.bench.device_pieces import Header, main, read_header

    blob, pieces = _pieces(tmp_path)
    data = bytearray(pieces[1].read_bytes())
    data[-1] ^= 0xFF  # one byte of the payload flipped in transit
    pieces[1].write_bytes(bytes(data))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEGATRON_GRPO_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "tools.bench.device_pieces", "join", "--name", "blob.gguf", "--dest",
                           str(tmp_path / "out.gguf"), "--from", str(tmp_path / "carry")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert "blob.gguf.part-2-of-3: sha256" in proc.stderr and "differs from its header's" in proc.stderr
    assert not (tmp_path / "out.gguf").exists()

    # pieces intact but all claiming another whole file: the join's check refuses the result
    _, pieces = _pieces(tmp_path)
    for piece in pieces:
        header, start = read_header(piece)
        forged = json.dumps({**header.__dict__, "sha256": "0" * 64}).encode() + b"\n"
        piece.write_bytes(forged + piece.read_bytes()[start:])
        assert isinstance(read_header(piece)[0], Header)
    assert main(["join", "--name", "blob.gguf", "--dest", str(tmp_path / "out.gguf"),
                 "--from", str(tmp_path / "carry")]) == 2
    assert not (tmp_path / "out.gguf").exists() and not list(tmp_path.glob(".out.gguf*"))


def test_without_the_gguf_or_its_pieces_smollm2_grpo_names_what_to_carry(tmp_path, monkeypatch):
    import tools.bench.bench_gpu as bench

    monkeypatch.setenv("MEGATRON_GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bench, "CARRY_DIR", tmp_path / "carry")
    if any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate")):
        pytest.skip("gguf or accelerate is not installed here (its own one-line answer)")
    with pytest.raises(RuntimeError, match=r"no SmolLM2 GGUF in .* and no piece of it in .*: carry runs/carry/"
                                           r"SmolLM2-135M-Instruct.Q4_1.gguf.part-1-of-2 on one call and "
                                           r".part-2-of-2 on the next"):
        bench.smollm2_model(tmp_path / "work")


def test_a_spent_budget_stops_the_rollout_part_before_a_new_row_and_kept_rows_are_reused(tmp_path):
    from tools.bench.bench_gpu import SMOKE, Budget, PartTimeUp, _sizes_key, part_rollout

    with pytest.raises(PartTimeUp, match="budget of 0 s spent after 0 of 2 rows .*; resumes on the next call"):
        part_rollout(SMOKE, tmp_path, Budget(1e-9))
    kept = tmp_path / "rollout_rows"
    kept.mkdir()
    for model in SMOKE.rollout_models:  # rows an earlier call measured: nothing left to run
        (kept / f"{model}-x4.json").write_text(json.dumps({"sizes": _sizes_key(SMOKE), "row": {"model": model}}))
    assert [r["model"] for r in part_rollout(SMOKE, tmp_path, Budget(1e-9))["rows"]] == list(SMOKE.rollout_models)


def test_no_part_starts_once_the_calls_budget_is_spent(tmp_path, capsys):
    from tools.bench.bench_gpu import main

    assert main(["--smoke", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                 "--parts", "rollout,logprobs", "--budget-s", "1e-9"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2:] == ["[cpu] FAIL: not started: rollout, logprobs (this call's budget of 0 s is spent); the next "
                          "call runs them", "[cpu] FAIL: rollout"]
    assert not list((tmp_path / "out").iterdir())


def test_the_grpo_summary_reads_accuracy_time_split_and_throughput_from_the_metrics():
    from tools.bench.bench_gpu import grpo_summary

    def step(n, **extra):
        return {"step": n, "reward_mean": n / 10, "rollout_tokens_per_s": 1000.0 * n, "time/generate_s": 2.0 * n,
                "time/reward_s": 0.1, "time/logprob_s": 0.2, "time/train_s": 1.0, "time/sync_s": 0.05,
                "time/eval_s": 0.0, "time/step_s": 2.0 * n + 1.35, **extra}

    records = [{"step": 0, "eval/greedy/pass@1": 0.2}, step(1), step(2, **{"eval/greedy/pass@1": 0.3}), step(3),
               step(4, **{"eval/greedy/pass@1": 0.5})]
    out = grpo_summary(records, steps=4)
    assert (out["accuracy_before"], out["accuracy_after"]) == (0.2, 0.5)
    assert out["accuracy_curve"] == [[0, 0.2], [2, 0.3], [4, 0.5]] and out["steps_logged"] == 4
    assert out["time_split_median_s"]["generate"] == 5.0 and out["time_split_median_s"]["update"] == 1.0
    assert out["generated_tokens_per_s_median"] == 2500.0 and len(out["curve"]) == 5
    assert grpo_summary(records[:3], steps=4)["accuracy_after"] is None  # the last step not reached


def test_kernel_rows_report_their_difference_from_the_torch_op_with_the_same_settings():
    """bench_logprobs pairs each "triton..." row with the "ours..." row of the same entropy and
    in-place settings and reports max |diff| of log-prob, entropy and gradient (hand values);
    rows without a twin, and the torch rows themselves, report nothing."""
    from tools.bench.bench_logprobs import _diffs_vs_ours

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

    from tools.bench.bench_gpu import SMOKE, part_trl

    if importlib.util.find_spec("trl") is not None:
        pytest.skip("trl is importable here")
    with pytest.raises(RuntimeError, match="trl is not importable in this interpreter: carry its wheels"):
        part_trl(SMOKE, tmp_path)
