"""The reasoning-gym data source on the real library: entries as exact JSON, the held-out split
disjoint by question, tools/make_reasoning_gym_data.py's files and its one-line errors."""

import json
import math
import os
import subprocess
import sys

import pytest

from megatron_grpo.data.reasoning_gym_source import (
    heldout_question,
    make_natural_split,
    make_split,
    split_by_question,
    TEMPLATES,
    distinct_questions,
    entry_from_json,
    entry_to_json,
    make_row,
    prompt_template,
    question_key,
    write_rows,
)
from tests.support.demo_run import ROOT

reasoning_gym = pytest.importorskip("reasoning_gym")  # the `reasoning` extra, which CI installs

TOOL = "tools.make_reasoning_gym_data"


def load_tool():
    import importlib

    return importlib.import_module(TOOL)


@pytest.fixture(scope="module")
def tool():
    return load_tool()


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def same_types(a, b) -> bool:
    """Equal and of the same types all the way down (``==`` alone takes ``1`` for ``1.0``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_types(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_types(x, y) for x, y in zip(a, b))
    return a == b


# ---- the entry as JSON ----------------------------------------------------------------------


@pytest.mark.parametrize("task", ["chain_sum", "arc_agi", "graph_color", "basic_arithmetic"])
def test_entries_come_back_exactly_from_json(task):
    for entry in reasoning_gym.create_dataset(task, size=3, seed=1):
        written = json.loads(json.dumps(entry_to_json(entry), allow_nan=False))
        assert same_types(entry_from_json(written), entry)


def test_why_the_tuples_are_tagged():
    """arc_agi compares the parsed board with the metadata's tuple of tuples: after a plain JSON
    round trip its own answer scores 0.05; read back with entry_from_json, 1.0."""
    (entry,) = reasoning_gym.create_dataset("arc_agi", size=1, seed=0)
    score = reasoning_gym.get_score_answer_fn("arc_agi")
    assert score(entry["answer"], json.loads(json.dumps(entry))) == 0.05
    assert score(entry["answer"], entry_from_json(json.loads(json.dumps(entry_to_json(entry))))) == 1.0


def test_entry_to_json_refuses_what_json_cannot_hold():
    assert entry_to_json({"a": (1, (2, 3)), 4: [True, None, 1.5]}) == {
        "__items__": [["a", {"__tuple__": [1, {"__tuple__": [2, 3]}]}], [4, [True, None, 1.5]]]}
    with pytest.raises(ValueError, match=r"^entry.metadata.x is a set, which JSON cannot hold$"):
        entry_to_json({"metadata": {"x": {1, 2}}})
    with pytest.raises(ValueError, match=r"^entry.metadata\[0\] is nan, which JSON cannot hold$"):
        entry_to_json({"metadata": [math.nan]})
    with pytest.raises(ValueError, match="the tag of a tuple"):
        entry_to_json({"m": {"__tuple__": [1]}})


# ---- rows and the split ---------------------------------------------------------------------


def test_distinct_questions_skip_repeats_and_draw_no_further_than_needed():
    def entries():
        for q in ["a b", "c", "a  b", "d", "c", "e"]:
            yield {"question": q}
        raise AssertionError("drawn past what was needed")

    kept, drawn = distinct_questions(entries(), 4)
    assert [e["question"] for e in kept] == ["a b", "c", "d", "e"] and drawn == 6
    kept, drawn = distinct_questions(iter([{"question": "x"}, {"question": " x "}]), 3)
    assert len(kept) == 1 and drawn == 2  # ran out
    assert question_key(" 1 +\n2 = ") == "1 + 2 ="


def test_the_split_deals_distinct_questions_so_both_sides_share_a_difficulty_mix():
    """chain_sum's 1-digit sums are few and repeat early: cut as "first N train, next M held
    out", the held-out side was nearly all 2-digit sums (a harder set than training)."""
    split = make_split("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
                       seed=0, num_train=400, num_heldout=200)
    questions = [question_key(e["question"]) for e in split.train + split.heldout]
    assert len(set(questions)) == 600

    def one_digit(entries):
        return sum(e["metadata"]["num_digits"] == 1 for e in entries) / len(entries)

    assert one_digit(split.train) > 0.15  # the mix this test is about
    assert abs(one_digit(split.train) - one_digit(split.heldout)) < 0.08, (one_digit(split.train),
                                                                           one_digit(split.heldout))


