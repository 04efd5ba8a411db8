"""The reasoning_gym and math_verify built-ins on the real libraries (no mocks of them): right and
wrong answers, the answer extraction, timeouts that cannot hang the run (from any thread, through
the scorer, counted in reward/<label>/timeouts), one-line errors; and the worker process under
them (rewards/isolated.py)."""

import json
import os
import uuid
import threading
import time
import typing
from pathlib import Path

import pytest

from megatron_grpo.config.base import ConfigError, build_section
from megatron_grpo.config.sections import RewardConfig
from megatron_grpo.data.reasoning_gym_source import TEMPLATES, make_row
from megatron_grpo.rewards import RewardError, RewardSample, RewardScorer
from megatron_grpo.rewards.answers import ANSWER_EXTRACTORS, ExtractName
from megatron_grpo.rewards.isolated import CallTimeout, IsolatedFunction, WorkerError
from megatron_grpo.rewards.math_verify_reward import MathVerifyReward
from megatron_grpo.rewards.reasoning_gym_reward import ReasoningGymReward

reasoning_gym = pytest.importorskip("reasoning_gym")  # the `reasoning` extra, which CI installs
pytest.importorskip("math_verify")

HANG = "\\boxed{9^{9^{9^{9}}}}"
"""A sympy power that never finishes: math-verify's verify (and reasoning-gym's sympy graders)
would run for ever on it."""


def scorer(*functions):
    return RewardScorer(build_section(RewardConfig, {"functions": list(functions)}, "reward"))


def rows(task, size, seed=0, config=None):
    """Dataset rows as the tool writes them, less prompt and answer (what a reward's ``row`` holds)."""
    out = []
    for entry in reasoning_gym.create_dataset(task, size=size, seed=seed, **(config or {})):
        row = json.loads(json.dumps(make_row(entry, TEMPLATES["answer_tag"], config or {})))
        out.append(({k: v for k, v in row.items() if k not in ("prompt", "answer")}, row["answer"]))
    return out


def run_in_thread(fn, *args):
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=fn(*args)))
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    return result["value"]


@pytest.fixture(scope="module")
def math_verify_reward():
    reward = MathVerifyReward(timeout_s=2.0)
    yield reward
    reward._worker.close()


@pytest.fixture(scope="module")
def gym_reward():
    reward = ReasoningGymReward(timeout_s=2.0)
    yield reward
    reward._worker.close()


def test_the_extractors_are_the_kwarg_type():
    assert typing.get_args(ExtractName) == tuple(ANSWER_EXTRACTORS)
    text = "so <answer> 12 </answer>, no: <answer>13</answer> \\boxed{ 7 } then 8.5"
    assert {name: fn(text) for name, fn in ANSWER_EXTRACTORS.items()} == {
        "answer_tag": "13", "boxed": "7", "last_number": "8.5", "none": text}
    assert [fn("  ") for fn in ANSWER_EXTRACTORS.values()] == [None] * 4


# ---- math_verify ------------------------------------------------------------------------------


@pytest.mark.parametrize("response, answer, expected", [
    ("\\boxed{1/2}", "0.5", 1.0),
    ("so it is $\\frac{1}{2}$", "0.5", 1.0),
    ("The answer is \\boxed{\\frac{1}{2}}.", "$\\frac{1}{2}$", 1.0),
    ("12.0", "Natalia sold 48 ... #### 12", 1.0),         # a GSM8K reference: what follows ####
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),              # a bare LaTeX reference, read as $...$
    ("\\boxed{3}", "0.5", 0.0),
    ("I think 12, no wait, the answer is 13", "12", 0.0),
    ("", "0.5", 0.0),
    ("no number at all", "0.5", 0.0),
])
def test_math_verify_on_real_strings(math_verify_reward, response, answer, expected):
    assert math_verify_reward(response, answer) == expected


def test_math_verify_extract_and_unparsed_references(math_verify_reward):
    tagged = MathVerifyReward(extract="answer_tag")
    try:
        assert tagged("<answer>\\frac{1}{2}</answer> and 7", "0.5") == 1.0
        assert tagged("\\boxed{0.5} but no tag", "0.5") == 0.0  # nothing to extract: no worker call
    finally:
        tagged._worker.close()
    math_verify_reward.pop_stats()
    assert math_verify_reward("\\boxed{3}", " ") == 0.0  # as $...$ math-verify reads nearly any other text
    assert math_verify_reward.pop_stats() == {"timeouts": 0.0, "unparsed_references": 1.0}


def test_math_verify_times_out_instead_of_hanging_from_any_thread(math_verify_reward):
    math_verify_reward.pop_stats()
    start = time.monotonic()
    assert run_in_thread(math_verify_reward, HANG, "12") == 0.0  # SIGALRM would fail here: not the main thread
    assert time.monotonic() - start < 30
    assert math_verify_reward(HANG, "12") == 0.0
    assert math_verify_reward.pop_stats() == {"timeouts": 2.0, "unparsed_references": 0.0}
    assert run_in_thread(math_verify_reward, "\\boxed{12}", "12") == 1.0  # a new worker after the kill


