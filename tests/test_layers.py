"""The package's layers, pinned: a module never imports a higher layer, production code never
imports test code (``tests/``), and the imports of the package's own modules sit at the top of the file
except a few, each with its reason written beside it.

The order (low to high; docs/design.md, "Layers", says why):

    config < runtime < wire, chat, ops, models, data, rewards, losses, metrics_log < inference < generation
           < sync < rollout < evaluation < preflight < trainer < launcher < entry points

``inference`` is the inference server we ship; ``generation`` its client side (and SGLang's); the
trainer reaches the engine only through ``generation.inprocess``. No package imports test code
(``tests/support`` is outside the package, and the wheel).

Packages of one layer may import each other only without a cycle. Entry points (the command
lines: ``megatron_grpo/cli.py``, ``train.py``, every ``*cli.py``, ``config/reference.py``,
``inference/serve.py``, ``metrics_log/__main__.py``) sit in the top production layer wherever
their file lives. Only ``ast`` is used: nothing of the package is imported, so the test runs in
well under a second.

The tests themselves: a test module (``tests/**/test_*.py``) is imported by no other module of
``tests/`` or ``tools/``; what several modules share lives in ``tests/support/``. The tools
(``tools/``, outside the wheel like the tests): no tool imports test code or edits ``sys.path``
(they run as modules, ``python -m tools.X``), and no package module imports a tool.

Also walked with ``ast``: every module docstring under ``megatron_grpo/`` is at most 30 lines.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megatron_grpo"

LAYERS: list[tuple[str, ...]] = [
    ("config",),
    ("runtime",),
    ("wire", "chat", "ops", "models", "data", "rewards", "losses", "metrics_log"),
    ("inference",),
    ("generation",),
    ("sync",),
    ("rollout",),
    ("evaluation",),
    ("preflight",),
    ("trainer",),
    ("launcher",),
    ("<entry>",),
]
LAYER_OF = {package: i for i, layer in enumerate(LAYERS) for package in layer}

ENTRY_POINTS = {"megatron_grpo.cli", "megatron_grpo.train", "megatron_grpo.config.reference",
                "megatron_grpo.inference.serve", "megatron_grpo.metrics_log.__main__"}

FUNCTION_IMPORT_BUDGET = 25
"""Most imports of the package's own modules allowed inside functions, in the whole package."""

# Files the lead is rewriting on another branch (issue #24): their function-level imports
# count against the budget, but they are not yet required to carry a reason. Empty it as they land.
REASON_PENDING: set[str] = set()


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    path: str  # its file, relative to the repository
    line: int
    target: str  # the imported module, dotted (for ``from a import b``: ``a.b`` when that is a module)
    in_function: bool
    has_reason: bool


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _has_reason(lines: list[str], node: ast.stmt) -> bool:
    """A comment on the import's own lines or on the line above it."""
    own = lines[node.lineno - 1: node.end_lineno]
    above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
    return any("#" in line for line in own) or above.startswith("#")


