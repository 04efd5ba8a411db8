"""The real SmolLM2-135M-Instruct through the whole path, as a user runs it: HF -> Megatron at
PP2 under torchrun (the self-check against transformers), Megatron -> HF back (bitwise), TP2
refused in one line (9 heads); two GRPO steps of `megatron-grpo train` with the in-process
engine (fp32: the trainer scores exactly what the engine sampled, before and after an update);
`megatron-grpo eval` on the export against plain transformers' greedy accuracy; the real SGLang
serving it once, greedy tokens equal to transformers'.

The model is the session's ``smollm2_dir`` (tests/conftest.py: float32, tied embeddings, vocab
49152, ChatML with a default system prompt, eos = pad = ``<|im_end|>``). Each step is a
subprocess or a server: one PP2 conversion, one export, one 2-step run, one evaluation and one
SGLang launch for the module, kept as small as what they prove allows.
"""

from __future__ import annotations

import json
import math
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_grpo.models.self_check import DEFAULT_TOLERANCE
from tests.support.demo_run import ENV, ROOT, read_metrics
from tests.support.kill_resume import GRACE_S, process_tree, survivors
from tests.support.models_fixtures import hf_tensors
from tools.score_with_transformers import main as score_with_transformers
from megatron_grpo.config import EngineConfig, SGLangConfig
from tests.support.configs import experiment

CONFIG = "yaml_configs/smollm2_135m_chain_sum_cpu.yaml"
TO_MEGATRON = "tools.convert_hf_to_megatron"  # run as modules: python -m tools.X
TO_HF = "tools.convert_megatron_to_hf"
IM_END = "<|im_end|>"
EVAL_NEW_TOKENS = 32
"""The held-out set's response length: room for the model's one-sentence answers to end on
``<|im_end|>`` (5 of the 8 greedy ones do; the others ramble on)."""
TRAIN_NEW_TOKENS = 16
"""The training rollouts' length: what the two steps prove does not need the whole answers, and
half the tokens cut the run's CPU by a fifth (measured 85 -> 67 s)."""
FP32_LOGPROB_TOLERANCE = 1e-5
"""Largest |trainer - engine| log-prob accepted in fp32 (the mismatch metric, the sync probe)."""

# (a, b) of "What is a + b?": 16 to train on, 8 held out (none of them trained on)
TRAIN_PAIRS = [(12, 7), (25, 14), (8, 9), (31, 22), (5, 17), (44, 13), (9, 26), (16, 16),
               (27, 8), (3, 45), (21, 30), (14, 29), (6, 6), (38, 11), (19, 4), (23, 18)]
HELDOUT_PAIRS = [(9, 3), (19, 29), (6, 11), (15, 6), (19, 5), (20, 11), (19, 28), (23, 7)]


def write_problems(path: Path, pairs: list[tuple[int, int]]) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}? Answer with the number only.",
                                        "answer": str(a + b)}) + "\n" for a, b in pairs))
    return path


@pytest.fixture(scope="module")
def problems(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("problems")
    return {"train": write_problems(root / "train.jsonl", TRAIN_PAIRS),
            "heldout": write_problems(root / "heldout.jsonl", HELDOUT_PAIRS)}


def run(*args, torchrun_nproc: int | None = None, env: dict | None = None, timeout: float = 600):
    """``args`` as a subprocess of this interpreter (under torchrun with ``torchrun_nproc``) in
    the repository root; returns (CompletedProcess, wall seconds)."""
    prefix = [sys.executable]
    if torchrun_nproc:
        prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun_nproc}"]
    start = time.monotonic()
    out = subprocess.run(prefix + [str(a) for a in args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout, env=dict(ENV, PYTHONWARNINGS="ignore") if env is None else env)
    return out, time.monotonic() - start


def explain(out: subprocess.CompletedProcess) -> str:
    return f"exit {out.returncode}\n--- stdout\n{out.stdout[-2000:]}\n--- stderr\n{out.stderr[-4000:]}"


# ---- 1. conversion at PP2, export, TP2 refused ----------------------------------------------

@pytest.fixture(scope="module")
def converted(smollm2_dir, tmp_path_factory):
    """The PP2 checkpoint written by the converter under torchrun (2 ranks), and its stdout."""
    ckpt = tmp_path_factory.mktemp("pp2") / "ckpt"
    out, wall = run("-m", TO_MEGATRON, "--hf-dir", smollm2_dir, "--output-dir", ckpt, "--pp", 2, torchrun_nproc=2)
    assert out.returncode == 0, f"convert_hf_to_megatron --pp 2 failed: {explain(out)}"
    print(f"\nPP2 conversion with self-check: {wall:.1f} s")
    return ckpt, out.stdout


@pytest.mark.slow
def test_conversion_at_pp2_passes_its_self_check(converted):
    """Rank 0 prints one self-check line: the PP2 model's logits on the probe batch against
    transformers' (measured max |Δlogits| 0: bitwise, where transformers' own eager attention is
    7.5e-5 away from its SDPA, so the check does see differences of that size)."""
    ckpt, stdout = converted
    checks = [line for line in stdout.splitlines() if line.startswith("self-check")]
    assert len(checks) == 1, f"one self-check line expected (rank 0 prints it), got {checks}: {stdout[-2000:]}"
    assert checks[0].startswith("self-check OK: max |Δlogits| = "), checks[0]
    value = float(checks[0].split("= ", 1)[1].split()[0])
    assert value <= DEFAULT_TOLERANCE, checks[0]
    print(f"\n{checks[0]}")
    meta = json.loads((ckpt / "megatron_grpo.json").read_text())
    assert meta["model_type"] == "llama", meta
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp",
                                                             "__1_1.distcp"]


