"""pass@k against a hand computation, the per-set metrics, the eval config, the logger's
eval display and clocks, and `megatron-grpo eval`'s one-line errors (no engine needed)."""

import subprocess
import sys
import time
from math import comb
from types import SimpleNamespace

import pytest

from megatron_grpo.config.base import ConfigError, build_section
from megatron_grpo.config.evaluation import EvalConfig
from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.config.sections import LoggingConfig
from megatron_grpo.evaluation import mean_pass_at_k, pass_at_k, set_metrics
from megatron_grpo.evaluation.runner import episode_row
from megatron_grpo.metrics_log import MetricsLogger, format_summary, read_metrics
from megatron_grpo.metrics_log.report import matching_keys
from tests.support.demo_run import ENV, ROOT


def test_pass_at_k_by_hand():
    # n=5 responses, c=2 correct, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # k=1 is the fraction correct; n-c < k means every k-subset holds a correct one
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(4, 3, 2) == 1.0 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    # a hand enumeration: all C(4,2)=6 pairs of 4 responses with the first one correct -> 3 hold it
    assert pass_at_k(4, 1, 2) == pytest.approx(3 / 6)
    for n, c, k in [(10, 3, 5), (20, 7, 4), (16, 1, 8)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), rel=1e-12)
    # stable where the binomials are astronomically large
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)
    assert mean_pass_at_k(4, [0, 1, 4], 2) == pytest.approx((0 + 0.5 + 1) / 3)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_set_metrics():
    rows = []
    for prompt, outcomes in enumerate([[1, 0, 0, 1], [0, 0, 0, 0]]):
        for j, ok in enumerate(outcomes):
            rows.append({"correct": bool(ok), "length": 2 + j, "finish_reason": "length" if j == 3 else "stop",
                         "reward": 1.5 * ok, "rewards": {"exact": float(ok), "fmt": 0.5}})
    m = set_metrics("s", 4, rows, [1, 2, 8])
    assert m == pytest.approx({
        "eval/s/pass@1": (2 / 4 + 0) / 2,
        "eval/s/pass@2": ((1 - comb(2, 2) / comb(4, 2)) + 0) / 2,   # no pass@8: n = 4
        "eval/s/response_len_mean": 3.5, "eval/s/truncated_ratio": 0.25, "eval/s/reward_mean": 1.5 * 2 / 8,
        "eval/s/reward/exact_mean": 0.25, "eval/s/reward/fmt_mean": 0.5, "eval/s/num_prompts": 2})


@pytest.mark.parametrize("raw, expected", [
    ({"sets": [{"name": "a b", "path": "x.jsonl"}]}, "eval.sets[0].name: must be letters, digits"),
    ({"sets": [{"name": "a", "path": "x.csv"}]}, "eval.sets[0].path: must end in .jsonl or .parquet"),
    ({"sets": [{"name": "a", "path": "x.jsonl", "n": 4}]}, "eval.sets[0].n: is 4 with greedy decoding"),
    ({"sets": [{"name": "a", "path": "x.jsonl"}, {"name": "a", "path": "y.jsonl"}]}, "eval.sets: set name 'a' appears twice"),
    ({"pass_k": [0]}, "eval.pass_k: must be k values >= 1"),
    # issue 64: pass@8 of a set sampled n: 4 was left out of the metrics without a word
    ({"sets": [{"name": "s", "path": "x.jsonl", "n": 4, "temperature": 1.0}], "pass_k": [1, 8]},
     "eval.pass_k: 8 is more than the responses per prompt of every set (s: n 4): pass@k needs n >= k"),
    ({"every_n_step": 3}, "eval.every_n_step: unknown key; did you mean 'every_n_steps'?"),
])
def test_eval_config_errors(raw, expected):
    with pytest.raises(ConfigError) as e:
        build_section(EvalConfig, raw, "eval")
    assert str(e.value).startswith(expected)


def test_due_steps():
    cfg = build_section(EvalConfig, {"sets": [{"name": "a", "path": "x.jsonl"}], "every_n_steps": 3}, "eval")
    assert [s for s in range(1, 11) if cfg.due(s, 10)] == [3, 6, 9, 10]
    assert not build_section(EvalConfig, {"every_n_steps": 1}, "eval").due(1, 10)  # no sets, no eval


def test_logger_train_clock_excludes_start_up_and_evals_and_survives_resume(tmp_path):
    quiet = LoggingConfig(tensorboard=False, progress_bar=False, plot=False)
    log = MetricsLogger(tmp_path, quiet, 4)
    time.sleep(0.3)  # "engine start-up": in elapsed_s, not in train_elapsed_s
    log.begin_training()
    first = log.log(1, {"reward_mean": 0.1})
    time.sleep(0.2)  # an evaluation of 0.2 s, excluded
    second = log.log(2, {"reward_mean": 0.2, "eval/a/pass@1": 0.5}, excluded_s=0.2)
    log.close()
    assert first["elapsed_s"] >= first["train_elapsed_s"] + 0.3
    assert second["train_elapsed_s"] - first["train_elapsed_s"] < 0.15
    resumed = MetricsLogger(tmp_path, quiet, 4, resumed_step=2)
    resumed.begin_training()
    third = resumed.log(3, {"reward_mean": 0.3})
    resumed.close()
    assert third["train_elapsed_s"] >= second["train_elapsed_s"] and third["elapsed_s"] >= second["elapsed_s"]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert matching_keys(records, "eval/*/pass@*") == ["eval/a/pass@1"]
    assert "eval/a/pass@1: 0.5 at step 2 -> 0.5 at step 2" in format_summary(records)


