"""Security properties (issue 8), each checked on the real component:

* every server the package starts binds 127.0.0.1 unless configured otherwise: the rollout
  config default, `megatron-grpo serve`, the manager's launch commands, a launched engine's
  listening socket (read from /proc/net), and the weight-sync group's TCP store;
* the embedded engine enforces the API key on every route but /health (real server);
* weights and checkpoints load only through safetensors or `torch.load(weights_only=True)`
  (a source scan, plus malicious pickles fed to the real loaders), and the one deliberate
  unpickler (`wire/serialize.py`) accepts nothing but torch's tensor-rebuild globals;
* reward plug-ins are imported only from dotted paths named in the config.
"""

from __future__ import annotations

import ast
import base64
import json
import math
import os
import pickle
import shutil
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.security import LOOPBACK_V4, PickledCall, listen_addresses
from megatron_grpo.config import EngineConfig, SGLangConfig
from tests.support.configs import experiment

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_grpo"
API_KEY = "s3cret-key"


def _package_sources() -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


# ---- servers bind loopback ---------------------------------------------------------------------

def test_server_defaults_are_loopback():
    from megatron_grpo.generation.adapters import ENGINES
    from megatron_grpo.inference.serve import parse_args

    cfg = experiment(engine=EngineConfig(sglang=SGLangConfig(python=sys.executable)))
    assert cfg.engine.host == "127.0.0.1"
    assert parse_args(["--model-dir", "m"]).host == "127.0.0.1"
    for engine, adapter in ENGINES.items():
        if adapter.in_process:  # no server, nothing binds
            continue
        cmd = adapter.launch_command(cfg, "m", cfg.engine.host, 1234)
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1", engine
    exposed = experiment(engine=EngineConfig(host="0.0.0.0"))  # configured otherwise: honoured
    cmd = ENGINES["embedded"].launch_command(exposed, "m", exposed.engine.host, 1)
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"


def _sync_store_listeners(rank, world):
    """How the sync transport hosts the group: a socket bound first (``bind_group_store``),
    its port handed out, the store hosted on it. Returns (listening addresses, whether
    another socket could bind the port between the bind and the group's start)."""
    import socket

    from megatron_grpo.wire.group import bind_group_store, destroy_custom_process_group, init_custom_process_group

    listen = bind_group_store("127.0.0.1")
    port = listen.getsockname()[1]
    try:
        socket.create_server(("127.0.0.1", port)).close()
        taken = True
    except OSError:
        taken = False
    group = init_custom_process_group(backend="gloo", master_address="127.0.0.1", master_port=port,
                                      world_size=1, rank=0, group_name="security_probe", listen_socket=listen)
    try:
        return sorted(listen_addresses(port)), taken
    finally:
        destroy_custom_process_group(group)


def test_weight_sync_store_listens_on_the_master_address_only():
    """torch's TCPStore server alone would listen on every interface ([::]); and the port the
    engines are told is held from before it is told, so no other process can take it."""
    from tests.support.distributed import run_distributed

    ((addresses, taken),) = run_distributed(_sync_store_listeners, 1, timeout_s=300)
    assert addresses == [LOOPBACK_V4]
    assert not taken


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tools.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("sec") / "model", "qwen2", seed=0)


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    """A real embedded engine launched by the manager with an API key."""
    from megatron_grpo.generation.manager import RolloutServerManager

    cfg = experiment(engine=EngineConfig(api_key=API_KEY, launch_timeout_s=180, dtype="float32"))
    manager = RolloutServerManager(cfg, model_dir=str(tiny_model), run_dir=tmp_path_factory.mktemp("sec_run"))
    (url,) = manager.start()
    try:
        yield url
    finally:
        manager.stop()


def _routes() -> list[tuple[str, str]]:
    """(method, path) of every route of the embedded engine's app."""
    from megatron_grpo.inference.server import build_app

    out = []
    for route in build_app(None, api_key=API_KEY).routes:  # the engine is only used by handlers
        for method in sorted(getattr(route, "methods", None) or []):
            if method != "HEAD":
                out.append((method, route.path))
    return out