@pytest.fixture(scope="module")
def exported(converted, tmp_path_factory):
    """The PP2 checkpoint exported back to HF by one process (stdout included)."""
    ckpt, _ = converted
    hf_out = tmp_path_factory.mktemp("export") / "hf"
    out, wall = run("-m", TO_HF, "--ckpt-dir", ckpt, "--output-dir", hf_out)
    assert out.returncode == 0, f"convert_megatron_to_hf of the PP2 checkpoint failed: {explain(out)}"
    print(f"\nexport of the PP2 checkpoint (one process, self-check): {wall:.1f} s")
    return hf_out, out.stdout


@pytest.mark.slow
def test_export_of_the_pp2_checkpoint_is_the_original_bitwise(exported, smollm2_dir):
    """One process reads the two stages of the PP2 checkpoint and writes every tensor as the
    fetched folder holds it, bit for bit (the tied output layer not duplicated)."""
    hf_out, stdout = exported
    assert "self-check OK" in stdout, stdout[-2000:]
    got, want = hf_tensors(hf_out), hf_tensors(smollm2_dir)
    assert sorted(got) == sorted(want), (f"tensor names differ: only exported {sorted(set(got) - set(want))[:5]}, "
                                         f"only original {sorted(set(want) - set(got))[:5]}")
    assert "lm_head.weight" not in got  # tied: the embedding is the output layer
    differ = [name for name, t in want.items() if got[name].dtype != t.dtype or not torch.equal(got[name], t)]
    assert not differ, f"{len(differ)} tensors differ from the original's, e.g. {differ[:5]}"
    for name in ("config.json", "generation_config.json"):
        assert json.loads((hf_out / name).read_text()) == json.loads((smollm2_dir / name).read_text()), name
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (hf_out / name).read_bytes() == (smollm2_dir / name).read_bytes(), name


@pytest.mark.slow
def test_tp2_is_refused_in_one_line(smollm2_dir, tmp_path):
    """9 heads and 3 KV heads split at TP 1 or 3 only: --tp 2 is refused before any rank starts
    (plain python: a torchrun would be told the same on every rank), exit 2, one line."""
    out, _ = run("-m", TO_MEGATRON, "--hf-dir", smollm2_dir, "--output-dir", tmp_path / "o", "--tp", 2)
    assert out.returncode == 2, explain(out)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, f"one stderr line expected: {explain(out)}"
    assert lines[0].startswith("convert-hf-to-megatron: error: --tp 2 "), lines[0]
    assert "num_attention_heads = 9" in lines[0] and "tensor-parallel sizes that work: 1, 3" in lines[0], lines[0]
    assert not (tmp_path / "o").exists()


# ---- 2. two GRPO steps with the in-process engine --------------------------------------------

