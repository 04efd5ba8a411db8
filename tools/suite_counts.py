"""The suite's test counts, generated: the one place that states them is docs/testing.md's
block between ``<!-- test-counts -->`` and ``<!-- /test-counts -->``, written from a real
collection, never copied by hand.

    python -m tools.suite_counts            # print the block
    python -m tools.suite_counts --write    # rewrite it in docs/testing.md
    python -m tools.suite_counts --check    # exit 1 if docs/testing.md disagrees with the collection

One ``pytest --collect-only`` (the CI tier, with the extended tier deselected: its line gives
both counts); tests/test_docs.py runs ``--check``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "testing.md"
START, END = "<!-- test-counts -->", "<!-- /test-counts -->"
COLLECTED = re.compile(r"^(\d+)/(\d+) tests collected \((\d+) deselected\)", re.M)


def counts_line(ci: int, total: int, extended: int) -> str:
    """The generated sentence (pure: tested without a collection)."""
    return (f"**{total} tests**, of which CI runs the **CI tier, {ci}**, and leaves out the **extended tier, "
            f"{extended}**")


def collect() -> tuple[int, int, int]:
    """(CI tier, all tests, extended tier) from one collection of the suite in this environment."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    m = COLLECTED.search(out.stdout)
    if out.returncode != 0 or m is None:
        raise SystemExit(f"error: pytest --collect-only failed (exit {out.returncode}): {out.stdout[-2000:]}"
                         f"{out.stderr[-1000:]}")
    return int(m[1]), int(m[2]), int(m[3])


def replace_block(text: str, line: str) -> str:
    """``text`` with the block's content replaced by ``line``; ValueError when the markers are missing."""
    i, j = text.find(START), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"{PAGE}: the markers {START} ... {END} are missing")
    return text[: i + len(START)] + line + text[j:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.suite_counts", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite the block in {PAGE.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true", help="exit 1 if the page disagrees with the collection")
    args = parser.parse_args(argv)
    line = counts_line(*collect())
    text = PAGE.read_text()
    new = replace_block(text, line)
    if args.check:
        if new != text:
            print(f"{PAGE.relative_to(ROOT)}: the test counts are stale; the collection gives: {line} "
                  "(run python -m tools.suite_counts --write)", file=sys.stderr)
            return 1
        return 0
    if args.write:
        tmp = PAGE.with_suffix(".md.tmp")
        tmp.write_text(new)
        tmp.replace(PAGE)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
