"""CI's short version of tests/kill_resume.py: kill -9 the demo run (once during a checkpoint
save when the dice say so), resume, and require the uninterrupted run's metrics and no process
left behind."""

import pytest

from tests.kill_resume import main
from tests.launch_nodes import running_with


@pytest.mark.slow
def test_kill_minus_9_and_resume(demo, tmp_path, capsys):
    code = main(["--kills", "3", "--steps", "8", "--seed", "1", "--workdir", str(tmp_path), "--max-seconds", "900",
                 "--demo", str(demo)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "checkpoints lost: 0" in out and "metrics equal: yes" in out
    # nothing outlives the kills: not the ranks, not the engine, not the checkpoint writers a
    # rank forked when it was killed during a save (they hold copies of its sockets)
    assert running_with(str(tmp_path)) == []
