"""The documentation cannot rot silently: README.md, docs/*.md, docs/history/*.md and the benchmarks'
runbook (tools/bench/*.md) are checked against the code.

* every relative link resolves to a file, and a ``#anchor`` to a heading of that file (GitHub's
  slug rules); the code's own pointers into the docs (``docs/x.md#anchor`` in docstrings,
  comments and messages) resolve the same way;
* every repository path quoted in backticks (``tests/...``, ``megatron_grpo/...``) exists;
* every command shown in a ```bash / sh / console block that runs this project's programs
  (``megatron-grpo SUB``, ``python -m megatron_grpo...``, ``python -m tools.X``,
  ``python tests/X.py``, ``torchrun ... -m megatron_grpo.train | tools.X``, ``bash launch/X``,
  ``sbatch launch/X``) parses: its ``--help`` exits 0 (once per program and sub-command), and a
  launch script passes ``bash -n``;
* every config a command names (``--config F``, the config argument of ``validate-config`` and
  of the launch scripts, ``demo_cpu.yaml`` for ``launch/demo_cpu.sh``) validates with its
  ``key=value`` overrides through ``load_experiment``, without starting anything;
* every ```yaml block validates when merged onto ``yaml_configs/demo_cpu.yaml``.

Each check asserts it found a minimum number of items, so a parser that silently finds nothing
fails instead of passing.
"""

from __future__ import annotations

import copy
import glob
import re
import shlex
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_grpo.config import ConfigError
from megatron_grpo.config.experiment import yaml_load
from megatron_grpo.preflight import build_experiment, load_experiment
from tests.support.helps import run_helps

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "docs" / "history").glob("*.md")), *sorted((ROOT / "tools" / "bench").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
FENCE_RE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)[^\n]*\n(.*?)^\1\s*$", re.S | re.M)
LINK_RE = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING_RE = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
CODE_POINTER_RE = re.compile(r"docs/((?:history/)?[\w.-]+\.md)(?:#([\w-]+))?")
REPO_PATH_RE = re.compile(r"`((?:megatron_grpo|tests|tools|launch|yaml_configs|docs)/[\w./*-]+)`")
LAUNCH_CONFIG_SCRIPTS = {"launch/single_node.sh", "launch/multi_node.sh", "launch/slurm.sbatch"}
DEMO_CONFIG = "yaml_configs/demo_cpu.yaml"


# ---- Markdown parsing -----------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    path: Path
    lang: str
    text: str


def fenced_blocks(path: Path) -> list[Block]:
    return [Block(path, m.group(2).lower(), m.group(3)) for m in FENCE_RE.finditer(path.read_text())]