@pytest.mark.slow
def test_a_launched_engine_gets_a_per_run_key_on_no_command_line(tiny_model, tmp_path):
    """No key configured: the server the run launches still enforces one, random per run,
    known to the run's own client only (and never on a command line)."""
    import psutil

    from megatron_grpo.generation.http_engine import start_servers
    from megatron_grpo.wire.samples import SamplingParams

    manager, client = start_servers(experiment(engine=EngineConfig(launch_timeout_s=180, dtype="float32")),
                                    model_dir=str(tiny_model), run_dir=tmp_path)
    try:
        key = manager.engine_cfg.api_key
        assert key and len(key) >= 32
        assert len(client.generate([[1, 2, 3]], 1, SamplingParams(max_new_tokens=2))) == 1
        (url,) = manager.urls
        anonymous = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3]}, timeout=30)
        assert anonymous.status_code == 401
        assert [p.pid for p in psutil.process_iter(["cmdline"]) if key in " ".join(p.info["cmdline"] or [])] == []
    finally:
        client.close()
        manager.stop()


@pytest.mark.slow
def test_launched_engine_listens_on_loopback_only(engine):
    port = int(engine.rsplit(":", 1)[1])
    assert listen_addresses(port) == {LOOPBACK_V4}


@pytest.mark.slow
def test_engine_enforces_the_api_key_on_every_route_but_health(engine):
    routes = _routes()
    assert len(routes) >= 15 and ("POST", "/update_weights_from_tensor") in routes
    with httpx.Client(base_url=engine, timeout=30) as http:
        for method, path in routes:
            if path.startswith("/health"):
                assert http.request(method, path).status_code == 200, path
                continue
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                            {"Authorization": f"Basic {API_KEY}"}):
                r = http.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, headers, r.status_code)
        # a path under /health does not escape the check
        assert http.get("/health/../get_model_info").status_code in (401, 404)
        good = {"Authorization": f"Bearer {API_KEY}"}
        assert http.get("/get_model_info", headers=good).status_code == 200
        r = http.post("/generate", headers=good, json={
            "input_ids": [5, 207, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 1.0}})
        assert r.status_code == 200, r.text


