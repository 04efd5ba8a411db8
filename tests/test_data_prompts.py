"""Prompt datasets: JSONL/Parquet loading, chat template, tokenization, one-line errors."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_grpo.config.base import ConfigError, build_section
from megatron_grpo.config.sections import DataConfig
from megatron_grpo.data import DataError, load_prompt_dataset
from tools.tiny import build_tokenizer, vocab


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def cfg(path, **kw):
    return DataConfig(train_file=str(path), **kw)


def test_jsonl_string_prompt_gets_chat_template_and_ids(tmp_path, tok):
    f = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "what is 7 + 5 ?", "answer": "12", "x": 1}), ""])
    ds = load_prompt_dataset(cfg(f), tok)
    assert len(ds) == 1  # the blank line is skipped
    p = ds[0]
    assert p.text == "<|user|> what is 7 + 5 ? <|assistant|>"
    v = vocab()
    assert p.prompt_ids == [v[t] for t in ["<|user|>", "what", "is", "7", "+", "5", "?", "<|assistant|>"]]
    assert p.answer == "12" and p.where == f"{f}:1" and p.index == 0


def test_system_prompt_messages_and_numeric_answer(tmp_path, tok):
    msgs = [{"role": "user", "content": "what is 1 + 1 ?"}]
    own_system = [{"role": "system", "content": "solve"}, {"role": "user", "content": "what is 2 ?"}]
    f = write_lines(tmp_path / "d.jsonl", [json.dumps({"q": msgs, "a": 2}), json.dumps({"q": own_system, "a": "2"})])
    ds = load_prompt_dataset(cfg(f, prompt_key="q", answer_key="a", system_prompt="please reply"), tok)
    assert ds[0].text == "<|system|> please reply <|user|> what is 1 + 1 ? <|assistant|>"
    assert ds[0].answer == "2"
    assert ds[1].text == "<|system|> solve <|user|> what is 2 ? <|assistant|>"  # its own system message wins


def test_without_template_the_plain_text_is_tokenized(tmp_path, tok):
    f = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "what is 3 ?", "answer": "3"})])
    p = load_prompt_dataset(cfg(f, apply_chat_template=False), tok)[0]
    v = vocab()
    assert p.text == "what is 3 ?" and p.prompt_ids == [v["what"], v["is"], v["3"], v["?"]]


def test_parquet_matches_jsonl(tmp_path, tok):
    rows = [{"prompt": "what is 4 + 4 ?", "answer": "8"}, {"prompt": "what is 9 ?", "answer": "9"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    j = write_lines(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    a, b = load_prompt_dataset(cfg(tmp_path / "d.parquet"), tok), load_prompt_dataset(cfg(j), tok)
    assert [(p.prompt_ids, p.answer) for p in a.prompts] == [(p.prompt_ids, p.answer) for p in b.prompts]
    assert a[1].where.endswith("d.parquet: row 1")


# (file lines, config kwargs, expected one-line error with {f} = the file path)
JSONL_CASES = {
    "bad_json": (['{"prompt": "a", "answer": "1"}', '{"prompt": "a" "answer": 1}'], {},
                 "{f}:2: invalid JSON: Expecting ',' delimiter (column 16)"),
    "not_object": (['["what", "1"]'], {}, "{f}:1: expected a JSON object with 'prompt' and 'answer', got list"),
    "missing_answer": (['{"prompt": "a", "answer": "1"}', "", '{"prompt": "b"}'], {}, "{f}:3: missing field 'answer'"),
    "missing_custom_prompt": (['{"prompt": "a", "answer": "1"}'], {"prompt_key": "question"},
                              "{f}:1: missing field 'question'"),
    "prompt_wrong_type": (['{"prompt": 5, "answer": "1"}'], {},
                          "{f}:1: 'prompt' must be a string or a list of chat messages, got int"),
    "answer_null": (['{"prompt": "a", "answer": null}'], {}, "{f}:1: 'answer' must be a string or a number, got null"),
    "answer_bool": (['{"prompt": "a", "answer": true}'], {}, "{f}:1: 'answer' must be a string or a number, got bool"),
    "empty_prompt": (['{"prompt": "  ", "answer": "1"}'], {}, "{f}:1: 'prompt' is an empty string"),
    "bad_message": (['{"prompt": [{"role": "user"}], "answer": "1"}'], {},
                    "{f}:1: 'prompt'[0] must be an object with string 'role' and 'content', got {{'role': 'user'}}"),
    "bad_role": (['{"prompt": [{"role": "bot", "content": "x"}], "answer": "1"}'], {},
                 "{f}:1: 'prompt'[0] has role 'bot'; expected one of system, user, assistant"),
    "too_long": (['{"prompt": "what is 1 + 1 ?", "answer": "2"}'], {"max_prompt_length": 7},
                 "{f}:1: prompt is 8 tokens, longer than data.max_prompt_length = 7"),
    "messages_without_template": (['{"prompt": [{"role": "user", "content": "x"}], "answer": "1"}'],
                                  {"apply_chat_template": False},
                                  "{f}:1: the prompt is a list of chat messages but data.apply_chat_template is "
                                  "false; use a plain string prompt"),
    "empty": ([""], {}, "{f}: the dataset is empty (no records)"),
    "system_prompt_ignored": (['{"prompt": "a", "answer": "1"}'], {"apply_chat_template": False, "system_prompt": "s"},
                              "data.system_prompt is set but data.apply_chat_template is false, so it would be ignored"),
}


@pytest.mark.parametrize("case", sorted(JSONL_CASES))
def test_bad_jsonl_is_one_line_error_naming_line(tmp_path, tok, case):
    lines, kw, expected = JSONL_CASES[case]
    f = write_lines(tmp_path / "d.jsonl", lines)
    with pytest.raises(DataError) as e:
        load_prompt_dataset(cfg(f, **kw), tok)
    assert str(e.value) == expected.format(f=f)
    assert "\n" not in str(e.value)


def test_file_level_errors(tmp_path, tok):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=r"nope.jsonl: file not found \(data.train_file\)$"):
        load_prompt_dataset(cfg(missing), tok)
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(DataError, match=r"dir.jsonl: not a regular file"):
        load_prompt_dataset(cfg(tmp_path / "dir.jsonl"), tok)
    bad_utf8 = tmp_path / "u.jsonl"
    bad_utf8.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=r"u.jsonl:2: not valid UTF-8"):
        load_prompt_dataset(cfg(bad_utf8), tok)
    junk = tmp_path / "j.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"j.parquet: not a readable Parquet file: "):
        load_prompt_dataset(cfg(junk), tok)
    pq.write_table(pa.Table.from_pylist([{"question": "a", "answer": "1"}]), tmp_path / "c.parquet")
    with pytest.raises(DataError) as e:
        load_prompt_dataset(cfg(tmp_path / "c.parquet"), tok)
    assert str(e.value) == f"{tmp_path / 'c.parquet'}: no column 'prompt' (data.prompt_key); columns: question, answer"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]),
                   tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r"n.parquet: row 1: 'answer' must be a string or a number, got null$"):
        load_prompt_dataset(cfg(tmp_path / "n.parquet"), tok)


@pytest.mark.parametrize("raw, expected", [
    ({"train_file": "d.csv"}, "data.train_file: must end in .jsonl or .parquet, got 'd.csv'"),
    ({"train_file": "d.jsonl", "answer_key": "prompt"}, "data.answer_key: must differ from prompt_key (both are 'prompt')"),
    ({"train_file": "d.jsonl", "system_prompt": ""}, "data.system_prompt: must be null or a non-empty string"),
    ({"train_file": "d.jsonl", "max_prompt_length": 0}, "data.max_prompt_length: must be >= 1, got 0"),
    ({"train_file": "d.jsonl", "prompt_key": ""}, "data.prompt_key: must name the prompt field"),
])
def test_data_config_validation(raw, expected):
    with pytest.raises(ConfigError) as e:
        build_section(DataConfig, raw, "data")
    assert str(e.value) == expected