def imports_of(source: str, module: str, path: str, is_package: bool, known: set[str]) -> list[Import]:
    """Every import of a ``megatron_grpo`` module in ``source`` (top level and in functions)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` imports mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in dict.fromkeys(targets):
            if target.split(".")[0] in ("megatron_grpo", "tests", "tools"):
                found.append(Import(module, path, node.lineno, target, id(node) in in_function,
                                    _has_reason(lines, node)))
    return found


def layer(module: str) -> tuple[int, str]:
    """(layer index, package) of a dotted module name."""
    parts = module.split(".")
    if parts[0] in ("tests", "tools"):
        return len(LAYERS), parts[0]
    if module in ENTRY_POINTS or parts[-1] == "cli" or parts[-1].endswith("_cli"):
        return LAYER_OF["<entry>"], "<entry>"
    package = parts[1] if len(parts) > 1 else "<entry>"
    return LAYER_OF[package], package


def layer_problems(found: list[Import]) -> list[str]:
    """One line per import of a higher layer, of test code from production code, or of a
    package of the same layer that imports this one back (a cycle)."""
    problems, same_layer = [], {}
    for imp in found:
        (src, src_pkg), (dst, dst_pkg) = layer(imp.module), layer(imp.target)
        where = f"{imp.path}:{imp.line}: {imp.module} imports {imp.target}"
        if dst_pkg == "tests":
            problems.append(f"{where} (production code never imports test code)")
        elif dst_pkg == "tools":
            problems.append(f"{where} (production code never imports tools/, which the wheel leaves out)")
        elif dst > src:
            problems.append(f"{where} (layer {LAYERS[dst]} is above {LAYERS[src]})")
        elif dst == src and src_pkg != dst_pkg:
            same_layer.setdefault((src_pkg, dst_pkg), where)
    for (a, b), where in same_layer.items():
        if (b, a) in same_layer and a < b:
            problems.append(f"{where} and {same_layer[(b, a)]} (a cycle between {a} and {b}, one layer)")
    return problems


def function_import_problems(found: list[Import], budget: int = FUNCTION_IMPORT_BUDGET,
                             pending: frozenset[str] | set[str] = frozenset()) -> list[str]:
    deferred = [imp for imp in found if imp.in_function]
    problems = [f"{imp.path}:{imp.line}: {imp.module} imports {imp.target} inside a function with no reason "
                "(a comment on its line or the line above)" for imp in deferred
                if not imp.has_reason and imp.path not in pending]
    if len(deferred) > budget:
        problems.append(f"{len(deferred)} function-level imports of the package's own modules, budget {budget}: "
                        + ", ".join(f"{imp.path}:{imp.line}" for imp in deferred))
    return problems


def package_imports() -> list[Import]:
    files = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p, ROOT) for p in files}
    found = []
    for p in files:
        found += imports_of(p.read_text(), module_name(p, ROOT), str(p.relative_to(ROOT)),
                            p.name == "__init__.py", known)
    return found


# ---- the package ----------------------------------------------------------------------------

def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LAYER_OF), f"packages without a layer: {sorted(packages - set(LAYER_OF))}"


def test_no_module_imports_a_higher_layer_or_test_code():
    problems = layer_problems(package_imports())
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)


def test_function_level_imports_are_few_and_give_their_reason():
    problems = function_import_problems(package_imports(), pending=REASON_PENDING)
    assert not problems, "\n".join(problems)


ENGINE_MAY_IMPORT = {"config", "runtime", "wire", "chat", "models", "ops", "inference"}
"""The engine we ship stands alone: below it only the wire format, the chat conventions (its
OpenAI routes), the models and the ops."""
ENGINE_IMPORTERS = {"megatron_grpo.generation.inprocess", "megatron_grpo.sync.in_memory"}
"""The only modules outside ``inference/`` that import it: the in-process engine and its in-memory
weight delivery; the trainer reaches the engine through them (or over HTTP)."""


def engine_problems(found: list[Import]) -> list[str]:
    problems = []
    for imp in found:
        src_pkg, dst_pkg = layer(imp.module)[1], layer(imp.target)[1]
        where = f"{imp.path}:{imp.line}: {imp.module} imports {imp.target}"
        if src_pkg == "inference" and dst_pkg not in ENGINE_MAY_IMPORT:
            problems.append(f"{where} (the engine imports only {sorted(ENGINE_MAY_IMPORT - {'inference'})})")
        if dst_pkg == "inference" and src_pkg != "inference" and imp.module not in ENGINE_IMPORTERS \
                and layer(imp.module)[0] != LAYER_OF["<entry>"]:
            problems.append(f"{where} (only {sorted(ENGINE_IMPORTERS)} reach the engine)")
    return problems


def test_the_engine_stands_alone_and_is_reached_through_the_in_process_adapter():
    problems = engine_problems(package_imports())
    assert not problems, "\n".join(problems)


def test_the_engine_rules_can_fail():
    known = {"megatron_grpo.inference.engine", "megatron_grpo.rollout.generate", "megatron_grpo.wire.samples"}
    bad = imports_of("from megatron_grpo.rollout.generate import RolloutResult\n"
                     "from megatron_grpo.wire.samples import Sample\n", "megatron_grpo.inference.x", "inference/x.py", False,
                     known)
    bad += imports_of("from megatron_grpo.inference.engine import EmbeddedEngine\n", "megatron_grpo.trainer.y",
                      "trainer/y.py", False, known)
    problems = engine_problems(bad)
    assert len(problems) == 2, problems
    assert "inference/x.py:1:" in problems[0] and "the engine imports only" in problems[0]
    assert "trainer/y.py:1:" in problems[1] and "reach the engine" in problems[1]


def test_the_wheel_ships_no_test_code():
    """setup.py's package list (its own ``find_packages`` call) holds no test package."""
    from setuptools import find_packages

    packages = find_packages(str(ROOT), include=["megatron_grpo", "megatron_grpo.*"])
    assert "megatron_grpo.inference" in packages and "megatron_grpo.launcher" in packages
    assert not [p for p in packages if "test" in p.split(".")[-1] or p.split(".")[0] == "tools"], packages
    assert 'find_packages(include=["megatron_grpo", "megatron_grpo.*"])' in (ROOT / "setup.py").read_text()


