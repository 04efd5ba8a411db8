"""CI's short version of tests/kill_resume.py: kill -9 the demo run (once during a checkpoint
save when the dice say so), resume, and require the uninterrupted run's metrics."""

import pytest

from tests.kill_resume import main


@pytest.mark.slow
def test_kill_minus_9_and_resume(demo, tmp_path, capsys):
    code = main(["--kills", "3", "--steps", "8", "--seed", "1", "--workdir", str(tmp_path), "--max-seconds", "900",
                 "--demo", str(demo)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "checkpoints lost: 0" in out and "metrics equal: yes" in out