def test_the_api_key_is_compared_in_constant_time(monkeypatch):
    """The key check goes through hmac.compare_digest on bytes (a `!=` on str returns at the
    first differing character, so its timing tells a guesser how much of the key was right);
    a non-ASCII header is a 401, not an error."""
    import hmac

    from fastapi.testclient import TestClient

    from megatron_grpo.inference.server import build_app

    compared = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((type(a), type(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    with TestClient(build_app(None, api_key=API_KEY)) as client:  # the engine is only used by handlers
        assert client.get("/get_model_info", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/get_model_info", headers={"Authorization": "Bearer \xe9t\xe9".encode("latin-1")}
                          ).status_code == 401
    assert compared == [(bytes, bytes)] * 2


# ---- weights: safetensors or torch.load(weights_only=True) ---------------------------------------

def _call_name(node: ast.Call) -> str:
    """Dotted name of the called function (``torch.load``, ``pickle.loads``, ``eval``)."""
    parts, f = [], node.func
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if isinstance(f, ast.Name):
        parts.append(f.id)
    return ".".join(reversed(parts))


def _keyword(node: ast.Call, name: str):
    for kw in node.keywords:
        if kw.arg == name:
            return kw.value.value if isinstance(kw.value, ast.Constant) else kw.value
    return None


SERIALIZE = "megatron_grpo/wire/serialize.py"
# Where unpickling is allowed: the allow-listed tensor unpickler, and the test harness, which
# unpickles what its own spawned rank sent over a private pipe (the trust multiprocessing's
# queue already places in it: it unpickles every message itself).
PICKLERS = {SERIALIZE, "tests/support/distributed.py",
            # the graders' worker process: requests and answers between the scorer and the child
            # it started, over that child's private stdin/stdout pipes (the harness's trust)
            "megatron_grpo/rewards/isolated.py"}


def _is_safe_yaml_loader(path: str, node: ast.Call) -> bool:
    """``yaml.load(..., Loader=X)`` where X (looked up in the calling module) is a SafeLoader."""
    import importlib

    import yaml

    loader = next((kw.value for kw in node.keywords if kw.arg == "Loader"), None)
    names = []
    while isinstance(loader, ast.Attribute):
        names.append(loader.attr)
        loader = loader.value
    if not isinstance(loader, ast.Name):
        return False
    obj = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    for name in [loader.id, *reversed(names)]:
        obj = getattr(obj, name)
    return isinstance(obj, type) and issubclass(obj, yaml.SafeLoader)


def test_source_loads_weights_only_safely():
    problems = []
    for path, tree in _package_sources().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                for bad in ("pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"):
                    if any(n and n.split(".")[0] == bad for n in names) and not (bad == "pickle" and path in PICKLERS):
                        problems.append(f"{path}:{node.lineno}: imports {bad}")
            if isinstance(node, ast.Call):
                name = _call_name(node)
                where = f"{path}:{node.lineno}: {name}"
                if name.endswith("torch.load"):
                    if _keyword(node, "weights_only") is not True:
                        problems.append(f"{where} without weights_only=True")
                if isinstance(node.func, ast.Name) and name in ("eval", "exec"):  # not `model.eval()`
                    problems.append(where)
                if name.endswith(("yaml.unsafe_load", "yaml.full_load")) or (
                        name.endswith("yaml.load") and not _is_safe_yaml_loader(path, node)):
                    problems.append(f"{where} without a SafeLoader")
                if name.endswith(("np.load", "numpy.load")) and _keyword(node, "allow_pickle") is not False:
                    problems.append(f"{where} may unpickle")
                if _keyword(node, "trust_remote_code") not in (None, False):
                    problems.append(f"{where} with trust_remote_code")
                if name.startswith("subprocess.") and _keyword(node, "shell") not in (None, False):
                    problems.append(f"{where} with shell=True")
                if (name.endswith(("pickle.load", "pickle.loads", "Unpickler")) and path not in PICKLERS):
                    problems.append(where)
    text = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    if "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD" in text or "weights_only=False" in text:
        problems.append("the package turns torch.load's weights_only off somewhere")
    assert not problems, "\n".join(problems)


def test_the_safe_unpickler_is_the_only_unpickler():
    """In serialize.py, pickle is used only through _SafeUnpickler (no pickle.load/loads)."""
    tree = _package_sources()[SERIALIZE]
    calls = {_call_name(n) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not {c for c in calls if c.startswith("pickle.") and c != "pickle.UnpicklingError"}
    assert "_SafeUnpickler" in calls


def _payloads(marker: Path) -> dict[str, bytes]:
    import torch.multiprocessing.reductions as reductions

    return {
        "builtins.open": pickle.dumps([("w", PickledCall(open, str(marker), "w"))]),
        "os.system": pickle.dumps([("w", PickledCall(os.system, f"touch {marker}"))]),
        "torch.save": pickle.dumps([("w", PickledCall(torch.save, {}, str(marker)))]),
        "torch.load": pickle.dumps([("w", PickledCall(torch.load, str(marker)))]),
        "rebuild_storage_fd": pickle.dumps([("w", PickledCall(reductions.rebuild_storage_fd, None, None, 0))]),
        "pathlib.Path.touch": pickle.dumps([("w", PickledCall(Path.touch, marker))]),
    }


def test_safe_unpickler_rejects_arbitrary_globals(tmp_path):
    from megatron_grpo.wire.serialize import _ALLOWED_GLOBALS, deserialize_named_tensors

    marker = tmp_path / "pwned"
    for name, payload in _payloads(marker).items():
        with pytest.raises(ValueError, match="is not allowed"):
            deserialize_named_tensors(base64.b64encode(payload).decode())
        assert not marker.exists(), name
    # the allow-list is exactly what the trainer's sender produces (pinned: growing it is a
    # security decision, not a refactoring; tests/test_security_engine.py derives it from the
    # sender), plus the two rebuild functions replaced by checked versions
    assert _ALLOWED_GLOBALS == {
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "UntypedStorage"),
        # the storage class a CUDA tensor's reduction carries (found on a GPU); as a callable it
        # can only build a storage, as UntypedStorage already can
        ("torch.storage", "TypedStorage"),
    }
    for bad in ("not base64!", base64.b64encode(pickle.dumps({"a": 1})).decode()):
        with pytest.raises(ValueError):
            deserialize_named_tensors(bad)


def test_safe_unpickler_still_reads_real_tensors():
    """Not vacuous: a payload made exactly like the sender's loads (file_system sharing)."""
    import torch.multiprocessing as torch_mp

    from megatron_grpo.wire.serialize import deserialize_named_tensors, serialize_named_tensors

    before = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        tensors = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(2, dtype=torch.bfloat16))]
        out = deserialize_named_tensors(serialize_named_tensors(tensors))
    finally:
        torch_mp.set_sharing_strategy(before)
    assert [n for n, _ in out] == ["a", "b"]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(out, tensors))