def common_overrides(model_dir: Path, problems: dict[str, Path], run_dir: Path) -> list[str]:
    """What the runs here depend on, set explicitly (the YAML's defaults may move)."""
    return [f"model.hf_dir={model_dir}", "model.dtype=float32", "engine.kind=inprocess", "engine.dtype=float32",
            f"data.train_file={problems['train']}", "data.apply_chat_template=true",
            "reward.functions=[{name: math_exact_match}]",
            f"eval.sets=[{{name: greedy, path: {problems['heldout']}, n: 1, temperature: 0.0, "
            f"max_new_tokens: {EVAL_NEW_TOKENS}}}]",
            "eval.pass_k=[1]", "eval.correct_threshold=1.0", f"trainer.run_dir={run_dir}", "trainer.seed=1234",
            "logging.progress_bar=false", "logging.plot=false", "logging.tensorboard=false"]


@pytest.mark.slow
def test_two_grpo_steps_with_the_inprocess_engine(smollm2_dir, problems, tmp_path):
    """DP2 (the YAML's layout), 2 prompts x 4 responses a step; the at-start evaluation is step 0.
    ``skip_zero_advantage_steps=false``: a step whose groups all scored alike still runs its
    log-prob pass, so the mismatch after the first update is measured whatever the rewards
    (measured: 3.1e-6 at step 1, 4.3e-6 at step 2; the in-memory sync verified both times).
    The YAML packs the rows and runs each group's prompt once (``parallel.share_prefix``): the
    mismatch bound holds the shared-prefix log-probs to the engine's, which ran every row alone."""
    run_dir = tmp_path / "run"
    out, wall = run("-m", "megatron_grpo.cli", "train", "--config", CONFIG,
                    *common_overrides(smollm2_dir, problems, run_dir),
                    "parallel.tp=1", "parallel.pp=1", "parallel.world_size=2", "trainer.num_steps=2",
                    "rollout.prompts_per_step=2", "rollout.num_generations=4", "rollout.temperature=0.7",
                    f"rollout.max_new_tokens={TRAIN_NEW_TOKENS}",
                    "parallel.global_batch_size=8", "parallel.micro_batch_size=4",
                    "algorithm.skip_zero_advantage_steps=false", "eval.at_start=true", "eval.at_end=false",
                    "eval.every_n_steps=0", "checkpoint.save_every=0", "checkpoint.resume=never")
    assert out.returncode == 0, f"megatron-grpo train failed: {explain(out)}"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2], f"steps logged: {[r['step'] for r in rows]}"
    trained = rows[1:]
    print(f"\n2 GRPO steps: {wall:.1f} s; mismatch "
          f"{[r.get('rollout_train_logprobs_abs_diff_mean') for r in trained]}, rewards "
          f"{[r['reward_mean'] for r in trained]}")
    for r in trained:
        assert r["rollout/weight_version"] == r["step"] - 1, r  # step 2 sampled the weights of update 1
        mismatch = r.get("rollout_train_logprobs_abs_diff_mean")
        assert mismatch is not None and mismatch <= FP32_LOGPROB_TOLERANCE, (
            f"step {r['step']}: trainer vs engine log-probs differ by {mismatch} (fp32: <= {FP32_LOGPROB_TOLERANCE})")
        assert r["weight_sync_verified"] == 1, f"step {r['step']}: weight sync not verified: {r}"
        probe = r.get("weight_sync_probe_logprob_abs_diff")
        assert probe is None or probe <= FP32_LOGPROB_TOLERANCE, f"step {r['step']}: sync probe differs by {probe}"
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]), r
        assert r["prefix_shared_fraction"] > 0.3, r  # a rank's group of 4 ran its ~46-token prompt once
    assert rows[0]["eval/greedy/num_prompts"] == len(HELDOUT_PAIRS)
    # responses stop on <|im_end|>, which never shows in the decoded text
    samples = [json.loads(line) for line in (run_dir / "eval" / "greedy" / "step_000000.jsonl").read_text().splitlines()]
    assert len(samples) == len(HELDOUT_PAIRS)
    stopped = [s for s in samples if s["finish_reason"] == "stop"]
    summary = [(s["finish_reason"], s["length"], s["response"][:60]) for s in samples]
    assert len(stopped) > len(samples) / 2, f"most greedy answers should end on {IM_END}: {summary}"
    assert all(s["length"] < EVAL_NEW_TOKENS for s in stopped), summary
    assert all(s["finish_reason"] == "length" and s["length"] == EVAL_NEW_TOKENS
               for s in samples if s not in stopped), summary
    assert not [s for s in samples if IM_END in s["response"] or "<|im_start|>" in s["response"]], summary
    assert (run_dir / "checkpoints" / "step_000002" / "COMPLETE").is_file()  # the final step is saved



