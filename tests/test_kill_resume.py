"""CI's short version of tests/support/kill_resume.py: kill -9 the demo run (once during a checkpoint
save when the dice say so), resume, and require the uninterrupted run's metrics and prompts and
no process left behind: single-turn with the in-process engine (the YAML's; its uninterrupted
run uses the launched embedded engine, which takes the same steps), and multi-turn episodes of
an environment with the launched embedded engine (its process killed with the tree and
relaunched by the resumed run). The single-turn run with the embedded engine, killed during a
save, is left to tests/support/kill_resume.py: what it added over these two (the engine's process in a
tree killed during a save) cost two more launches of CI's bounded time."""

import subprocess
import time

import psutil
import pytest

from tests.support.demo_run import ENV, NUDGE, NUDGE_OVERRIDES, ROOT
from tests.support.kill_resume import main, run_cmd
from tests.support.launch_nodes import running_with

STEPS = 6


@pytest.fixture(scope="module")
def straight(demo, tmp_path_factory):
    """The uninterrupted 6-step run (embedded engine) the in-process engine's killed run must
    equal: it takes the embedded run's steps (tests/test_trainer_e2e.py), within the
    comparison's 1e-6."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    assert subprocess.run(run_cmd(demo, run_dir, STEPS), cwd=ROOT, env=ENV, capture_output=True).returncode == 0
    return run_dir


@pytest.mark.slow
def test_kill_minus_9_and_resume(demo, straight, tmp_path, capsys):
    # seed 1's die: the kill lands during a checkpoint save (the environment run below is
    # killed mid-run; the full version, tests/support/kill_resume.py --kills 20, kills at many more
    # moments, resumed runs included)
    code = main(["--kills", "1", "--steps", str(STEPS), "--seed", "1", "--workdir", str(tmp_path), "--max-seconds",
                 "900", "--demo", str(demo), f"--straight={straight}", "--extra=engine.kind=inprocess"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "kills: 1," in out and "during a save" in out, out  # the run did not finish before its kill
    assert "checkpoints lost: 0" in out and "metrics equal: yes" in out and "prompts equal: yes" in out
    # nothing outlives the kills: not the ranks, not the engine, not the checkpoint writers a
    # rank forked when it was killed during a save (they hold copies of its sockets)
    assert running_with(str(tmp_path)) == []


@pytest.mark.slow
def test_kill_minus_9_and_resume_with_an_environment(demo, tmp_path, capsys):
    started = time.time()
    env_file = tmp_path / "nudge.py"
    env_file.write_text(NUDGE)
    extra = ["episodes.kind=environment", f"episodes.source={env_file}:Nudge", *NUDGE_OVERRIDES]
    # seed 37's die: the kill lands 0.7 s after the run's first step, mid-run (seed 2's, 7.6 s,
    # came after the run's last step: it finished unkilled)
    code = main(["--kills", "1", "--steps", "6", "--seed", "37", "--workdir", str(tmp_path), "--max-seconds", "900",
                 "--demo", str(demo), *(f"--extra={e}" for e in extra)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "kills: 1," in out and "after 0.7s" in out, out
    assert "checkpoints lost: 0" in out and "metrics equal: yes" in out and "prompts equal: yes" in out
    # the environments' fork servers and workers died with the killed runs: none orphaned
    assert running_with(str(tmp_path)) == []
    assert _orphaned_env_processes(started) == []


def _orphaned_env_processes(since: float) -> list[int]:
    """Environment fork servers / workers started after ``since`` whose parent is gone (other
    sessions' live ones on a shared machine are not counted)."""
    found = []
    for p in psutil.process_iter(["cmdline", "create_time", "ppid", "status"]):
        line = " ".join(p.info["cmdline"] or [])
        if ("megatron_grpo.rollout.episodes.environment" in line and p.info["create_time"] >= since
                and p.info["ppid"] == 1 and p.info["status"] != psutil.STATUS_ZOMBIE):
            found.append(p.pid)
    return found