def private_import_problems(found_sources: dict[str, str]) -> list[str]:
    """``from megatron_grpo.x import _name`` between modules: a private name is its module's."""
    problems = []
    for path, source in found_sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron_grpo"):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.asname]
                if private:
                    problems.append(f"{path}:{node.lineno}: imports private {', '.join(private)} from {node.module}")
    return problems


def test_no_module_imports_another_modules_private_names():
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    problems = private_import_problems(sources)
    assert not problems, "\n".join(problems)
    assert private_import_problems({"x.py": "from megatron_grpo.config.base import _secret\n"}) == [
        "x.py:1: imports private _secret from megatron_grpo.config.base"]


# ---- the checker can fail ---------------------------------------------------------------------

KNOWN = {"megatron_grpo.config.base", "megatron_grpo.trainer.driver", "tests.support.distributed",
         "megatron_grpo.generation.adapters", "megatron_grpo.runtime.device", "megatron_grpo.losses",
         "megatron_grpo.rewards"}

BAD_MODULE = '''
from megatron_grpo.generation.adapters import ENGINES
from tests.support.distributed import run_distributed
from ..runtime import device


def f():
    from megatron_grpo.trainer.driver import train

    return train


def g():
    # the adapters are heavy: imported on first use
    from megatron_grpo.config.base import ConfigError
'''


def test_the_checker_fails_on_a_synthetic_bad_module():
    found = imports_of(BAD_MODULE, "megatron_grpo.config.bad", "megatron_grpo/config/bad.py", False, KNOWN)
    problems = layer_problems(found)
    assert len(problems) == 4, problems
    assert problems[0].startswith("megatron_grpo/config/bad.py:2: megatron_grpo.config.bad imports "
                                  "megatron_grpo.generation.adapters (layer ('generation',) is above ('config',))")
    assert "bad.py:3:" in problems[1] and "never imports test code" in problems[1]
    assert "bad.py:4:" in problems[2] and "megatron_grpo.runtime.device" in problems[2]
    assert "bad.py:8:" in problems[3] and "megatron_grpo.trainer.driver" in problems[3]

    deferred = function_import_problems(found, budget=1)
    assert deferred[0].startswith("megatron_grpo/config/bad.py:8: megatron_grpo.config.bad imports "
                                  "megatron_grpo.trainer.driver inside a function with no reason")
    assert len(deferred) == 2 and deferred[1].startswith("2 function-level imports of the package's own modules, "
                                                         "budget 1")
    assert function_import_problems(found, budget=2, pending={"megatron_grpo/config/bad.py"}) == []


def test_the_checker_sees_a_cycle_inside_one_layer():
    losses = imports_of("from megatron_grpo import rewards\n", "megatron_grpo.losses.x", "l.py", False, KNOWN)
    rewards = imports_of("import megatron_grpo.losses\n", "megatron_grpo.rewards.y", "r.py", False, KNOWN)
    assert layer_problems(losses) == [] and layer_problems(rewards) == []
    (problem,) = layer_problems(losses + rewards)
    assert "a cycle between losses and rewards" in problem


@pytest.mark.parametrize("module", ["megatron_grpo.cli", "megatron_grpo.launcher.cli", "megatron_grpo.models.convert_cli",
                                    "megatron_grpo.inference.serve"])
def test_entry_points_sit_above_the_trainer(module):
    assert layer(module)[0] > LAYER_OF["trainer"]


# ---- the tests: shared helpers only from tests/support/ ------------------------------------

def is_test_module(module: str) -> bool:
    """``tests.test_x``, ``tests.sub.test_y``: a module pytest collects."""
    parts = module.split(".")
    return parts[0] == "tests" and len(parts) > 1 and parts[-1].startswith("test_")


def imported_test_module_problems(found: list[Import]) -> list[str]:
    """One line per import of a test module by another module (a test module, a helper of
    ``tests/support/``, ``conftest.py``, a tool)."""
    return [f"{imp.path}:{imp.line}: {imp.module} imports the test module {imp.target} (shared helpers go in "
            "tests/support/)" for imp in found if is_test_module(imp.target) and imp.target != imp.module]


def imports_of_tests_and_tools() -> list[Import]:
    files = sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py"))
    known = {module_name(p, ROOT) for p in files}
    found = []
    for p in files:
        found += imports_of(p.read_text(), module_name(p, ROOT), str(p.relative_to(ROOT)), p.name == "__init__.py",
                            known)
    return found


def test_no_test_module_is_imported_by_another_module():
    found = imports_of_tests_and_tools()
    assert any(imp.target.startswith("tests.support.") for imp in found)  # the scan sees the tests' imports
    problems = imported_test_module_problems(found)
    assert not problems, "\n".join(problems)