@pytest.mark.slow
def test_two_distillation_steps_with_the_teacher_checked(smollm2_dir, problems, tmp_path):
    """On-policy distillation on the real model (docs/distillation.md): the teacher is the model
    itself, its term added to the GRPO advantage, checked against transformers at both steps. At
    step 1 teacher and student are the same weights (the reverse KL is 0 up to the training
    forward's rounding); the first update moves the student, so step 2 measures a real gap."""
    run_dir = tmp_path / "run"
    out, wall = run("-m", "megatron_grpo.cli", "train", "--config", CONFIG,
                    *common_overrides(smollm2_dir, problems, run_dir),
                    "parallel.tp=1", "parallel.pp=1", "parallel.world_size=2", "trainer.num_steps=2",
                    "rollout.prompts_per_step=2", "rollout.num_generations=4", "rollout.temperature=0.7",
                    f"rollout.max_new_tokens={TRAIN_NEW_TOKENS}", "optimizer.lr=1e-4",
                    "parallel.global_batch_size=8", "parallel.micro_batch_size=4", "eval.at_start=false",
                    "eval.at_end=false", "eval.every_n_steps=0", "checkpoint.save_every=0", "checkpoint.resume=never",
                    f"distillation.teacher={smollm2_dir}", "distillation.verify_every=1")
    assert out.returncode == 0, f"megatron-grpo train failed: {explain(out)}"
    rows = read_metrics(run_dir)
    print(f"\n2 distillation steps: {wall:.1f} s; reverse KL {[r['distill/reverse_kl'] for r in rows]}, teacher "
          f"check {[r['distill/teacher_check_abs_diff'] for r in rows]}, teacher s {[r['time/teacher_s'] for r in rows]}")
    assert [r["step"] for r in rows] == [1, 2]
    assert abs(rows[0]["distill/reverse_kl"]) <= FP32_LOGPROB_TOLERANCE
    assert rows[1]["distill/logprob_gap_abs"] > 10 * FP32_LOGPROB_TOLERANCE  # the student moved off the teacher
    for r in rows:
        assert r["distill/teacher_check_abs_diff"] <= FP32_LOGPROB_TOLERANCE, r
        assert r["time/teacher_s"] > 0 and math.isfinite(r["loss"])
        assert r["weight_sync_verified"] == 1

# ---- 3. megatron-grpo eval on the export vs transformers -------------------------------------

@pytest.mark.slow
def test_eval_cli_on_the_export_matches_transformers_greedy(exported, problems, tmp_path, capsys):
    """Same greedy accuracy on the held-out rows from `megatron-grpo eval` (the in-process
    engine) and tools/score_with_transformers.py (transformers' own generate), on the same rows
    rendered by the same config. The CLI runs without OMP_NUM_THREADS, as a user starts it (its
    own thread default applies)."""
    hf_out, _ = exported
    overrides = common_overrides(hf_out, problems, tmp_path / "unused")
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"} | {"PYTHONWARNINGS": "ignore"}
    out, eval_wall = run("-m", "megatron_grpo.cli", "eval", "--config", CONFIG, "--checkpoint", hf_out,
                         "--out-dir", tmp_path / "eval", *overrides, env=env)
    assert out.returncode == 0, f"megatron-grpo eval failed: {explain(out)}"
    (line,) = [json.loads(x) for x in out.stdout.splitlines()]
    capsys.readouterr()
    start = time.monotonic()  # in this process: its interpreter and imports are already paid for
    code = score_with_transformers(["--config", CONFIG, "--model", str(hf_out), "--set", "greedy", *overrides])
    ref_wall, said = time.monotonic() - start, capsys.readouterr()
    assert code == 0, f"score_with_transformers failed: {said.err[-3000:]}"
    ref = json.loads(said.out.strip().splitlines()[-1])
    with capsys.disabled():
        print(f"\nmegatron-grpo eval (a process): {eval_wall:.1f} s, pass@1 {line['eval/greedy/pass@1']}; "
              f"score_with_transformers (in this one): {ref_wall:.1f} s, accuracy {ref['accuracy']}")
    assert line["step"] == 0 and line["eval/greedy/num_prompts"] == ref["num_prompts"] == len(HELDOUT_PAIRS)
    responses = [json.loads(x) for x in (tmp_path / "eval" / "greedy" / "step_000000.jsonl").read_text().splitlines()]
    assert 0 < ref["accuracy"] < 1, f"a comparison that can fail either way needs 0 < accuracy < 1: {ref}"
    assert line["eval/greedy/pass@1"] == ref["accuracy"], (
        f"megatron-grpo eval {line['eval/greedy/pass@1']} != transformers {ref['accuracy']}; the engine's responses: "
        f"{[(r['correct'], r['response'][:50]) for r in responses]}")


