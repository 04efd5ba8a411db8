"""Every ``--help`` of a list of this project's programs, cheaply: the docs' commands
(tests/test_docs.py) and every tool (tests/test_tools.py).

A program is an argv prefix: ``("megatron-grpo", SUB)``, ``("python", "-m", MODULE)``,
``("python", SCRIPT)``, ``("bash", SCRIPT)`` or ``("sbatch", SCRIPT)`` (the last two get
``bash -n``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One child process runs every ``--help`` in turn, in-process (runpy, as ``python -m`` and
# ``python script.py`` do), so torch and megatron-core are imported once rather than once per
# program: ~18 separate interpreters cost ~25 s of CPU, which a loaded 2-core CI machine
# stretches past a minute. The child, not pytest, absorbs whatever a program's import does.
HELP_DRIVER = r"""
import contextlib, io, json, runpy, sys
results = []
for program in json.loads(sys.argv[1]):
    out = io.StringIO()
    code = 0
    argv0 = list(sys.argv)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if program[0] == "megatron-grpo":
                from megatron_grpo.cli import main
                code = main([*program[1:], "--help"])
            elif program[1] == "-m":
                sys.argv = [program[2], "--help"]
                runpy.run_module(program[2], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [program[1], "--help"]
                runpy.run_path(program[1], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        code, _ = 1, out.write(f"{type(e).__name__}: {e}")
    finally:
        sys.argv = argv0
    results.append([program, code, out.getvalue()[-2000:]])
print(json.dumps(results))
"""


def run_helps(programs: list[tuple[str, ...]]) -> list[tuple[tuple[str, ...], int, str]]:
    """``--help`` of every Python program (one child process) and ``bash -n`` of every script."""
    results = []
    for program in (p for p in programs if p[0] in ("bash", "sbatch")):
        proc = subprocess.run(["bash", "-n", program[1]], cwd=ROOT, capture_output=True, text=True, timeout=60)
        results.append((program, proc.returncode, proc.stderr))
    python_programs = [list(p) for p in programs if p[0] not in ("bash", "sbatch")]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", HELP_DRIVER, json.dumps(python_programs)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"the --help driver failed:\n{proc.stderr[-3000:]}"
    results += [(tuple(p), code, out) for p, code, out in json.loads(proc.stdout.strip().splitlines()[-1])]
    return results
