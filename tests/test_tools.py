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