def test_eval_cli_runs_one_torch_thread_unless_told(monkeypatch, tmp_path, capsys):
    """The eval CLI's thread default (OMP_NUM_THREADS, else 1, as the trainer's ranks): torch's
    own, a thread per core, made it 3-7x slower than the training's evaluation on a busy
    2-core machine (docs/evaluation.md)."""
    from megatron_grpo.evaluation.cli import main

    argv = ["--config", str(tmp_path / "missing.yaml"), "--checkpoint", str(tmp_path)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        assert main(argv) == 2  # the missing config: after the threads are set
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert main(argv) == 2
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert "missing.yaml" in capsys.readouterr().err


# ---- 4. the real SGLang serving the real model -----------------------------------------------

SGLANG_MEM_FRACTION = 0.5
"""SGLang on CPU sizes its KV pool from the machine's free memory: what is free after loading
the weights less (1 - fraction) x what was free before. At 0.1 (the suite's shared servers) the
weights and whatever other processes allocate meanwhile must fit in a tenth of the free memory;
on a shared machine a launch failed so ("Loaded weights leave no GPU memory for the KV cache
... Raise --mem-fraction-static above 0.124"). Half leaves room for the machine's other work;
``SGLANG_KV_CAP`` keeps the pool small all the same."""
SGLANG_KV_CAP = ["--max-total-tokens", "4096"]
"""The KV pool's size in tokens (94 MB each for K and V in fp32): three prompts of <= 54 tokens
and 16 new ones each need ~200."""

@pytest.mark.slow
def test_real_sglang_greedy_tokens_equal_transformers(smollm2_dir, tmp_path):
    """One SGLang launch on the model (fp32), three chat prompts, 16 greedy tokens each; the
    server and every process it started are gone after its stop."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_grpo.generation.client import RolloutClient
    from megatron_grpo.generation.manager import RolloutServerManager
    from megatron_grpo.wire.samples import SamplingParams
    from tests.support.sglang import require_sglang
    from tools.fetch_smollm2 import CHECK_CONVERSATIONS

    require_sglang()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
               for c in CHECK_CONVERSATIONS]
    cfg = experiment(engine=EngineConfig(
        kind="sglang", api_key=secrets.token_hex(16), dtype="float32", launch_timeout_s=600, request_timeout_s=120,
        sglang=SGLangConfig(mem_fraction_static=SGLANG_MEM_FRACTION, extra_args=SGLANG_KV_CAP)))
    start = time.monotonic()
    with RolloutServerManager(cfg, model_dir=str(smollm2_dir), run_dir=tmp_path / "run") as manager:
        launch_s = time.monotonic() - start
        tree = process_tree(manager.pid)
        with RolloutClient.from_config(cfg.engine, manager.urls) as client:
            served = client.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=16))
    left = survivors(tree)
    assert not left, f"SGLang processes alive {GRACE_S:.0f} s after the server's stop: {left}"
    print(f"\nSGLang launch: {launch_s:.1f} s")

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    with torch.no_grad():  # one prompt at a time: no padding
        expected = [model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
                    for p in prompts]
    for p, sample, want in zip(prompts, served, expected):
        got = list(sample.output_ids)
        assert got == want, (f"SGLang's greedy tokens differ from transformers' for {tokenizer.decode(p)!r}:\n"
                             f"  sglang       {got} {tokenizer.decode(got)!r} ({sample.finish_reason})\n"
                             f"  transformers {want} {tokenizer.decode(want)!r}")
    # one answer ends on <|im_end|> within the 16 tokens, another runs out: both paths are compared
    assert {s.finish_reason for s in served} == {"stop", "length"}, [s.finish_reason for s in served]
    assert all(s.output_ids[-1] == tokenizer.eos_token_id for s in served if s.finish_reason == "stop")
