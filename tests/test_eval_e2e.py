"""Held-out evaluation on the real pipeline: `megatron-grpo train` (TP=2, in-process engine)
evaluating before step 1 (`eval.at_start`) and every 2 steps, a resumed run that neither repeats nor skips an evaluation, and
`megatron-grpo eval` on a trainer checkpoint (same numbers as in training) and, with a launched
engine, on an HF directory (greedy accuracy equal to transformers' argmax). The run also scores with a
file-path reward on token ids, loaded by the launched ranks without PYTHONPATH."""

import json
import shutil
import subprocess
import sys
from math import comb

import pytest

from megatron_grpo.data.synthetic import all_problems
from megatron_grpo.runtime.files import write_text_atomic
from tests.support.demo_run import DEMO_ENGINE, ENV, ROOT, read_metrics, train_cmd

STEPS = 4
REWARD_FILE = "def ids_len(response_ids, finish_reason):\n    return float(len(response_ids))\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, demo):
    root = tmp_path_factory.mktemp("eval_e2e")
    (root / "plugin").mkdir()
    (root / "plugin" / "len_reward.py").write_text(REWARD_FILE)
    label = "ids_len"  # a file path's default label: its function's name
    # the in-process engine: the training run's and `eval --checkpoint`'s (the eval CLI's launched
    # engine is the HF-directory test's)
    extra = ("engine.kind=inprocess", "eval.at_start=true", "eval.every_n_steps=2", "checkpoint.save_every=2",
             "eval.pass_k=[1,4,8]",
             f"reward.functions=[{{name: math_exact_match}}, {{name: '{root}/plugin/len_reward.py:ids_len', weight: 0.0}}]")
    run_dir = root / "run"
    out = subprocess.run(train_cmd(demo, run_dir, STEPS, *extra), cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return {"root": root, "demo": demo, "run": run_dir, "extra": extra, "label": label, "stdout": out.stdout}


def eval_rows(run_dir, step):
    path = run_dir / "eval" / "heldout" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_training_evaluates_every_n_steps_on_the_engine(trained):
    rows = read_metrics(trained["run"])
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval/heldout/pass@1" in r] == [0, 2, 4]
    assert set(rows[0]) == {"step", "elapsed_s"} | {k for k in rows[0] if k.startswith(("eval/", "time/eval"))}
    for r in rows[1:]:
        assert r["train_elapsed_s"] < r["elapsed_s"]  # engine start-up, model build and the start's eval are not training
    assert rows[1]["train_elapsed_s"] < rows[1]["elapsed_s"] - rows[0]["elapsed_s"] + 1.0
    for step in (0, 2, 4):
        record, samples = rows[step], eval_rows(trained["run"], step)
        assert len(samples) == 6 * 8  # 6 held-out problems x n=8
        # pass@k recomputed by hand from the scored responses: 1 - C(n-c, k) / C(n, k)
        correct = [sum(s["correct"] for s in samples if s["prompt_index"] == i) for i in range(6)]
        for k in (1, 4, 8):
            expected = sum(1 - comb(8 - c, k) / comb(8, k) for c in correct) / 6
            assert record[f"eval/heldout/pass@{k}"] == pytest.approx(expected, abs=1e-12)
        assert record["eval/heldout/pass@1"] == pytest.approx(
            sum(s["rewards"]["math_exact_match"] for s in samples) / len(samples))
        # the file-path reward saw the engine's token ids
        assert record[f"eval/heldout/reward/{trained['label']}_mean"] == record["eval/heldout/response_len_mean"]
        assert record["time/eval_s"] > 0
    assert "eval/heldout/pass@1:" in trained["stdout"]  # the summary's eval line


@pytest.mark.slow
def test_a_resumed_run_neither_repeats_nor_skips_an_evaluation(trained):
    """Resume a copy of the run from its step-2 checkpoint (as after a crash during step 4):
    the step-2 evaluation is kept, not redone; the step-4 one is redone once, identically."""
    run = trained["root"] / "resumed"
    shutil.copytree(trained["run"], run)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    write_text_atomic(run / "checkpoints" / "latest", "step_000002\n")
    step2_file = run / "eval" / "heldout" / "step_000002.jsonl"
    before = step2_file.stat().st_mtime_ns
    out = subprocess.run(train_cmd(trained["demo"], run, STEPS, *trained["extra"]), cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "resumed from checkpoint step 2" in out.stdout
    original, resumed = read_metrics(trained["run"]), read_metrics(run)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]  # the start's evaluation is not redone
    assert [r["step"] for r in resumed if "eval/heldout/pass@1" in r] == [0, 2, 4]
    assert step2_file.stat().st_mtime_ns == before
    keys = [k for k in original[4] if k.startswith("eval/")]
    assert {k: resumed[4][k] for k in keys} == {k: original[4][k] for k in keys}
    assert eval_rows(run, 4) == eval_rows(trained["run"], 4)


def run_eval_cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "eval", "--config", "yaml_configs/demo_cpu.yaml",
                           *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)


