"""The reasoning workload (docs/reasoning.md): the multi-digit addition generator, the reward
as the workload's config uses it, and, slow, the build tool and a few GRPO steps with the real
trainer on a reduced model."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import re
import subprocess
import sys
from collections import Counter

import pytest
import yaml

from megatron_grpo.config import load_config
from megatron_grpo.data.reasoning import (AdditionTask, chain_of, draw_pair, generate, is_held_out, main,
                                          prompt_of)
from megatron_grpo.rewards.registry import resolve_reward
from tests.support.demo_run import ENV, ROOT, read_metrics

CONFIG = ROOT / "yaml_configs" / "reasoning_cpu.yaml"
CLAUSE_RE = re.compile(r"^(\d) \+ (\d) \+ ([01]) = (\d+) write (\d) carry ([01]) ,$")


# ---- the generator ------------------------------------------------------------------------


def test_chain_of_a_hand_worked_sum():
    assert prompt_of(457, 68) == "what is 4 5 7 + 6 8 ?"
    assert chain_of(457, 68) == ("7 + 8 + 0 = 15 write 5 carry 1 , 5 + 6 + 1 = 12 write 2 carry 1 , "
                                 "4 + 0 + 1 = 5 write 5 carry 0 , #### 5 2 5")
    # a carry out of the last column is the answer's leading digit
    assert chain_of(95, 7).endswith("9 + 0 + 1 = 10 write 0 carry 1 , #### 1 0 2")


def parse_chain(chain: str) -> tuple[list[tuple[int, ...]], str]:
    """(column clauses as ints, the answer's digits) of a worked chain."""
    body, answer = chain.split(" #### ")
    clauses = [c.strip() + " ," for c in body.split(" ,") if c.strip()]
    return [tuple(map(int, CLAUSE_RE.match(c).groups())) for c in clauses], answer


@pytest.mark.parametrize("seed", [0, 1])
def test_every_chain_is_correct_arithmetic(seed):
    for row in generate(500, seed):
        a, b = map(int, row["prompt"].removeprefix("what is ").removesuffix(" ?").replace(" ", "").split("+"))
        assert row["answer"] == str(a + b)
        columns, answer = parse_chain(row["chain"])
        assert len(columns) == max(len(str(a)), len(str(b))) == row["digits"]
        carry = 0
        for i, (x, y, c, s, d, c_out) in enumerate(columns):
            assert (x, y, c) == ((a // 10 ** i) % 10, (b // 10 ** i) % 10, carry)
            assert s == x + y + c and d == s % 10 and c_out == s // 10
            carry = c_out
        assert answer.replace(" ", "") == row["answer"] and answer == " ".join(row["answer"])


def test_generation_is_seeded_and_distinct():
    assert generate(300, 7) == generate(300, 7)
    assert generate(300, 7) != generate(300, 8)
    rows = generate(1000, 0)
    assert len({r["prompt"] for r in rows}) == 1000


def test_held_out_split_is_disjoint_in_either_order():
    train = generate(3000, 0)
    held = generate(200, 1, held_out=True)
    pair = lambda r: frozenset(r["prompt"].removeprefix("what is ").removesuffix(" ?").replace(" ", "").split("+"))
    assert not {pair(r) for r in train} & {pair(r) for r in held}
    assert all(is_held_out(a, b) == is_held_out(b, a) for a, b in
               (draw_pair(random.Random(s), AdditionTask()) for s in range(2000)))
    share = sum(is_held_out(*draw_pair(random.Random(s), AdditionTask())) for s in range(4000)) / 4000
    assert 0.03 < share < 0.08  # one bucket of 20


def test_length_distribution_is_long_tailed():
    rows = generate(2000, 0)
    digits = Counter(r["digits"] for r in rows)
    assert min(digits) == 2 and max(digits) == AdditionTask().max_digits
    assert digits[2] > digits[3] > digits[4] > digits[6] > digits[9]
    # response words ~ tokens of the tiny tokenizer ("####" is four tokens, + EOS)
    lengths = sorted(len(r["chain"].split()) + 4 for r in rows)
    assert 35 <= sum(lengths) / len(lengths) <= 70  # tens of tokens...
    assert lengths[len(lengths) // 2] < 60 and lengths[int(0.99 * len(lengths))] > 110  # ...with a long tail
    assert lengths[-1] <= load_config(CONFIG).rollout.max_new_tokens  # the longest fits


def test_task_rejects_bad_settings(tmp_path, capsys):
    with pytest.raises(ValueError, match="max_digits"):
        AdditionTask(max_digits=1)
    with pytest.raises(ValueError, match="tail"):
        AdditionTask(tail=0.0)
    assert main(["--out", str(tmp_path / "x.jsonl"), "--max-digits", "1"]) == 2
    assert "max_digits" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "h.jsonl"), "--num", "5", "--held-out"]) == 0
    assert all(is_held_out(*map(int, json.loads(line)["prompt"][8:-2].replace(" ", "").split("+")))
               for line in (tmp_path / "h.jsonl").read_text().splitlines())


# ---- the reward, exactly as yaml_configs/reasoning_cpu.yaml configures it --------------------


@pytest.fixture(scope="module")
def reward():
    call = resolve_reward(load_config(CONFIG).reward.functions[0], 0)
    return lambda response, answer: call.fn(response, answer, **call.kwargs)


@pytest.mark.parametrize("response, answer, expected", [
    ("7 + 8 + 0 = 15 write 5 carry 1 , 5 + 6 + 1 = 12 write 2 carry 1 , 4 + 0 + 1 = 5 write 5 carry 0 , "
     "#### 5 2 5", "525", 1.0),
    ("# # # # 5 2 5", "525", 1.0),                           # as the word-level tokenizer decodes ####
    ("a wrong chain , #### 5 2 5", "525", 1.0),               # only the final answer is graded
    ("7 + 8 + 0 = 15 write 5 carry 1 , #### 5 2 4", "525", 0.0),   # wrong answer
    ("#### 5 2 5 0", "525", 0.0),                              # an extra digit
    ("7 + 8 + 0 = 15 write 5 carry 1 , 5 2 5", "525", 0.0),   # no #### marker: not read from the chain
    ("#### 5 2 5 carry", "525", 0.0),                          # junk after the answer
    ("####", "525", 0.0),                                      # truncated
    ("", "525", 0.0),
])
def test_reward_checks_only_the_final_answer(reward, response, answer, expected):
    assert reward(response, answer) == expected


# ---- the build tool ---------------------------------------------------------------------------


def load_tool():
    return importlib.import_module("tools.make_reasoning_model")


def test_tokenizer_has_every_word_of_the_format():
    tokenizer = load_tool().reasoning_tokenizer()
    row = generate(1, 0)[0]
    ids = tokenizer(f"{row['prompt']} {row['chain']}", add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert len(ids) == len(f"{row['prompt']} {row['chain']}".split()) + 3  # "####" is four "#" tokens


def test_build_is_deterministic_given_the_seed(tmp_path, capsys):
    tool = load_tool()
    args = ["--hidden", "32", "--warmup-steps", "3", "--num-train", "40", "--num-heldout", "4", "--probe", "0"]
    for name in ("a", "b"):
        assert tool.main(["--out", str(tmp_path / name), *args]) == 0
    digest = lambda name: [hashlib.sha1((tmp_path / name / f).read_bytes()).hexdigest()
                           for f in ("model/model.safetensors", "train.jsonl", "heldout.jsonl")]
    assert digest("a") == digest("b")
    assert tool.main(["--out", str(tmp_path / "a"), *args]) == 0  # already built: kept
    assert "already in" in capsys.readouterr().out


# ---- slow: build a reduced model and run GRPO steps with the real trainer ---------------------


@pytest.mark.slow
def test_build_and_a_few_grpo_steps(tmp_path):
    work = tmp_path / "reasoning"
    build = subprocess.run(
        [sys.executable, "-m", "tools.make_reasoning_model", "--out", str(work), "--warmup-steps", "40",
         "--num-train", "200", "--num-heldout", "8", "--probe", "4", "--max-new-tokens", "32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert build.returncode == 0, build.stderr[-3000:]
    assert "starting pass@1 (heldout split" in build.stdout
    report = json.loads((work / "model" / "reasoning_model.json").read_text())
    assert report["warmup_steps"] == 40 and report["warmup_loss"] < 3.0
    train = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (work / "heldout.jsonl").read_text().splitlines()]
    assert len(train) == 200 and len(held) == 8 and "chain" not in train[0]  # GRPO never sees a worked chain
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}

    run_dir = tmp_path / "run"
    overrides = [f"model.hf_dir={work / 'model'}", f"data.train_file={work / 'train.jsonl'}",
                 f"eval.sets=[{{name: heldout, path: {work / 'heldout.jsonl'}, n: 2, temperature: 1.0}}]",
                 "eval.pass_k=[1]", "eval.every_n_steps=0", f"trainer.run_dir={run_dir}", "trainer.num_steps=2",
                 "rollout.prompts_per_step=2", "rollout.num_generations=4", "rollout.max_new_tokens=32",
                 "parallel.global_batch_size=8", "checkpoint.save_every=0", "logging.progress_bar=false"]
    out = subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "train", "--config", str(CONFIG), *overrides],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("loss", "reward_mean", "entropy", "response_length_mean", "ppo_kl"):
            assert r[key] == r[key] and abs(r[key]) < 1e6, (key, r[key])  # finite
        assert r["response_length_mean"] > 1  # a chain, not one token
    assert "eval/heldout/pass@1" in rows[-1]  # eval.at_end
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["reward"]["functions"][0]["kwargs"] == {"use_last_number": False}