def test_the_test_module_rule_can_fail():
    known = {"tests.test_sync_weights", "tests.test_config", "tests.support.sync_checks", "tests.support"}
    bad = imports_of("from tests.test_sync_weights import _check\n"
                     "import tests.test_config\n"
                     "from tests import test_config\n"
                     "from .test_config import with_change\n"
                     "from tests.support.sync_checks import check_sync\n"
                     "from tests.test_vpp import NUM_LAYERS  # the module itself: not another\n",
                     "tests.test_vpp", "tests/test_vpp.py", False, known)
    bad += imports_of("def f():\n    from tests.test_config import with_change\n", "tests.support.configs",
                      "tests/support/configs.py", False, known)
    problems = imported_test_module_problems(bad)
    assert [p.split(": ", 1)[0] for p in problems] == [f"tests/test_vpp.py:{line}" for line in (1, 2, 3, 4)] + [
        "tests/support/configs.py:2"], problems
    assert problems[0] == ("tests/test_vpp.py:1: tests.test_vpp imports the test module tests.test_sync_weights "
                           "(shared helpers go in tests/support/)")


# ---- the tools: no test code, no sys.path -------------------------------------------------------

def tool_problems(found: list[Import], sources: dict[str, str]) -> list[str]:
    """One line per import of test code by a tool and per use of ``sys.path`` in one."""
    problems = [f"{imp.path}:{imp.line}: {imp.module} imports {imp.target} (a tool never imports test code: "
                "what the benchmarks share lives in tools/bench/common.py)"
                for imp in found if imp.module.split(".")[0] == "tools" and imp.target.split(".")[0] == "tests"]
    for path, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                problems.append(f"{path}:{node.lineno}: sys.path (tools run as modules, python -m tools.X)")
    return problems


def test_no_tool_imports_test_code_or_edits_sys_path():
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "tools").rglob("*.py"))}
    found = imports_of_tests_and_tools()
    assert any(imp.module.startswith("tools.bench.") and imp.target == "tools.bench.common" for imp in found)
    problems = tool_problems(found, sources)
    assert not problems, "\n".join(problems)


def test_the_tool_rule_can_fail():
    known = {"tests.support.distributed", "tools.bench.common"}
    source = ("import sys\nsys.path.insert(0, '.')\nfrom tests.support.distributed import run_distributed\n"
              "from tools.bench.common import fmt\n")
    found = imports_of(source, "tools.bench.x", "tools/bench/x.py", False, known)
    problems = tool_problems(found, {"tools/bench/x.py": source})
    assert [p.split(": ", 1)[0] for p in problems] == ["tools/bench/x.py:3", "tools/bench/x.py:2"], problems
    (bad,) = layer_problems(imports_of("from tools.tiny import vocab\n", "megatron_grpo.data.x", "data/x.py", False,
                                       known))
    assert "never imports tools/" in bad


# ---- module docstrings: short, the rest in docs/ (issue 62) -------------------------------------

DOCSTRING_MAX_LINES = 30
"""Most lines of a module docstring under ``megatron_grpo/`` (the aim is 25: what the module is,
its entry points, the invariants a caller must know, its departures from the paper or reference
it follows; derivations, measurements and history go to the docs page of its topic)."""

# Files another branch is editing now (issue 62): the lead trims them next. Empty it as they land;
# list only files over the limit.
DOCSTRING_PENDING: set[str] = set()


def long_docstrings(sources: dict[str, str], limit: int = DOCSTRING_MAX_LINES) -> dict[str, int]:
    """``{path: lines}`` of the module docstrings longer than ``limit`` lines."""
    found = {}
    for path, source in sources.items():
        doc = ast.get_docstring(ast.parse(source), clean=False)
        if doc and len(doc.splitlines()) > limit:
            found[path] = len(doc.splitlines())
    return found


def test_module_docstrings_are_short():
    sources = {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}
    assert len(sources) > 100
    long = long_docstrings(sources)
    over = {path: n for path, n in long.items() if path not in DOCSTRING_PENDING}
    assert not over, (f"module docstrings over {DOCSTRING_MAX_LINES} lines (move derivations, figures and "
                      f"history to docs/): {over}")
    stale = sorted(path for path in DOCSTRING_PENDING if path not in long)
    assert not stale, f"trimmed or gone, take them out of DOCSTRING_PENDING: {stale}"


def test_the_docstring_rule_can_fail():
    short = '"""One line."""\n'
    long = '"""' + "\n".join(f"line {i}" for i in range(31)) + '\n"""\nx = 1\n'
    assert long_docstrings({"a.py": short, "b.py": long, "c.py": "x = 1\n"}) == {"b.py": 31}
