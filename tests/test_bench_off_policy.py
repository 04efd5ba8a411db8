"""tools/bench/bench_off_policy.py: every arm is the configuration it is named for (loaded by the strict
config), a run's summary and the table are computed as documented (hand-checked on written
metrics files), and an unfinished run is neither counted nor kept."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_grpo.config import load_config
from tests.support.demo_run import ROOT

import tools.bench.bench_off_policy as bench

REASONING = bench.WORKLOADS["reasoning"]


def arm_config(name: str, fp8_format: str = "e5m2"):
    """The resolved config of one reasoning arm, as its run would load it."""
    cmd = bench.run_args(REASONING, REASONING.arms(fp8_format)[name], 3, 100, Path("/tmp/unused"), 20, [])
    overrides = cmd[cmd.index(REASONING.config) + 1:]
    return load_config(ROOT / REASONING.config, ["model.hf_dir=unused", *overrides])


@pytest.mark.parametrize("name", list(REASONING.arms("e5m2")))
def test_every_reasoning_arm_loads_as_named(name):
    cfg = arm_config(name)
    r, engine, opc = cfg.rollout, cfg.engine, cfg.algorithm.off_policy_correction
    assert (cfg.trainer.seed, cfg.trainer.num_steps, cfg.eval.every_n_steps) == (3, 100, 20)
    assert (cfg.parallel.tp, cfg.parallel.world_size, cfg.checkpoint.save_every) == (1, 1, 0)
    assert (engine.quantization, engine.fp8_format) == (("fp8", "e5m2") if name.startswith("fp8") else (None, "e4m3"))
    assert r.top_p == (0.8 if name.startswith("top_p") else 1.0)
    assert r.sampling_mask_replay == (name != "top_p_no_replay")
    assert r.mode == ("one_step_off_policy" if name.startswith("one_step") else
                      "async" if name.startswith("async") else "sync")
    if name.startswith("async"):
        assert r.max_staleness == int(name.split("_k")[1][0])
    corrected = name.endswith(("token_tis", "sequence_tis", "corrected")) or name in ("async_k1", "async_k2", "async_k4")
    assert (opc.tis_ratio_type is not None) == corrected
    assert opc.tis_ratio_type == ("token" if name.endswith("token_tis") else "sequence" if corrected else None)
    assert opc.sequence_mask_metric == ("geometric" if name.endswith("geo_mask") else None)


def test_fp8_format_flag_reaches_the_fp8_arms():
    assert arm_config("fp8_off", "e4m3").engine.fp8_format == "e4m3"


def rows(pass1: dict[int, float], steps: int, outside: float = 0.01) -> list[dict]:
    """metrics.jsonl rows of a run: a reward every step, held-out pass@1 at the given steps."""
    out = []
    for step in range(1, steps + 1):
        r = {"step": step, "reward_mean": 0.1 * step, "time/step_s": float(step), "is_ratio_outside_10pct": outside,
             "rollout_train_logprobs_abs_diff_mean": 0.02, "k3_kl": 0.004, "is_ratio_min": 1 / step,
             "is_ratio_max": float(step)}
        if step in pass1:
            r[bench.PASS1] = pass1[step]
        out.append(r)
    return out


def test_run_summary_by_hand():
    s = bench.run_summary(rows({2: 0.25, 4: 0.31, 6: 0.28}, 6))
    assert s["final"] == 0.28 and s["best"] == 0.31 and s["reached"] == 4 and not s["collapsed"]
    assert s["to_target_s"] == 10.0  # steps 1..4 took 1 + 2 + 3 + 4 s
    assert s["last3"] == pytest.approx((0.25 + 0.31 + 0.28) / 3)
    assert s["reward"] == pytest.approx(0.35)  # mean of 0.1 .. 0.6
    assert s["step_s"] == 4.0  # median of steps 2..6
    assert (s["rho_min"], s["rho_max"], s["outside"], s["lag"]) == (pytest.approx(1 / 6), 6.0, 0.01, 0.0)
    collapsed = bench.run_summary(rows({2: 0.2, 4: 0.05}, 4))
    assert collapsed["collapsed"] and collapsed["reached"] is None
    assert math.isnan(bench.run_summary(rows({}, 3))["final"])  # no eval: no held-out numbers
    stale = [{**r, "async/groups_stale_total": float(r["step"])} for r in rows({}, 4)]
    assert bench.run_summary(stale)["stale"] == 4.0  # the run's total, from its last step
    one_step = [{**r, "rollout/policy_lag": 1.0 * (r["step"] > 1)} for r in rows({}, 4)]
    assert bench.run_summary(one_step)["lag"] == 0.75  # one-step logs the policy lag only


def write_run(out: Path, name: str, records: list[dict]) -> None:
    (out / name).mkdir(parents=True)
    (out / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_table_counts_finished_runs_only(tmp_path):
    write_run(tmp_path, "baseline_s1", rows({2: 0.25, 4: 0.32}, 4))
    write_run(tmp_path, "baseline_s2", rows({2: 0.20, 4: 0.26}, 4))
    write_run(tmp_path, "fp8_off_s1", [{**r, "geo_sequence_mask_masked_ratio": 0.25 * (r["step"] % 2)}
                                       for r in rows({2: 0.10, 4: 0.04}, 4, outside=0.05)])
    write_run(tmp_path, "fp8_off_s2", rows({2: 0.5}, 2))  # cut short: not counted
    text = bench.table(tmp_path, REASONING, ["baseline", "fp8_off", "one_step_off"], [1, 2], 4, "cmd", {"x": 1.5})
    lines = {line.split(" (")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 0.29 (0.32, 0.26) |" in lines["baseline"] and "| 1/2, 4 | 10 | 0/2 |" in lines["baseline"]
    assert "(1/2 seeds) | 0.04 |" in lines["fp8_off"] and "| 0/1, - | - | 1/1 |" in lines["fp8_off"]
    assert "| 0.05 |" in lines["fp8_off"]  # rho outside [0.9, 1.1]
    assert lines["fp8_off"].endswith("| 0 | seqs masked 0.125 |") and lines["baseline"].endswith("| 0 | - |")
    assert "(0/2 seeds) | n/a" in lines["one_step_off"]
    assert "mean 1-min load average over the runs 1.5" in text
    bench.write_plot(tmp_path, ["baseline", "fp8_off"], [1, 2], 4)
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_unknown_arm_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--workload", "reasoning", "--arms", "fp8_of", "--table-only"])
    assert e.value.code == 2
    assert "--arms: unknown ['fp8_of'] for --workload reasoning" in capsys.readouterr().err