def test_split_by_question_keeps_repeats_on_one_side_only():
    def entries():
        for q in ["a", "b", "a", "c", " a ", "d", "b", "e", "f", "g", "h", "a"]:
            yield {"question": q}

    train, heldout, drawn = split_by_question(entries(), seed=3, num_train=6, num_heldout=2)
    side = {q: heldout_question(q, 3, 0.25) for q in "abcdefgh"}
    assert all(side[question_key(e["question"])] for e in heldout)  # each row where its hash puts it
    assert not any(side[question_key(e["question"])] for e in train)
    assert len(train) <= 6 and len(heldout) <= 2
    # the hash is the question's, whatever its whitespace, and the seed changes it
    assert heldout_question(question_key(" a "), 3, 0.25) == heldout_question("a", 3, 0.25)
    assert [heldout_question(str(i), 0, 0.3) for i in range(40)] != [heldout_question(str(i), 1, 0.3) for i in range(40)]
    assert 0.2 < sum(heldout_question(str(i), 0, 0.3) for i in range(2000)) / 2000 < 0.4


def test_the_natural_split_keeps_the_tasks_mix_and_no_question_on_both_sides():
    """chain_sum picks one digit count per problem: half its 2-term problems of 1-2 digits are
    one-digit sums (200 distinct questions, repeated). The distinct split keeps ~5% of them; the
    natural split keeps the task's half on both sides, and no held-out question is trained."""
    cfg = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    split = make_natural_split("chain_sum", cfg, seed=0, num_train=1000, num_heldout=200)
    assert len(split.train) == 1000 and len(split.heldout) == 200
    train_q = {question_key(e["question"]) for e in split.train}
    heldout_q = {question_key(e["question"]) for e in split.heldout}
    assert not train_q & heldout_q
    assert len(heldout_q) < 200  # repeats kept: the task asks its small sums again and again

    def one_digit(entries):
        return sum(e["metadata"]["num_digits"] == 1 for e in entries) / len(entries)

    assert 0.4 < one_digit(split.train) < 0.6 and 0.35 < one_digit(split.heldout) < 0.65
    distinct = make_split("chain_sum", cfg, seed=0, num_train=1000, num_heldout=200)
    assert one_digit(distinct.heldout) < 0.25  # what the natural split is for
    with pytest.raises(Exception, match="--heldout: chain_sum gave"):
        # ~200 distinct questions at a 1/1001 share: none lands in the held-out split
        make_natural_split("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                           seed=0, num_train=1000, num_heldout=1)


def test_prompt_templates_and_the_row():
    entry = {"question": "What is {x}? 3 + 4 =", "answer": 7, "metadata": {"d": (1, 2)}}
    row = make_row(entry, prompt_template("answer_tag"), {"min_terms": 2})
    assert row == {"prompt": "What is {x}? 3 + 4 =\n\nThink step by step, then give only the final answer between "
                             "<answer> and </answer> tags.",
                   "answer": "7", "entry": {"question": "What is {x}? 3 + 4 =", "answer": 7,
                                            "metadata": {"d": {"__tuple__": [1, 2]}}},
                   "task_config": {"min_terms": 2}}
    assert make_row({**entry, "answer": None}, TEMPLATES["plain"], {})["answer"] == ""
    assert make_row(entry, prompt_template("Q: {question}\nA:"), {})["prompt"] == "Q: What is {x}? 3 + 4 =\nA:"
    with pytest.raises(ValueError, match="expected one of plain, answer_tag, boxed, final_answer, chain_of_thought or a text holding"):
        prompt_template("Solve it.")


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "train.jsonl"
    write_rows([{"prompt": "p", "answer": "1"}], path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"
    with pytest.raises(ValueError):
        write_rows([{"prompt": "p", "answer": "2"}, {"prompt": "q", "answer": math.inf}], path)
    assert read_rows(path) == [{"prompt": "p", "answer": "1"}]
    assert os.listdir(tmp_path) == ["train.jsonl"]  # no temp file left behind


# ---- the tool -------------------------------------------------------------------------------


def test_the_tool_writes_disjoint_splits_the_grader_can_score(tool, tmp_path, capsys):
    out = tmp_path / "chain_sum"
    args = ["--task", "chain_sum", "--size", "60", "--heldout", "20", "--seed", "3", "--out", str(out),
            "--config", '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}']  # --task-config's alias
    assert tool.main(args) == 0
    assert "wrote 60 training and 20 held-out rows of chain_sum" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["heldout.jsonl", "train.jsonl"]  # no temp files
    train, heldout = read_rows(out / "train.jsonl"), read_rows(out / "heldout.jsonl")
    assert len(train) == 60 and len(heldout) == 20
    # a one-digit two-term sum has ~200 questions, so 80 draws repeat some: each question appears once
    questions = [question_key(r["entry"]["question"]) for r in train + heldout]
    assert len(set(questions)) == 80
    assert not {question_key(r["entry"]["question"]) for r in train} & {question_key(r["entry"]["question"])
                                                                       for r in heldout}
    score = reasoning_gym.get_score_answer_fn("chain_sum")
    for row in train + heldout:
        assert set(row) == {"prompt", "answer", "entry", "task_config"}
        entry = entry_from_json(row["entry"])
        assert row["prompt"] == TEMPLATES["answer_tag"].replace("{question}", entry["question"])
        assert row["answer"] == entry["answer"] and row["task_config"]["max_terms"] == 2
        assert score(row["answer"], entry) == 1.0
    # the same arguments write the same files
    first = (out / "train.jsonl").read_bytes()
    assert tool.main(args) == 0 and (out / "train.jsonl").read_bytes() == first
    # --split natural: repeats kept, still no question on both sides
    capsys.readouterr()
    assert tool.main(args + ["--split", "natural"]) == 0
    assert "wrote 60 training and 20 held-out rows of chain_sum" in capsys.readouterr().out
    train, heldout = read_rows(out / "train.jsonl"), read_rows(out / "heldout.jsonl")
    train_q = [question_key(r["entry"]["question"]) for r in train]
    assert len(train) == 60 and len(heldout) == 20 and len(set(train_q)) < 60
    assert not set(train_q) & {question_key(r["entry"]["question"]) for r in heldout}


@pytest.mark.parametrize("args, expected", [
    (["--task", "chain_sun"], "error: --task: unknown reasoning-gym task 'chain_sun'; did you mean 'chain_sum'? tasks: "),
    (["--task", "composite"], "error: --task: composite is not supported: it mixes tasks"),
    (["--task", "chain_sum", "--task-config", '{"bogus": 1}'],
     "error: --task-config: chain_sum has no setting 'bogus'; its settings: min_terms, max_terms, min_digits, max_digits, "
     "allow_negation"),
    (["--task", "chain_sum", "--task-config", '{"min_terms": 0}'],
     "error: --task-config: chain_sum refuses these settings: min_terms must be positive"),
    (["--task", "chain_sum", "--task-config", "min_terms=2"], "error: --task-config: not JSON: "),
    (["--task", "chain_sum", "--task-config", '{"seed": 1}'], "error: --task-config: 'seed' is set by --seed, not in --task-config"),
    (["--task", "chain_sum", "--prompt-template", "Solve."], "error: --prompt-template: expected one of plain, "),
    (["--task", "chain_sum", "--heldout", "0"], "error: --heldout: must be >= 1, got 0"),
    (["--task", "chain_sum", "--size", "500", "--task-config",
      '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "allow_negation": false}'],
     "error: --size: chain_sum gave "),
])
def test_bad_arguments_are_one_line_and_exit_2(tool, tmp_path, capsys, args, expected):
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.jsonl").write_text("old\n")
    full = {"--size": "10", "--heldout": "5", "--out": str(out)}
    for i in range(0, len(args), 2):
        full[args[i]] = args[i + 1]
    assert tool.main([tok for kv in full.items() for tok in kv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err
    assert (out / "train.jsonl").read_text() == "old\n"  # nothing written


def test_the_command_line_and_a_missing_reasoning_gym(tool, tmp_path, monkeypatch, capsys):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", TOOL, "--task", "chain_sun", "--size", "2", "--heldout", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "did you mean 'chain_sum'" in run.stderr
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if the extra were not installed
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)
    assert tool.main(["--task", "chain_sum", "--size", "2", "--heldout", "1", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == ("error: reasoning-gym is not installed "
                                       "(pip install 'megatron-grpo[reasoning]')\n")


def test_an_out_folder_that_cannot_be_written_is_one_line(tool, tmp_path, capsys):
    """Issue 64: ``--out`` under a read-only folder ended in an ``OSError`` traceback after the
    rows were made. It is now refused before, in one line naming the path, exit 2. Under a
    regular file (what stops root too), and under a read-only folder where not root."""
    (tmp_path / "a_file").write_text("")
    outs = [tmp_path / "a_file" / "out"]
    if os.geteuid() != 0:  # root writes into a read-only folder anyway
        (tmp_path / "locked").mkdir(mode=0o555)
        outs.append(tmp_path / "locked" / "out")
    for out in outs:
        assert tool.main(["--task", "chain_sum", "--size", "2", "--heldout", "1", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --out: ") and str(out.parent) in err and err.count("\n") == 1, err
