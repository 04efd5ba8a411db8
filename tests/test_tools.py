"""Every tool runs: each module of ``tools/`` and ``tools/bench/`` with a command line answers
``--help`` (one child process for all, tests/support/helps.py), and ``tools.bench.lora_vs_full``
reads its arms' runs end to end (the read that once raised ``IsADirectoryError``).

The tools' own figures are tested beside them (tests/test_bench_*.py, test_demo_seeds.py,
test_lora_vs_full_tool.py, ...); this module only proves that none of them is left unrun.
"""

from __future__ import annotations

import ast
from pathlib import Path

from megatron_grpo.metrics_log.jsonl import MetricsFile
from tests.support.helps import ROOT, run_helps
from tools.bench import lora_vs_full

NEEDS_TRL = {"tools.bench.bench_trl_worker"}
"""Run by bench_vs_trl in .venv-trl (tools/bench/setup_trl_venv.sh): TRL is not installed here."""


def tool_modules() -> list[str]:
    """``tools.X`` / ``tools.bench.X`` of every file that runs as a program (``__main__``)."""
    found = []
    for path in sorted((ROOT / "tools").rglob("*.py")):
        tree = ast.parse(path.read_text())
        runs = any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)
        if runs:
            found.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return found


def test_every_tool_answers_help():
    modules = tool_modules()
    assert len(modules) >= 30 and "tools.bench.lora_vs_full" in modules and "tools.fetch_smollm2" in modules
    assert NEEDS_TRL <= set(modules)
    results = run_helps([("python", "-m", m) for m in modules if m not in NEEDS_TRL])
    failed = [f"python -m {p[2]} --help: exit {code}\n{out}" for p, code, out in results if code != 0]
    assert not failed, "\n\n".join(failed)
    assert all(out.strip() for _, _, out in results)  # each printed its help (the tail of it is kept)


def _write_run(run_dir: Path, heldout: list[float], reward: float) -> None:
    """A run's metrics.jsonl as the trainer writes it (its own ``MetricsFile``), and the seed
    runner's ``done`` mark: the tool reads it instead of training again."""
    run_dir.mkdir(parents=True)
    metrics = MetricsFile(run_dir / "metrics.jsonl")
    metrics.append({"step": 0, "eval/heldout/pass@1": heldout[0]})
    for step in range(1, 21):
        record = {"step": step, "reward_mean": reward, "train_elapsed_s": 2.0 * step, "time/step_s": 2.0}
        if step % 10 == 0:
            record["eval/heldout/pass@1"] = heldout[step // 10]
        metrics.append(record)
    metrics.close()
    (run_dir / "done").write_text("written by tests/test_tools.py\n")


def test_lora_vs_full_reads_its_runs(tmp_path, capsys):
    for arm, heldout, reward in (("full", [0.1, 0.3, 0.5], 0.4), ("lora", [0.1, 0.2, 0.4], 0.3)):
        _write_run(tmp_path / "demo" / arm / "s1", heldout, reward)
    demo = tmp_path / "demo_model"
    (demo / "model").mkdir(parents=True)  # the demo model is only named: both runs are done
    for argv in ([], ["--table-only"]):  # the runs of finished seeds, then the table of what is there
        assert lora_vs_full.main(["--workload", "demo", "--seeds", "1", "--out", str(tmp_path), "--demo", str(demo),
                                  *argv]) == 0
        out = capsys.readouterr().out
        assert "| full | 1 | 0.100 | 0.500 | 0.400 | 40 | 2.00 |" in out
        assert "| lora | 1 | 0.100 | 0.400 | 0.300 | 40 | 2.00 |" in out
        assert (tmp_path / "demo.png").stat().st_size > 10_000


def _write_greedy_run(run_dir: Path, evals: dict[int, float], steps: int) -> None:
    """A run's metrics.jsonl with held-out greedy evaluations at ``evals`` (step -> accuracy)."""
    run_dir.mkdir(parents=True)
    metrics = MetricsFile(run_dir / "metrics.jsonl")
    for step in range(0 if 0 in evals else 1, steps + 1):
        record = {"step": step} if step == 0 else {"step": step, "reward_mean": 0.5, "train_elapsed_s": 10.0 * step}
        if step in evals:
            record["eval/greedy/pass@1"] = evals[step]
        metrics.append(record)
    metrics.close()


def test_distill_arms_reads_its_runs_and_finds_the_steps_to_the_target(tmp_path, capsys):
    from tools.bench import distill_arms

    teacher = tmp_path / "teacher"
    _write_greedy_run(teacher, {0: 0.2, 20: 0.5, 40: 0.5}, 40)
    (teacher / "hf").mkdir()
    (teacher / "hf" / "config.json").write_text("{}")
    out = tmp_path / "arms"
    _write_greedy_run(out / "grpo" / "s1", {5: 0.3, 10: 0.4, 15: 0.46, 40: 0.5}, 40)  # 0.9 x 0.5 = 0.45 at 15
    _write_greedy_run(out / "distill" / "s1", {3: 0.44, 6: 0.47, 15: 0.48}, 15)  # at 6
    assert distill_arms.main(["--teacher-run", str(teacher), "--out", str(out), "--seeds", "1", "--arms", "grpo",
                              "distill", "--table-only"]) == 0
    said = capsys.readouterr().out
    assert "untrained greedy 0.200; teacher greedy 0.500; target 90% of it = 0.450" in said
    assert "| grpo | 1 | 5: 0.300 (50) / 10: 0.400 (100) / 15: 0.460 (150) / 40: 0.500 (400) | 15 (150) |" in said
    assert "| distill | 1 | 3: 0.440 (30) / 6: 0.470 (60) / 15: 0.480 (150) | 6 (60) |" in said
    assert "distill / grpo steps to the target: 0.40" in said
    assert distill_arms.main(["--teacher-run", str(tmp_path / "none"), "--table-only"]) == 2