def test_through_the_scorer_with_a_label_in_a_thread():
    s = scorer({"name": "math_verify", "label": "mv", "kwargs": {"timeout_s": 1.5}},
               {"name": "math_exact_match"})
    try:
        samples = [RewardSample(prompt="", response=r, answer="12") for r in ["\\boxed{12}", HANG, "\\boxed{11}"]]
        out = run_in_thread(s.score_samples, samples)
        assert out.per_function == {"mv": [1.0, 0.0, 0.0], "math_exact_match": [1.0, 0.0, 0.0]}
        assert out.stats == {"mv/timeouts": 1.0, "mv/unparsed_references": 0.0}
    finally:
        s.close()


# ---- reasoning_gym ----------------------------------------------------------------------------


def test_chain_sum_scored_right_and_wrong(gym_reward):
    for row, answer in rows("chain_sum", 4):
        assert gym_reward(f"Adding up: ... <answer>{answer}</answer>", row) == 1.0
        assert gym_reward(f"<answer> {answer}.0 </answer>", row) == 1.0  # its grader compares decimals
        assert gym_reward(f"<answer>{int(answer) + 1}</answer>", row) < 1.0
        assert gym_reward(answer, row) == 0.0  # no <answer> tag: nothing to grade
    row, answer = rows("chain_sum", 1)[0]
    # the grader's partial credit: a wrong answer holding the reference gets len(reference) / len(answer)
    assert gym_reward(f"<answer>{answer}0</answer>", row) == pytest.approx(len(answer) / (len(answer) + 1))


@pytest.mark.parametrize("extract, response", [("boxed", "so \\boxed{ANSWER}"), ("last_number", "3 then ANSWER"),
                                               ("none", "  ANSWER\n")])
def test_chain_sum_with_each_extract(extract, response):
    reward = ReasoningGymReward(extract=extract)
    try:
        for row, answer in rows("chain_sum", 2, seed=5):
            assert reward(response.replace("ANSWER", answer), row) == 1.0
    finally:
        reward._worker.close()


def test_the_task_config_and_the_tagged_entry_reach_the_grader(gym_reward):
    """arc_agi's grader compares with the metadata's tuples (restored from the row's JSON)."""
    (row, answer), = rows("arc_agi", 1)
    assert gym_reward(f"<answer>{answer}</answer>", row) == 1.0


def test_graders_that_raise_or_hang_score_zero_and_are_counted(gym_reward):
    gym_reward.pop_stats()
    (row, _), = rows("prime_factorization", 1)
    assert gym_reward("<answer>xyz</answer>", row) == 0.0  # its grader: int('xyz') -> ValueError
    (row, _), = rows("polynomial_multiplication", 1)
    assert run_in_thread(gym_reward, "<answer>9**9**9**9</answer>", row) == 0.0  # sympy evaluates it for ever
    assert gym_reward.pop_stats() == {"timeouts": 1.0, "grader_errors": 1.0}


def test_label_and_counters_through_the_scorer_and_one_line_errors():
    s = scorer({"name": "reasoning_gym", "label": "gym"})
    try:
        (row, answer), = rows("chain_sum", 1)
        out = s.score_samples([RewardSample(prompt="", response=f"<answer>{answer}</answer>", answer=answer, row=row),
                               RewardSample(prompt="", response="<answer>?</answer>", answer=answer, row=row)])
        assert out.per_function == {"gym": [1.0, 0.0]}
        assert out.stats == {"gym/timeouts": 0.0, "gym/grader_errors": 0.0}
        with pytest.raises(RewardError) as e:
            s.score_samples([RewardSample(prompt="", response="<answer>1</answer>", answer="1", row={"id": 3})])
        assert str(e.value) == ("reward.functions[0] (reasoning_gym) raised on sample 0: ValueError: the row has no "
                                "'entry' field: reasoning_gym scores rows made by tools/make_reasoning_gym_data.py "
                                "(fields here: id)")
        with pytest.raises(RewardError) as e:
            s.score_samples([RewardSample(prompt="", response="<answer>1</answer>", answer="1",
                                          row={"entry": {"question": "q", "answer": "1", "metadata": {}}})])
        assert "the row's entry has no metadata.source_dataset" in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(RewardError) as e:
            s.score_samples([RewardSample(prompt="", response="<answer>1</answer>", answer="1", row={
                "entry": {"question": "q", "answer": "1", "metadata": {"source_dataset": "chain_sum"}},
                "task_config": {"min_terms": 0}})])
        assert str(e.value) == ("reward.functions[0] (reasoning_gym) raised on sample 0: WorkerError: reasoning_gym: "
                                "ValueError: reasoning-gym cannot make task 'chain_sum' with the row's task_config "
                                '{"min_terms": 0}: AssertionError: min_terms must be positive')
    finally:
        s.close()


