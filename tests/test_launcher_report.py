"""The launcher's one line for how a run ended, instead of torchrun's own output: its failure
report (``ChildFailedError`` and its summary), its traceback when it fails itself, and its log
of its workers' ends are held back (``launcher.agent.TorchrunReportFilter``), a rank's own
traceback is shown whole, and a rank killed from outside ends the run with one line naming the
rank and the signal (``launch_ranks``). The report below is torch 2.13's own, captured from a
2-rank ``torchrun`` whose rank 1 killed itself with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from megatron_grpo.launcher.agent import TorchrunReportFilter, launcher_exception, root_cause
from tests.support.demo_run import ENV, ROOT, train_cmd, wait_for_steps
from tests.support.kill_resume import process_tree, rank_processes, survivors

SIGKILL_REPORT = """rank 1 up
rank 0 up
W1128 02:18:02.393000 16988 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 16997 closing signal SIGTERM
E1128 02:18:02.574000 16988 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 16998) of binary: /work/venv/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "/work/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
  File "/work/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "/work/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1028, in main
    run(args)
  File "/work/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1019, in run
    elastic_launch(
  File "/work/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 194, in __call__
    return launch_agent(
           ^^^^^^^^^^^^^
  File "/work/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
=======================================================
w.py FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-28_02:18:02
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 16997)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 16997
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_02:18:02
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 16998)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 16998
=======================================================
"""

RANK_TRACEBACK = """Traceback (most recent call last):
  File "/x/megatron_grpo/trainer/rank.py", line 9, in rank_main
    train(cfg, spawned)
KeyError: 'bug'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/x/megatron_grpo/trainer/rank.py", line 12, in rank_main
    raise RuntimeError("while reporting")
RuntimeError: while reporting
"""

RENDEZVOUS_FAILURE = """Traceback (most recent call last):
  File "/v/lib/python3.11/site-packages/torch/distributed/run.py", line 1028, in main
    run(args)
  File "/v/lib/python3.11/site-packages/torch/distributed/elastic/rendezvous/api.py", line 9, in next_rendezvous
    raise DistStoreError(msg)
torch.distributed.DistStoreError: Timed out after 61 seconds waiting for clients. 1/2 clients joined.
"""


def shown(text: str, chunk: int) -> str:
    """What the filter lets through of ``text`` read ``chunk`` bytes at a time."""
    data, f, out = text.encode(), TorchrunReportFilter(), b""
    for i in range(0, len(data), chunk):
        out += f.feed(data[i:i + chunk])
    return (out + f.finish()).decode()


@pytest.mark.parametrize("chunk", [1, 5, 64, 1 << 20])
def test_torchruns_report_and_worker_log_are_held_back_at_any_read_size(chunk):
    assert "ChildFailedError" in SIGKILL_REPORT and "Sending process" in SIGKILL_REPORT  # the capture is whole
    assert shown(SIGKILL_REPORT, chunk) == "rank 1 up\nrank 0 up\n"


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_a_ranks_own_traceback_is_shown_whole_and_a_rendezvous_failure_is_not(chunk):
    progress = "step 3/10 \r step 4/10 "
    text = "before\n" + RANK_TRACEBACK + progress + "\n" + RENDEZVOUS_FAILURE
    assert shown(text, chunk) == "before\n" + RANK_TRACEBACK + progress + "\n"
    # the launcher names torchrun's own failure from the unfiltered tail
    assert launcher_exception(text.encode()) == ("DistStoreError: Timed out after 61 seconds waiting for clients. "
                                                 "1/2 clients joined.")


def test_a_progress_bar_passes_at_once_and_a_cut_traceback_at_the_end():
    f = TorchrunReportFilter()
    assert f.feed(b"\r 40%|####  | 4/10") == b"\r 40%|####  | 4/10"  # no newline needed
    assert f.feed(b"\nTraceback (most recent call last):\n  File") == b"\n"
    assert f.finish() == b"Traceback (most recent call last):\n  File"  # the rank died mid-traceback: shown


def test_the_root_cause_is_read_from_the_report():
    assert root_cause(SIGKILL_REPORT.encode()[-4096:]) == {"rank": 1, "exitcode": -9, "pid": 16998}
    assert root_cause(RANK_TRACEBACK.encode()) is None


@pytest.mark.slow
def test_a_rank_killed_from_outside_ends_the_run_in_one_line(demo, tmp_path):
    """kill -9 of one rank of a 2-rank run after its first step: exit 1, the last stderr line
    names the rank, its pid and SIGKILL; no traceback of torchrun's or of the other rank's
    broken collective; nothing outlives it."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(demo, run_dir, 50, "engine.kind=inprocess", "eval.sets=[]",
                                      "checkpoint.save_every=0"),
                            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for_steps(run_dir, 1, [proc])
        ranks = {int(p.environ().get("RANK", -1)): p for p in rank_processes(run_dir)}
        victim, tree = ranks[1], process_tree(proc.pid)
        os.kill(victim.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == (f"error: rank 1 (pid {victim.pid}) was killed by SIGKILL from outside the run; the other ranks "
                    "were stopped; the newest complete checkpoint is kept, and the same command resumes from it"), \
        err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err and "Sending process" not in err, err[-3000:]
    assert survivors(tree) == []


def test_a_killed_rank_is_the_cause_even_when_torchrun_observed_its_peer_first():
    """On a loaded machine torchrun may name the rank that lost its peer (exit code 1) as the
    root cause; the rank killed by a signal, listed among the other failures, is the cause."""
    swapped = SIGKILL_REPORT.replace(
        "  rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 16997)  (SIGTERM)",
        "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 16998)  (SIGKILL)", 1)
    head, _, tail = swapped.partition("Root Cause (first observed failure):")
    observed_first = head + "Root Cause (first observed failure):" + tail.replace(
        "  rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 16998)  (SIGKILL)",
        "  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 16997)", 1)
    assert "exitcode  : 1 (pid: 16997)" in observed_first.partition("Root Cause")[2]
    assert root_cause(observed_first.encode()) == {"rank": 1, "exitcode": -9, "pid": 16998}
    # torchrun's own SIGTERM to a surviving rank is never the cause
    assert root_cause(SIGKILL_REPORT.encode()) == {"rank": 1, "exitcode": -9, "pid": 16998}
    only_exit = observed_first.replace("exitcode  : -9 (pid: 16998)  (SIGKILL)", "exitcode  : 1 (pid: 16998)")
    assert root_cause(only_exit.encode()) == {"rank": 0, "exitcode": 1, "pid": 16997}