def test_malicious_pytorch_bin_is_not_executed_by_the_engine_loader(tiny_model, tmp_path):
    """A model dir whose weights are a pickle (pytorch_model.bin) that would run code: the
    embedded engine's loader (transformers, weights_only=True) refuses it."""
    from megatron_grpo.inference.engine import EmbeddedEngine

    bad = tmp_path / "model"
    shutil.copytree(tiny_model, bad)
    (bad / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    torch.save({"model.embed_tokens.weight": PickledCall(open, str(marker), "w")}, bad / "pytorch_model.bin")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        EmbeddedEngine(bad)
    assert not marker.exists()


def test_malicious_checkpoint_files_are_not_executed(tmp_path):
    """megatron-core's dist-checkpoint common state (common.pt) and the trainer's RNG files
    go through torch.load with weights_only: a pickled exploit raises instead of running."""
    from megatron.core import dist_checkpointing

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    marker = tmp_path / "pwned"
    torch.save({"step": PickledCall(open, str(marker), "w")}, ckpt / "common.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        dist_checkpointing.load_common_state_dict(str(ckpt))
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):
        torch.load(ckpt / "common.pt", weights_only=True)  # what load_training_checkpoint uses
    assert not marker.exists()


# ---- plug-ins only from dotted paths named in the config ------------------------------------------

PLUGIN_INIT = """
from pathlib import Path
Path(__file__).with_name("imported_" + __name__.replace(".", "_")).touch()
"""


@pytest.fixture
def plugin_package(tmp_path, monkeypatch):
    """A package on sys.path whose modules leave a marker file when imported."""
    pkg = tmp_path / "sec_plugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(PLUGIN_INIT))
    (pkg / "rewards.py").write_text(textwrap.dedent(PLUGIN_INIT) + "def fn(response, answer):\n    return 1.0\n")
    (pkg / "other.py").write_text(textwrap.dedent(PLUGIN_INIT) + "def fn(response, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m == "sec_plugins" or m.startswith("sec_plugins.")]:
        del sys.modules[name]


def _imported(pkg: Path) -> set[str]:
    return {p.name.removeprefix("imported_") for p in pkg.glob("imported_*")}


def test_plugins_are_imported_only_when_named(plugin_package):
    from megatron_grpo.config.base import build_section
    from megatron_grpo.config.sections import RewardConfig
    from megatron_grpo.rewards import RewardScorer

    # built-ins only: nothing of the package is imported, although it is on sys.path
    RewardScorer(build_section(RewardConfig, {"functions": [{"name": "math_exact_match"}]}, "reward"))
    assert _imported(plugin_package) == set() and "sec_plugins" not in sys.modules
    # naming it in the config validates the name's shape only; the import happens when the
    # trainer builds its scorer, and takes exactly the named module (and its package)
    cfg = build_section(RewardConfig, {"functions": [{"name": "sec_plugins.rewards.fn"}]}, "reward")
    assert _imported(plugin_package) == set()
    scorer = RewardScorer(cfg)
    assert _imported(plugin_package) == {"sec_plugins", "sec_plugins_rewards"}
    assert scorer.score(["x"], ["y"]).rewards == [1.0]


def test_dynamic_imports_only_from_fixed_registries_or_config():
    """Every importlib.import_module / __import__ call site is one of the known ones: the CLI's
    sub-command registry, the reward registry (config-named paths), the CPU shim's fixed list,
    the environments' fork server's fixed RUN_TARGETS, the graders' worker (built-in modules)."""
    allowed = {"megatron_grpo/cli.py", "megatron_grpo/rewards/registry.py", "megatron_grpo/runtime/cpu_shim.py",
               "megatron_grpo/rollout/episodes/environment/worker.py",
               # the graders' worker: imports the built-in reward modules the scorer names
               "megatron_grpo/rewards/isolated.py",
               # the connectors: the fixed table of config/connectors.py (loading.py for the
               # environments', the agent connectors' __init__.py for the agents')
               # and each connector's own library (skyrl_gym, OpenEnv's client) or the app file the
               # config names (openenv:path/to/app.py:app)
               "megatron_grpo/rollout/episodes/environment/loading.py",
               "megatron_grpo/rollout/episodes/agent/connectors/__init__.py",
               "megatron_grpo/rollout/episodes/environment/connectors/skyrl_gym_adapter.py",
               "megatron_grpo/rollout/episodes/environment/connectors/openenv_adapter.py"}
    sites = set()
    for path, tree in _package_sources().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _call_name(node) in ("importlib.import_module", "__import__",
                                                                   "import_module", "entry_points"):
                sites.add(path)
    assert sites <= allowed, sites - allowed


MALFORMED = [
    ("/generate", {"input_ids": "abc"}), ("/generate", {"input_ids": [1, "x"]}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": "x"}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}}),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": "x"}}),
    ("/generate", {"text": 5}), ("/generate", {"input_ids": [10**30]}),
    ("/generate", {"input_ids": [1, 2], "skip_batch_window": "yes"}),
    ("/update_weights_from_disk", {"model_path": 5}), ("/update_weights_from_tensor", {"serialized_named_tensors": 5}),
    ("/init_weights_update_group", {"master_address": 5}), ("/pause_generation", {"mode": 7}),
    ("/update_weights_from_shm", {"path": 3}), ("/get_weights_by_name", {"name": 5}),
]

