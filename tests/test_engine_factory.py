"""The engine boundary: one factory builds the run's engine handle and its weight sync for every
engine kind (``sync.factory.build_engine``), from the adapter's ``runs`` through two registries
(``generation.handles.HANDLES``, ``sync.factory.DELIVERIES``); no module outside the adapters and
the pre-flight asks whether an engine is in-process."""

from __future__ import annotations

import ast
from pathlib import Path

from megatron_grpo.config import EngineConfig, ModelConfig, TrainerConfig
from megatron_grpo.generation.adapters import ENGINES
from megatron_grpo.generation.handles import HANDLES, spawn_engine
from megatron_grpo.generation.inprocess import InProcessEngine
from megatron_grpo.sync.driver import WeightSync
from megatron_grpo.sync.factory import DELIVERIES, build_engine
from megatron_grpo.sync.in_memory import InMemoryDelivery
from tests.support.configs import experiment
from tools.tiny import save_tiny_model

ROOT = Path(__file__).resolve().parent.parent

READS_IN_PROCESS = {"megatron_grpo/preflight/rules.py", "megatron_grpo/preflight/layout.py"}
"""The modules that may read ``adapter.in_process``: the pre-flight's rules (what a config may
combine with an engine that runs in rank 0's process), reading the adapter, building nothing."""


def test_every_adapter_has_a_handle_and_a_delivery():
    runs = {adapter.runs for adapter in ENGINES.values()}
    assert runs == set(HANDLES) == set(DELIVERIES) == {"servers", "in_process"}
    assert [kind for kind, adapter in ENGINES.items() if adapter.in_process] == ["inprocess"]


def in_process_reads(sources: dict[str, str]) -> list[str]:
    """``path:line`` of every ``.in_process`` read outside ``READS_IN_PROCESS``."""
    return [f"{path}:{node.lineno}" for path, source in sources.items() if path not in READS_IN_PROCESS
            for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute) and node.attr == "in_process"]


def test_no_module_branches_on_in_process_outside_the_preflight():
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "megatron_grpo").rglob("*.py"))}
    assert in_process_reads(sources) == []
    bad = {"megatron_grpo/trainer/x.py": "if ENGINES[kind].in_process:\n    pass\n"}
    assert in_process_reads(bad) == ["megatron_grpo/trainer/x.py:1"]


def test_nothing_is_spawned_for_an_in_process_engine_or_external_servers():
    assert spawn_engine(experiment(engine=EngineConfig(kind="inprocess"))) is None
    assert spawn_engine(experiment(engine=EngineConfig(urls=["http://127.0.0.1:1"]))) is None


def test_the_in_process_engine_with_and_without_its_sync(tmp_path):
    model_dir = str(save_tiny_model(tmp_path / "qwen2", "qwen2", seed=11))
    cfg = experiment(engine=EngineConfig(kind="inprocess", dtype="float32", request_timeout_s=77),
                     model=ModelConfig(hf_dir=model_dir), trainer=TrainerConfig(run_dir=str(tmp_path / "run")))
    fixed = build_engine(cfg, synced=False)  # megatron-grpo eval's
    try:
        assert isinstance(fixed, InProcessEngine) and fixed.receiver is None and fixed.timeout_s == 77
    finally:
        fixed.close()
    synced = build_engine(cfg, None)  # the trainer's (one process: rank 0)
    try:
        assert isinstance(synced.receiver, WeightSync)
        assert isinstance(synced.receiver.delivery, InMemoryDelivery)
        assert synced.receiver.delivery.engine is synced.engine is not None
    finally:
        synced.close()
