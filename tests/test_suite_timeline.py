"""``pytest --timeline PATH`` (tests/conftest.py) and tools/suite_timeline.py, which reads it:
each worker's busy time and idle tail, against a hand-built timeline and a real pytest run."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tools.suite_timeline import main, summarise

ROOT = Path(__file__).resolve().parent.parent


def test_summary_of_a_hand_built_timeline():
    records = [  # gw0 runs two tests of module a (10 s + 5 s) and ends at 15; gw1 one of b, ends at 20
        {"worker": "gw0", "start": 100.0, "end": 110.0, "cpu_s": 1.0, "children_cpu_s": 6.0,
         "test": "tests/a.py::t1@tests/a.py"},
        {"worker": "gw0", "start": 110.0, "end": 115.0, "test": "tests/a.py::t2@tests/a.py"},  # an older line
        {"worker": "gw1", "start": 101.0, "end": 120.0, "cpu_s": 2.5, "children_cpu_s": 0.0,
         "test": "tests/b.py::t@shared"},
    ]
    s = summarise(records)
    assert s["wall"] == 20.0 and s["cpu"] == 9.5
    assert s["workers"]["gw0"] == {"busy": 15.0, "finished": 15.0, "tests": 2, "idle_tail": 5.0}
    assert s["workers"]["gw1"] == {"busy": 19.0, "finished": 20.0, "tests": 1, "idle_tail": 0.0}
    assert s["modules"] == [("tests/b.py", "gw1", 19.0, 2.5), ("tests/a.py", "gw0", 15.0, 7.0)]
    assert summarise([]) == {"wall": 0.0, "cpu": 0.0, "workers": {}, "modules": []}


def test_a_real_run_writes_one_line_per_test_and_the_tool_reads_it(tmp_path, capsys):
    timeline = tmp_path / "timeline.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}  # this run may be a worker's
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeline", str(timeline),
                          "tests/test_suite_timeline.py::test_summary_of_a_hand_built_timeline",
                          "tests/test_suite_timeline.py::test_a_subprocess_that_burns_cpu"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:]
    plain, burner = [json.loads(x) for x in timeline.read_text().splitlines()]
    assert plain["worker"] == "main" and plain["test"].endswith("test_summary_of_a_hand_built_timeline")
    assert 0 <= plain["end"] - plain["start"] < 60
    # the CPU a test's waited-for subprocess used is its children_cpu_s, not its own
    assert plain["children_cpu_s"] < 0.1 and 0 <= plain["cpu_s"] < 5, plain
    assert burner["children_cpu_s"] >= 0.4 and burner["cpu_s"] < burner["children_cpu_s"], burner
    assert main([str(timeline)]) == 0
    assert "main: busy" in capsys.readouterr().out
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_subprocess_that_burns_cpu():
    """Half a CPU second in a child the test waits for (the real run above times it)."""
    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\n"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
