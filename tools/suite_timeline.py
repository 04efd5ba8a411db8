"""Where the test suite's time went, per pytest-xdist worker, from ``pytest --timeline PATH``.

    bash launch/run_tests.sh --timeline /tmp/timeline.jsonl
    python -m tools.suite_timeline /tmp/timeline.jsonl

Prints, for each worker, its busy time, when it finished (seconds after the first test began)
and its idle tail (how long it waited for the last worker), then the heaviest modules with the
worker that ran them and the CPU their tests used (in the worker and in the subprocesses they
waited for: launched runs with their ranks; not the rank pools' ranks or the shared SGLang
servers). A long idle tail means the schedule, not the tests, set the wall time; on a machine
the tests keep busy, CPU seconds are what a change must save.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def summarise(records: list[dict]) -> dict:
    """``records``: the timeline's lines (worker, start, end, test; cpu_s and children_cpu_s when
    recorded, else 0). Returns ``{"wall": s, "cpu": s, "workers": {worker: {"busy", "finished",
    "idle_tail", "tests"}}, "modules": [(module, worker, s, cpu_s), ...] heaviest first}`` (times
    in seconds, from the first start)."""
    if not records:
        return {"wall": 0.0, "cpu": 0.0, "workers": {}, "modules": []}
    t0 = min(r["start"] for r in records)
    wall = max(r["end"] for r in records) - t0
    workers: dict[str, dict] = {}
    modules: dict[tuple[str, str], float] = defaultdict(float)
    cpu: dict[tuple[str, str], float] = defaultdict(float)
    for r in records:
        w = workers.setdefault(r["worker"], {"busy": 0.0, "finished": 0.0, "tests": 0})
        w["busy"] += r["end"] - r["start"]
        w["finished"] = max(w["finished"], r["end"] - t0)
        w["tests"] += 1
        key = (r["test"].split("::", 1)[0], r["worker"])
        modules[key] += r["end"] - r["start"]
        cpu[key] += r.get("cpu_s", 0.0) + r.get("children_cpu_s", 0.0)
    for w in workers.values():
        w["idle_tail"] = wall - w["finished"]
    heaviest = sorted(((m, w, s, cpu[(m, w)]) for (m, w), s in modules.items()), key=lambda x: -x[2])
    return {"wall": wall, "cpu": sum(cpu.values()), "workers": workers, "modules": heaviest}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--top", type=int, default=15, help="how many modules to list (default 15)")
    args = parser.parse_args(argv)
    try:
        records = [json.loads(line) for line in args.timeline.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        print(f"suite_timeline: cannot read {args.timeline}: {e}", file=sys.stderr)
        return 2
    s = summarise(records)
    print(f"wall {s['wall']:.0f} s, {len(records)} tests, {s['cpu']:.0f} CPU s in the workers and the "
          "subprocesses they waited for")
    for name, w in sorted(s["workers"].items()):
        print(f"  {name}: busy {w['busy']:.0f} s in {w['tests']} tests, finished at {w['finished']:.0f} s, "
              f"idle tail {w['idle_tail']:.0f} s")
    for module, worker, seconds, cpu in s["modules"][:args.top]:
        print(f"  {seconds:7.1f} s  {cpu:7.1f} CPU s  {module}  ({worker})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