def demo_args(demo, run_dir):
    return [DEMO_ENGINE, f"model.hf_dir={demo / 'model'}", f"data.train_file={demo / 'arithmetic.jsonl'}",
            f"trainer.run_dir={run_dir}", "logging.progress_bar=false"]


@pytest.mark.slow
def test_eval_cli_on_a_checkpoint_reproduces_the_training_evaluation(trained):
    out_dir = trained["root"] / "cli_ckpt"
    out = run_eval_cli("--checkpoint", str(trained["run"] / "checkpoints" / "step_000004"), "--out-dir", str(out_dir),
                       *demo_args(trained["demo"], trained["run"]), *trained["extra"],
                       f"eval.sets=[{{name: heldout, path: {trained['demo'] / 'arithmetic_heldout.jsonl'}, n: 8, "
                       "temperature: 1.0}]")
    assert out.returncode == 0, out.stderr[-4000:]
    (line,) = [json.loads(x) for x in out.stdout.splitlines()]
    assert line["step"] == 4 and line["set"] == "heldout"
    record = read_metrics(trained["run"])[4]
    assert {k: v for k, v in line.items() if k.startswith("eval/")} == {
        k: v for k, v in record.items() if k.startswith("eval/")}
    assert json.loads((out_dir / "eval_metrics.jsonl").read_text()) == line


@pytest.mark.slow
def test_eval_cli_on_an_hf_dir_greedy_matches_transformers(trained):
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_grpo.models.tokenizer import load_tokenizer

    demo = trained["demo"]
    problems_file = trained["root"] / "all_problems.jsonl"  # all 36: the start model gets a few right
    problems_file.write_text("".join(json.dumps({"prompt": p, "answer": str(a)}) + "\n"
                                     for p, a in all_problems(5, ["+"])))
    out = run_eval_cli("--checkpoint", str(demo / "model"), "--out-dir", str(trained["root"] / "cli_hf"),
                       *demo_args(demo, trained["root"] / "unused"),
                       f"eval.sets=[{{name: greedy, path: {problems_file}, n: 1, temperature: 0.0}}]", "eval.pass_k=[1]")
    assert out.returncode == 0, out.stderr[-4000:]
    (line,) = [json.loads(x) for x in out.stdout.splitlines()]
    # the reference: transformers' argmax of the first answer token, problem by problem
    tok = load_tokenizer(str(demo / "model"))
    model = AutoModelForCausalLM.from_pretrained(demo / "model", dtype=torch.float32)
    problems = [json.loads(x) for x in problems_file.read_text().splitlines()]
    right = 0
    with torch.no_grad():
        for p in problems:
            text = tok.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                           tokenize=False)
            ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
            right += tok.decode([int(model(input_ids=ids).logits[0, -1].argmax())]).strip() == p["answer"]
    assert 0 < right < len(problems)  # a comparison that can fail either way
    assert line["step"] == 0 and line["eval/greedy/pass@1"] == right / len(problems)