def test_progress_bar_keeps_the_last_eval(tmp_path):
    from megatron_grpo.metrics_log.logger import ProgressSink

    bar = ProgressSink(3, 0)
    bar.log(1, {"reward_mean": 0.5, "eval/held/pass@1": 0.25, "eval/held/pass@8": 0.75})
    bar.log(2, {"reward_mean": 0.6})
    assert bar.bar.postfix == "reward=0.6, eval:held=0.25"
    bar.close()


def run_eval_cli(*args):
    return subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "eval", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, expected", [
    (["--checkpoint", "{tmp}/nope"], "error: --checkpoint {tmp}/nope: not found"),
    (["--checkpoint", "{tmp}"], "error: --checkpoint {tmp}: not a Hugging Face model directory (no config.json), a "
                                "megatron-grpo checkpoint (no metadata.json) or a run directory (no checkpoints/)"),
    (["--checkpoint", "{tmp}", "eval.sets=[]"], "error: yaml_configs/demo_cpu.yaml: eval.sets: is empty: nothing to "
                                                "evaluate (list held-out sets: name, path, n, ...)"),
    (["--checkpoint", "{tmp}", "eval.pass_k=[0]"], "error: override 'eval.pass_k=[0]': eval.pass_k: must be k values >= 1, got [0]"),
])
def test_eval_cli_bad_input_is_one_line(tmp_path, args, expected):
    out = run_eval_cli("--config", "yaml_configs/demo_cpu.yaml", *[a.format(tmp=tmp_path) for a in args])
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == expected.format(tmp=tmp_path) and out.stdout == ""


# ---- evaluation episodes (episodes.environment, docs/multi_turn.md#held-out-evaluation-with-an-environment) ----


def test_an_episode_row_combines_rewards_as_in_training():
    ok = SimpleNamespace(error=None, env_reward=1.0, num_turns=2)
    values = {"exact": 0.5}
    assert episode_row(0.5, values, ok, "add") == {"reward": 1.5, "turns": 2, "env_error": None}
    assert values == {"exact": 0.5, "environment": 1.0}
    assert episode_row(0.5, {"exact": 0.5}, ok, "replace")["reward"] == 1.0
    failed = SimpleNamespace(error="timeout", env_reward=1.0, num_turns=1)
    values = {"exact": 1.0}
    assert episode_row(1.0, values, failed, "add") == {"reward": 0.0, "turns": 1, "env_error": "timeout"}
    assert values["environment"] == 0.0
    rows = [{"correct": True, "length": 9, "finish_reason": "stop", "reward": 1.0, "rewards": {"e": 1.0},
             "turns": 2, "env_error": None},
            {"correct": False, "length": 4, "finish_reason": "stop", "reward": 0.0, "rewards": {"e": 0.0},
             "turns": 1, "env_error": "error"}]
    m = set_metrics("s", 2, rows, [1])
    assert m["eval/s/turns_mean"] == 1.5 and m["eval/s/env_failures"] == 1 and m["eval/s/pass@1"] == 0.5


def _experiment(environment="calculator", **eval_raw):
    raw = {"model": {"hf_dir": "m"}, "data": {"train_file": "d.jsonl"}, "trainer": {"run_dir": "r"},
           "episodes": {"kind": "environment", "source": environment} if environment else {}, "eval": eval_raw}
    return build_section(ExperimentConfig, raw)


def test_the_environment_may_decide_correct_but_only_for_episodes():
    sets = [{"name": "a", "path": "x.jsonl"}]
    assert _experiment(sets=sets, correct_function="environment").eval.correct_function == "environment"
    with pytest.raises(ConfigError, match="eval.correct_function: environment decides only episodes, but set 'b' "
                                          "has single_turn: true"):
        _experiment(sets=sets + [{"name": "b", "path": "x.jsonl", "single_turn": True}], correct_function="environment")
    with pytest.raises(ConfigError, match="eval.correct_function: 'environment' is not a reward function label"):
        _experiment(None, sets=sets, correct_function="environment")


def test_correct_function_names_a_label():
    sets = [{"name": "a", "path": "x.jsonl"}]
    reward = {"functions": [{"name": "math_exact_match"}, {"name": "pkg.rewards.judge", "label": "judged"}]}
    raw = {"model": {"hf_dir": "m"}, "data": {"train_file": "d.jsonl"}, "trainer": {"run_dir": "r"}, "reward": reward,
           "eval": {"sets": sets, "correct_function": "judged"}}
    assert build_section(ExperimentConfig, raw).eval.correct_function == "judged"
    raw["eval"]["correct_function"] = "pkg.rewards.judge"
    with pytest.raises(ConfigError) as e:
        build_section(ExperimentConfig, raw)
    assert str(e.value) == ("eval.correct_function: 'pkg.rewards.judge' is not a reward function label; labels: "
                            "math_exact_match, judged ('pkg.rewards.judge' is the name of the function labelled 'judged')")


def test_a_k_one_set_reports_is_accepted():
    """A greedy set (n 1) beside a sampled one (n 4): pass@4 is the sampled set's (as shipped)."""
    sets = [{"name": "g", "path": "x.jsonl"}, {"name": "s", "path": "y.jsonl", "n": 4, "temperature": 1.0}]
    assert build_section(EvalConfig, {"sets": sets, "pass_k": [1, 4]}, "eval").pass_k == [1, 4]