# ---- loading ----------------------------------------------------------------------------------


@pytest.mark.parametrize("function, expected", [
    ({"name": "reasoning_gym", "kwargs": {"extract": "xml"}},
     "reward.functions[0].kwargs.extract: got 'xml', expected one of 'answer_tag' | 'boxed' | 'last_number' | 'none'"),
    ({"name": "math_verify", "kwargs": {"timeout_s": 0}}, "reward.functions[0].kwargs: timeout_s must be > 0, got 0"),
    ({"name": "math_verify", "kwargs": {"timeout": 3}},
     "reward.functions[0].kwargs: do not fit math_verify(*, extract='none', timeout_s=5.0): got an unexpected "
     "keyword argument 'timeout'"),
])
def test_kwargs_are_checked_when_the_reward_loads(function, expected):
    with pytest.raises(ConfigError) as e:
        scorer(function)
    assert str(e.value) == expected


def test_a_missing_optional_package_is_one_line(monkeypatch):
    monkeypatch.setattr(ReasoningGymReward, "requires", {"reasoning_gym_not_installed": "reasoning-gym"})
    with pytest.raises(ConfigError) as e:
        scorer({"name": "reasoning_gym"})
    assert str(e.value) == ("reward.functions[0].name: reasoning_gym needs the optional package reasoning-gym: "
                            "pip install 'megatron-grpo[reasoning]'")


def test_loading_starts_no_worker():
    s = scorer({"name": "math_verify"}, {"name": "reasoning_gym"})
    assert all(f.call.fn._worker._proc is None for f in s.functions)  # the pre-flight check loads rewards too
    s.close()


# ---- the worker process -----------------------------------------------------------------------


def target(name):
    return IsolatedFunction(f"tests.support.reward_worker_targets:{name}", name)


def test_worker_answers_keeps_its_process_and_restarts_after_a_timeout():
    pid, echo, sleepy = target("pid"), target("echo"), target("sleepy")
    try:
        first = pid(timeout_s=60)
        assert pid(timeout_s=5) == first  # kept between calls
        assert echo({"a": (1, 2)}, [3], timeout_s=5) == ({"a": (1, 2)}, [3])
        start = time.monotonic()
        with pytest.raises(CallTimeout):
            sleepy(30, timeout_s=0.5)
        assert time.monotonic() - start < 5
        assert sleepy(0.01, timeout_s=60) == 0.01  # a new worker
        # the setup runs before the call, outside its deadline
        slow_setup = IsolatedFunction("tests.support.reward_worker_targets:echo", "echo",
                                      setup="tests.support.reward_worker_targets:sleepy")
        assert slow_setup("x", timeout_s=0.5, setup_args=(1.0,)) == ("x",)
        slow_setup.close()
    finally:
        for f in (pid, echo, sleepy):
            f.close()


def test_worker_errors_are_one_line_and_prints_do_not_corrupt_answers(capfd):
    noisy, raises, dies = target("noisy"), target("raises"), target("dies")
    try:
        assert noisy([1, 2], timeout_s=60) == [1, 2] and noisy("x", timeout_s=5) == "x"
        reads_stdin = target("reads_stdin")
        assert reads_stdin(timeout_s=60) == "" and reads_stdin(timeout_s=5) == ""
        reads_stdin.close()
        assert "this goes to stderr" in capfd.readouterr().err
        with pytest.raises(WorkerError, match=r"^raises: KeyError: 'bad'$"):
            raises("bad", timeout_s=60)
        with pytest.raises(WorkerError, match=r"^dies: its worker process died during a call \(exit code 3\)$"):
            dies(3, timeout_s=60)
        with pytest.raises(WorkerError, match=r"^missing: its worker process could not load "
                                              r"tests.support.reward_worker_targets:missing: AttributeError"):
            IsolatedFunction("tests.support.reward_worker_targets:missing", "missing")(timeout_s=60)
    finally:
        for f in (noisy, raises, dies):
            f.close()


def test_what_a_grader_starts_dies_with_its_worker():
    """Issue 48: a worker leads its own process group, killed whole when the worker stops."""
    marker = f"600.{uuid.uuid4().int % 10**12}2"  # unique: a stale sleep of another run never matches
    spawns = target("spawns")
    child = spawns(marker, timeout_s=60)
    os.kill(child, 0)  # running
    spawns.close()
    deadline = time.monotonic() + 5
    try:
        while _cmdline_has(child, marker):  # a killed child is a zombie (no command line) until reaped
            assert time.monotonic() < deadline, "the grader's child outlived its worker"
            time.sleep(0.05)
    finally:
        if _cmdline_has(child, marker):
            os.kill(child, 9)


def _cmdline_has(pid: int, marker: str) -> bool:
    try:
        return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