# (sampling_params key, value): each a 400 naming "sampling_params.<key>". sampling_seed 2**70
# was a 500 with a reset connection, top_k 2**70 a 200 with a traceback in the server's log
# (both overflow torch's int64), temperature inf/nan were accepted, top_k "a" named no field.
BAD_SAMPLING = [
    ("sampling_seed", 2**70), ("sampling_seed", -1), ("sampling_seed", "7"), ("sampling_seed", 1.5),
    ("top_k", 2**70), ("top_k", "a"), ("top_k", 0), ("top_k", -2), ("top_k", 2.5), ("top_k", True),
    ("temperature", float("inf")), ("temperature", float("nan")), ("temperature", -0.5), ("temperature", 1e39),
    ("temperature", 10**400), ("temperature", "hot"),
    ("top_p", 0), ("top_p", float("nan")), ("top_p", 1.5), ("min_p", float("inf")), ("min_p", -0.1),
    ("max_new_tokens", -3), ("max_new_tokens", 2**70), ("max_new_tokens", 4.0), ("max_new_tokens", None),
    ("n", 0), ("n", "2"), ("stop_token_ids", "x"), ("stop_token_ids", [2**70]), ("stop_token_ids", [1, "2"]),
    ("ignore_eos", "yes"), ("skip_special_tokens", 0), ("no_stop_trim", "no"), ("stream_interval", 0),
]


