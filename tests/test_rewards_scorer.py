"""RewardScorer: weighted sums, user functions by dotted path, one-line errors."""

import sys

import pytest

from megatron_grpo.config.base import ConfigError, build_section
from megatron_grpo.config.sections import RewardConfig
from megatron_grpo.preflight import check_reward
from megatron_grpo.rewards import RewardError, RewardScorer

USER_MODULE = """
import math

def length_penalty(response, answer, per_char=0.01):
    return -per_char * len(response)

def raises(response, answer):
    return 1 / 0 if response == "boom" else 0.0

def returns_text(response, answer):
    return "yes"

def returns_nan(response, answer):
    return math.nan

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def user_module(python_module):
    return python_module("my_rewards", USER_MODULE)


def scorer(functions):
    return RewardScorer(build_section(RewardConfig, {"functions": functions}, "reward"))


def test_weighted_sum_with_builtin_and_user_function(user_module):
    s = scorer([
        {"name": "math_exact_match"},
        {"name": "format", "weight": 0.5, "kwargs": {"style": "boxed"}},
        {"name": "my_rewards.length_penalty", "weight": 2.0, "kwargs": {"per_char": 0.1}},
    ])
    responses = ["\\boxed{12}", "12", "\\boxed{3}"]
    out = s.score(responses, ["12", "12", "12"])
    # exact: 1, 1, 0; format: 1, 0, 1; length: 10, 2, 9 chars * -0.1
    assert out.per_function == {
        "math_exact_match": [1.0, 1.0, 0.0],
        "format": [1.0, 0.0, 1.0],
        "length_penalty": pytest.approx([-1.0, -0.2, -0.9]),  # a dotted path's label: its function's name
    }
    assert out.rewards == pytest.approx([1 + 0.5 - 2.0, 1 + 0 - 0.4, 0 + 0.5 - 1.8])


def test_repeated_names_get_indexed_labels():
    s = scorer([{"name": "format", "kwargs": {"style": "boxed"}}, {"name": "format", "kwargs": {"style": "hash"}}])
    assert s.labels == ["format[0]", "format[1]"]


def test_labels_name_the_metrics(tmp_path, monkeypatch, user_module):
    (tmp_path / "file_rewards.py").write_text("def length_penalty(response, answer):\n    return 0.0\n")
    monkeypatch.chdir(tmp_path)
    file_name = f"{tmp_path}/file_rewards.py:length_penalty"
    s = scorer([{"name": "math_exact_match"}, {"name": "format", "label": "boxed"},
                {"name": "my_rewards.length_penalty"}, {"name": file_name}, {"name": "file_rewards.py:length_penalty",
                                                                            "label": "brevity"}])
    # a built-in keeps its name; a dotted or file path gives its function's name, indexed when it repeats
    assert s.labels == ["math_exact_match", "boxed", "length_penalty[2]", "length_penalty[3]", "brevity"]
    assert list(s.score(["\\boxed{1}"], ["1"]).per_function) == s.labels


@pytest.mark.parametrize("functions, expected", [
    ([{"name": "format", "label": "x"}, {"name": "math_exact_match", "label": "x"}],
     "reward.functions[1].label: 'x' is already the label of reward.functions[0]; labels name metrics and must be unique"),
    ([{"name": "format"}, {"name": "format"}, {"name": "math_exact_match", "label": "format[1]"}],
     "reward.functions[2].label: 'format[1]' is already the label of reward.functions[1]; labels name metrics and "
     "must be unique"),
    ([{"name": "format", "label": "a/b"}],
     "reward.functions[0].label: must be non-empty, without '/' or whitespace (it names metrics reward/<label>), "
     "got 'a/b'"),
    ([{"name": "format", "label": ""}], "reward.functions[0].label: must be non-empty, without '/' or whitespace"),
    ([{"name": "format", "label": "two words"}], "reward.functions[0].label: must be non-empty, without '/' or whitespace"),
    ([{"name": "my_pkg.environment"}],
     "reward.functions[0].label: 'environment' is reserved for the environment's own reward in evaluation; "
     "set another label"),
])
def test_label_validation(functions, expected):
    with pytest.raises(ConfigError) as e:
        build_section(RewardConfig, {"functions": functions}, "reward")
    assert str(e.value).startswith(expected)


def test_a_default_label_yields_to_a_given_one():
    cfg = build_section(RewardConfig, {"functions": [{"name": "format"}, {"name": "pkg.fn", "label": "format"}]}, "reward")
    assert cfg.labels == ["format[0]", "format"]


@pytest.mark.parametrize("fn, expected", [
    ("raises", "reward.functions[1] (my_rewards.raises) raised on sample 1: ZeroDivisionError: division by zero"),
    ("returns_text", "reward.functions[1] (my_rewards.returns_text) returned 'yes' (str) for sample 0; "
                     "a reward must be a finite number"),
    ("returns_nan", "reward.functions[1] (my_rewards.returns_nan) returned 'nan' (float) for sample 0; "
                    "a reward must be a finite number"),
])
def test_misbehaving_function_is_one_line_error_naming_function_and_sample(user_module, fn, expected):
    s = scorer([{"name": "math_exact_match"}, {"name": f"my_rewards.{fn}"}])
    with pytest.raises(RewardError) as e:
        s.score(["ok", "boom"], ["1", "2"])
    assert str(e.value) == expected


@pytest.mark.parametrize("functions, expected", [
    ([{"name": "no_such_module_xyz.fn"}],
     "reward.functions[0].name: cannot import module 'no_such_module_xyz' for reward 'no_such_module_xyz.fn': "
     "ModuleNotFoundError: No module named 'no_such_module_xyz'"),
    ([{"name": "format"}, {"name": "my_rewards.missing"}],
     "reward.functions[1].name: module 'my_rewards' has no attribute 'missing'"),
    ([{"name": "my_rewards.NOT_A_FUNCTION"}], "reward.functions[0].name: 'my_rewards.NOT_A_FUNCTION' is a int, not a function"),
    ([{"name": "format", "kwargs": {"style": "italic"}}],
     "reward.functions[0].kwargs.style: got 'italic', expected one of 'boxed' | 'hash' | 'boxed_or_hash' | 'number'"),
    ([{"name": "math_exact_match", "kwargs": {"use_last_number": "yes"}}],
     "reward.functions[0].kwargs.use_last_number: expected true or false, got 'yes'"),
    ([{"name": "my_rewards.length_penalty", "kwargs": {"per_token": 1}}],
     "reward.functions[0].kwargs: do not fit length_penalty(response, answer, per_char=0.01): "
     "got an unexpected keyword argument 'per_token'"),
])
def test_load_errors_name_the_config_key(user_module, functions, expected):
    with pytest.raises(ConfigError) as e:
        scorer(functions)
    assert str(e.value) == expected


def test_broken_user_module_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("import math\nraise RuntimeError('bad\\nstate')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        scorer([{"name": "broken_rewards.fn"}])
    assert str(e.value) == ("reward.functions[0].name: cannot import module 'broken_rewards' for reward "
                            "'broken_rewards.fn': RuntimeError: bad state")
    sys.modules.pop("broken_rewards", None)


@pytest.mark.parametrize("raw, expected", [
    ({"functions": [{"name": "math_exact_matc"}]},
     "reward.functions[0].name: unknown reward function 'math_exact_matc'; did you mean 'math_exact_match'? "
     "built-ins: math_exact_match, format, reasoning_gym, math_verify, remote (an HTTP server), a dotted path pkg.module.fn or a file path "
     "path/to/file.py:fn"),
    ({"functions": []}, "reward.functions: needs at least one reward function"),
    ({"functions": [{"name": "format", "weight": 0}]}, "reward.functions: every weight is 0, so every reward would be 0"),
    ({"functions": [{"name": "format", "wieght": 1}]}, "reward.functions[0].wieght: unknown key; did you mean 'weight'?"),
])
def test_reward_config_validation_without_importing(raw, expected):
    with pytest.raises(ConfigError) as e:
        check_reward(build_section(RewardConfig, raw, "reward"))
    assert str(e.value) == expected