def prose(text: str) -> str:
    """The Markdown without fenced blocks and inline code (links there are not links)."""
    text = FENCE_RE.sub("", text)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: inline markup dropped, lowercase, punctuation other than
    '-' and '_' removed, each space turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").strip().lower()
    kept = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in "-_ " or cat[0] in "LN":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING_RE.finditer(FENCE_RE.sub("", path.read_text())):
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def link_problem(source: Path, target: str) -> str | None:
    """Why a relative link of ``source`` does not resolve, or None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
        return None
    file_part, _, anchor = target.partition("#")
    dest = (source.parent / file_part).resolve() if file_part else source
    if not dest.exists():
        return f"{target}: no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}"
    if not dest.is_relative_to(ROOT):
        return f"{target}: points outside the repository"
    if anchor:
        if dest.suffix != ".md":
            return f"{target}: an anchor into a non-Markdown file"
        if anchor not in anchors(dest):
            return f"{target}: no heading with anchor #{anchor} in {dest.relative_to(ROOT)}"
    return None


# ---- commands -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    where: str
    argv: tuple[str, ...]


def command_lines(block: Block) -> list[str]:
    """Shell lines of a block: continuations joined; in ``console`` blocks only ``$ `` lines."""
    text = re.sub(r"\\\n\s*", " ", block.text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if block.lang == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if line and not line.startswith("#"):
            out.append(line)
    return out


def split_commands(line: str) -> list[list[str]]:
    """shlex tokens of each command of a line (split at |, &&, ||, ;), leading VAR=value dropped."""
    tokens = shlex.split(line, comments=True)
    commands, current = [], []
    for tok in tokens + [";"]:
        if tok in ("|", "&&", "||", ";"):
            while current and re.match(r"^[A-Za-z_]\w*=", current[0]):
                current.pop(0)
            if current:
                commands.append(current)
            current = []
        else:
            current.append(tok)
    return commands


def all_commands() -> list[Command]:
    out = []
    for path in DOC_FILES:
        for block in fenced_blocks(path):
            if block.lang not in SHELL_LANGS:
                continue
            for line in command_lines(block):
                for argv in split_commands(line):
                    out.append(Command(f"{path.relative_to(ROOT)}: {line}", tuple(argv)))
    return out


def is_python(tok: str) -> bool:
    return re.fullmatch(r"(.*/)?python(3(\.\d+)?)?", tok) is not None and not tok.startswith("~")


def project_program(argv: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(the program as ``python``-style argv prefix, its arguments) for this project's
    programs; None for anything else (pip, pytest, sglang, ...)."""
    prog = argv[0]
    if prog == "megatron-grpo":
        if len(argv) == 1 or argv[1].startswith("-"):
            return ("megatron-grpo",), argv[1:]
        return ("megatron-grpo", argv[1]), argv[2:]
    if prog == "torchrun":  # skip torchrun's own options up to the script or -m
        for i, tok in enumerate(argv[1:], start=1):
            if tok == "-m" and i + 1 < len(argv):
                return project_program(("python", *argv[i:]))
            if tok.endswith(".py"):
                return project_program(("python", *argv[i:]))
        return None
    if is_python(prog) and len(argv) > 1:
        if argv[1] == "-m" and len(argv) > 2 and argv[2].startswith(("megatron_grpo", "tools.")):
            return ("python", "-m", argv[2]), argv[3:]
        if argv[1].startswith(("tools/", "tests/")) and argv[1].endswith(".py"):  # tools/: refused below
            return ("python", argv[1]), argv[2:]
    if prog in ("bash", "sbatch") and len(argv) > 1 and argv[1].startswith("launch/"):
        return (prog, argv[1]), argv[2:]
    return None


def overrides_of(args: tuple[str, ...]) -> list[str]:
    return [a for a in args if "=" in a and not a.startswith("-") and re.match(r"^[\w.\[\]]+=", a)]


def config_of(program: tuple[str, ...], args: tuple[str, ...]) -> str | None:
    """The experiment YAML a command runs with, if it names one."""
    if "--config" in args:
        return args[args.index("--config") + 1]
    positional = [a for a in args if not a.startswith("-") and "=" not in a]
    if program == ("megatron-grpo", "validate-config") or (
        program[0] in ("bash", "sbatch") and program[1] in LAUNCH_CONFIG_SCRIPTS
    ):
        return positional[0] if positional else None
    if program[-1] == "launch/demo_cpu.sh":
        return DEMO_CONFIG
    return None


# ---- tests: links ---------------------------------------------------------------------------


def test_every_relative_link_and_anchor_resolves():
    problems, checked = [], 0
    for path in DOC_FILES:
        for m in LINK_RE.finditer(prose(path.read_text())):
            checked += 1
            why = link_problem(path, m.group(1))
            if why:
                problems.append(f"{path.relative_to(ROOT)}: {why}")
    assert checked >= 100, f"only {checked} links found: is the link parser broken?"
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    index = (ROOT / "docs" / "index.md").read_text()
    pages = [p.name for p in DOC_FILES if p.parent.name == "docs" and p.name != "index.md"]
    missing = [p for p in pages if f"(docs/{p}" not in readme or f"({p}" not in index]
    assert not missing, f"docs pages not linked from both README.md and docs/index.md: {missing}"