@pytest.mark.slow
def test_malformed_fields_are_a_400_with_one_line_never_a_500(engine):
    """Wrong types on the engine's routes: a BadRequest naming the problem, not an internal
    error with a traceback in the log (model_path: 5 was a 500)."""
    with httpx.Client(base_url=engine, timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        for route, body in MALFORMED:
            r = http.post(route, json=body)
            assert r.status_code == 400, (route, body, r.status_code, r.text[:200])
            message = r.json()["message"]
            assert message and "\n" not in message and "Traceback" not in message, (route, message)
        for key, value in BAD_SAMPLING:
            # json.dumps writes inf and nan as Infinity and NaN, which JSON has not: the server
            # refuses them while parsing the body, naming the constant
            body = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, key: value}})
            r = http.post("/generate", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (key, value, r.status_code, r.text[:200])
            message = r.json()["message"]
            finite = not isinstance(value, float) or math.isfinite(value)
            expected = f"sampling_params.{key} must be" if finite else "which is not a JSON number"
            assert expected in message and "\n" not in message, (key, value, message)
        # a request key of the wrong type names the key (issue 48: logprob_start_len "x" was a 400
        # saying only "invalid literal for int()", 1.7 was read as 1, "false" as true)
        for key, value in (("logprob_start_len", "x"), ("logprob_start_len", 1.7), ("logprob_start_len", True),
                           ("return_logprob", "false"), ("return_sampling_mask", 1),
                           ("return_routed_experts", None)):
            r = http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1},
                                             key: value})
            assert r.status_code == 400, (key, value, r.status_code, r.text[:200])
            assert r.json()["message"].startswith(key), (key, value, r.json()["message"])
        # still serving, and the edges of every range are accepted
        r = http.post("/generate", json={"input_ids": [1, 2], "sampling_params": {
            "max_new_tokens": 2, "sampling_seed": 2**63 - 1, "top_k": 2**63 - 1, "temperature": 0,
            "top_p": 1, "min_p": 0, "stop_token_ids": [2**63 - 1], "n": 1, "ignore_eos": True}})
        assert r.status_code == 200, r.text[:200]


@pytest.mark.slow
def test_sglang_reads_its_key_from_a_0600_file_never_from_its_command_line(demo, sglang_servers):
    """The real SGLang the trainer launches (here the session's shared server, launched the same
    way): its key is in the ``--config`` file it names, mode 0600, and on no process's command
    line; a request without the key is refused, one with it answered."""
    import stat

    import psutil

    from tests.support.sglang_shared import API_KEY

    url = sglang_servers.serve(demo / "model")
    port = url.rsplit(":", 1)[1]
    launched = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
                if "sglang.launch_server" in " ".join(p.info["cmdline"] or []) and port in (p.info["cmdline"] or [])]
    assert launched, f"no sglang.launch_server process on port {port}"
    cmdline = launched[0]
    key_file = Path(cmdline[cmdline.index("--config") + 1])
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and API_KEY in key_file.read_text()
    assert [p.pid for p in psutil.process_iter(["cmdline"]) if API_KEY in " ".join(p.info["cmdline"] or [])] == []
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}}
    assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 401
    answered = httpx.post(url + "/generate", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert answered.status_code == 200, answered.text[:300]


def test_a_per_run_key_never_starts_with_a_dash_and_a_configured_one_may_not():
    """SGLang turns the key file into ``--api-key VALUE``; a value starting with "-" is read as an
    option and the launch fails ("expected one argument": CI drew such a key from
    token_urlsafe). The per-run key is hex; a configured one is refused at load, unechoed."""
    from megatron_grpo.config import ConfigError, load_config
    from megatron_grpo.generation.http_engine import run_api_key

    keys = [run_api_key(EngineConfig()) for _ in range(2000)]
    assert len(set(keys)) == len(keys) and all(len(k) == 64 and int(k, 16) >= 0 for k in keys)
    config = ROOT / "yaml_configs" / "demo_cpu.yaml"
    with pytest.raises(ConfigError, match=r"engine.api_key: must not start with '-'") as e:
        load_config(config, ["engine.api_key=-secret-value"])
    assert "secret-value" not in str(e.value)
    assert load_config(config, ["engine.api_key=s-e-c-r-e-t"]).engine.api_key == "s-e-c-r-e-t"