def test_the_readme_fits_and_starts_with_the_two_commands():
    """The README fits a screen or two (issue 62: it had grown to 309 lines) and its first screen
    holds the two commands; test counts and times live in docs/testing.md alone."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150: detail goes to docs/)"
    first_screen = "\n".join(lines[:40])
    assert "bash launch/smollm2_cpu.sh" in first_screen and "bash launch/run_tests.sh" in first_screen
    assert not re.search(r"\b1[0-9]{3} tests\b", "\n".join(lines)), "test counts belong in docs/testing.md"


def test_code_pointers_into_the_docs_resolve():
    problems, checked = [], 0
    for pattern in ("megatron_grpo/**/*.py", "tests/*.py", "tools/**/*.py", "launch/*", "yaml_configs/*"):
        for name in glob.glob(str(ROOT / pattern), recursive=True):
            path = Path(name)
            if path.name == "test_docs.py" or not path.is_file():  # its own examples; launch/sglang_cpu/
                continue
            for m in CODE_POINTER_RE.finditer(path.read_text()):
                checked += 1
                target = m.group(1) + (f"#{m.group(2)}" if m.group(2) else "")
                why = link_problem(ROOT / "docs" / "x.md", target)
                if why:
                    problems.append(f"{path.relative_to(ROOT)}: docs/{why}")
    assert checked >= 15, f"only {checked} pointers into docs/ found in the code"
    assert not problems, "code points at missing docs:\n" + "\n".join(problems)


def test_quoted_repository_paths_exist():
    missing, checked = [], 0
    for path in DOC_FILES:
        for m in REPO_PATH_RE.finditer(path.read_text()):
            checked += 1
            if not glob.glob(str(ROOT / m.group(1).rstrip("/"))):
                missing.append(f"{path.relative_to(ROOT)}: {m.group(1)}")
    assert checked >= 50, f"only {checked} quoted paths found"
    assert not missing, "quoted paths that do not exist:\n" + "\n".join(missing)


# ---- tests: commands and configs ------------------------------------------------------------


def test_every_shown_command_parses():
    commands = all_commands()
    programs = {}
    for cmd in commands:
        found = project_program(cmd.argv)
        if found:
            programs.setdefault(found[0], cmd.where)
    kinds = {p[0] if p[0] != "python" else ("python -m" if p[1] == "-m" else "python script") for p in programs}
    assert len(programs) >= 12 and {"megatron-grpo", "python -m", "python script", "bash"} <= kinds, (
        f"too few project commands found in the docs ({sorted(programs)}): is the parser broken?"
    )
    results = run_helps(list(programs))
    assert len(results) == len(programs)
    failed = [f"{' '.join(p)} (shown in {programs[p]}): exit {rc}\n{out}" for p, rc, out in results if rc != 0]
    assert not failed, "commands shown in the docs do not parse:\n" + "\n\n".join(failed)


def test_tools_are_shown_run_as_modules():
    """A tool imports its shared modules as ``tools.*``, which ``python tools/X.py`` would not find
    (the script's own folder, not the checkout, heads ``sys.path``): the docs show the one way,
    ``python -m tools.X`` from the repository root."""
    programs = [found[0] for cmd in all_commands() if (found := project_program(cmd.argv)) and found[0][0] == "python"]
    as_module = {p for p in programs if p[1] == "-m" and p[2].startswith("tools.")}
    as_script = sorted({p[1] for p in programs if p[1].startswith("tools/")})
    assert len(as_module) >= 10, f"only {sorted(as_module)} shown: is the parser broken?"
    assert not as_script, f"tools shown run as scripts (show `python -m tools.X`): {as_script}"
    launched = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "launch").glob("*.sh"))
                for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"python3? tools/", line)]
    assert not launched, f"launch scripts that run a tool as a script (run `python -m tools.X`): {launched}"


def test_every_config_a_command_names_validates():
    checked, problems = 0, []
    for cmd in all_commands():
        found = project_program(cmd.argv)
        if not found:
            continue
        config = config_of(*found)
        if config is None:
            continue
        checked += 1
        try:
            load_experiment(ROOT / config, overrides_of(found[1]))
        except ConfigError as e:
            problems.append(f"{cmd.where}\n    {e.one_line()}")
    assert checked >= 12, f"only {checked} commands with a config found"
    assert not problems, "configs shown in the docs do not validate:\n" + "\n".join(problems)


def _merge(base: dict, fragment: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in fragment.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def yaml_blocks() -> list[Block]:
    return [b for p in DOC_FILES for b in fenced_blocks(p) if b.lang in ("yaml", "yml")]


def test_every_yaml_fragment_validates():
    base = yaml_load((ROOT / DEMO_CONFIG).read_text())
    blocks = yaml_blocks()
    assert len(blocks) >= 8, f"only {len(blocks)} yaml blocks found"
    problems = []
    for block in blocks:
        fragment = yaml_load(block.text)
        if not isinstance(fragment, dict):
            problems.append(f"{block.path.relative_to(ROOT)}: a yaml block that is not a mapping:\n{block.text}")
            continue
        try:
            build_experiment(_merge(base, fragment))
        except ConfigError as e:
            problems.append(f"{block.path.relative_to(ROOT)}: {e.one_line()}\n{block.text}")
    assert not problems, "yaml blocks that do not validate on demo_cpu.yaml:\n" + "\n".join(problems)


# ---- the checker checks itself --------------------------------------------------------------


def test_checker_catches_a_broken_link_and_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.md").write_text("# Title\n\n## Some `code` here (x.py)\n")
    page = tmp_path / "b.md"
    assert link_problem(page, "a.md#some-code-here-xpy") is None
    assert link_problem(page, "a.md#title") is None
    assert "no heading" in link_problem(page, "a.md#nope")
    assert "no such file" in link_problem(page, "missing.md")
    assert link_problem(page, "https://example.com/x") is None


@pytest.mark.parametrize(
    "heading, slug",
    [
        ("Real SGLang (`engine.kind: sglang`)", "real-sglang-enginekind-sglang"),
        ("kill -9 anywhere", "kill--9-anywhere"),
        ("What one step does (`megatron_grpo/trainer/driver.py`)", "what-one-step-does-megatron_grpotrainerdriverpy"),
        ("TL;DR: starter configs", "tldr-starter-configs"),
    ],
)
def test_github_slug(heading, slug):
    assert github_slug(heading) == slug


def test_command_extraction():
    block = Block(Path("x.md"), "console", "$ megatron-grpo train --config a.yaml k=1 \\\n    j=2\noutput line\n")
    assert [shlex.split(x) for x in command_lines(block)] == [
        ["megatron-grpo", "train", "--config", "a.yaml", "k=1", "j=2"]]
    argv = split_commands("MASTER_ADDR=1 NNODES=2 bash launch/multi_node.sh c.yaml 'engine.urls=[http://h:1]'  # note")
    assert argv == [["bash", "launch/multi_node.sh", "c.yaml", "engine.urls=[http://h:1]"]]
    program, args = project_program(("torchrun", "--nproc-per-node", "4", "-m", "tools.convert_hf_to_megatron", "--tp", "2"))
    assert program == ("python", "-m", "tools.convert_hf_to_megatron") and args == ("--tp", "2")
    assert config_of(*project_program(tuple(argv[0]))) == "c.yaml"
    assert overrides_of(args + ("a.b=1", "--x=y")) == ["a.b=1"]


def test_the_test_counts_are_generated_from_the_collection():
    """Issue 62: the suite's counts were copied by hand into several pages and disagreed. One
    block of docs/testing.md states them, written by ``python -m tools.suite_counts --write``;
    this runs its ``--check`` (one collection of the suite, ~25 s) in the environment CI builds
    (verifiers 0.4: with 0.3 the classic-API tests are collected too)."""
    import importlib.metadata
    import subprocess
    import sys

    from tools import suite_counts

    assert suite_counts.counts_line(3, 5, 2) == ("**5 tests**, of which CI runs the **CI tier, 3**, and leaves out "
                                                "the **extended tier, 2**")
    with pytest.raises(ValueError, match="markers"):
        suite_counts.replace_block("no markers here", "x")
    try:
        verifiers = importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        verifiers = ""
    if not verifiers.startswith("0.4"):
        pytest.skip(f"the counts are those of CI's environment (verifiers 0.4), not verifiers {verifiers or 'absent'}")
    proc = subprocess.run([sys.executable, "-m", "tools.suite_counts", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
