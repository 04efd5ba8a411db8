"""The run's engine handle, whatever its kind: ``HANDLES[ENGINES[engine.kind].runs]`` is the
``RolloutEngine`` class of an engine that runs so (``EngineAdapter.runs``): ``HttpEngine`` for
servers (launched or external), ``InProcessEngine`` for the engine in rank 0's process. Each
knows how to start its engine (``start``, collective) and what it can start early (``spawn``);
no other module asks which it has. The weight sync into it is added by ``sync/factory.py``.
"""

from __future__ import annotations

from typing import Optional

from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.generation.adapters import ENGINES
from megatron_grpo.generation.http_engine import HttpEngine
from megatron_grpo.generation.inprocess import InProcessEngine
from megatron_grpo.generation.manager import RolloutServerManager
from megatron_grpo.generation.protocol import RolloutEngine

# EngineAdapter.runs -> the engine handle's class (a test pins the keys to the adapters' values)
HANDLES: dict[str, type] = {"servers": HttpEngine, "in_process": InProcessEngine}


def spawn_engine(cfg: ExperimentConfig) -> Optional[RolloutServerManager]:
    """Rank 0, at its start-up: the processes of the servers the run launches, started without
    waiting for them (None: nothing to start early; ``HttpEngine.spawn``)."""
    return HANDLES[ENGINES[cfg.engine.kind].runs].spawn(cfg)


def start_engine(cfg: ExperimentConfig, *, owner: bool = True,
                 spawned: Optional[RolloutServerManager] = None) -> RolloutEngine:
    """Collective: the engine of ``cfg.engine`` on ``cfg.model.hf_dir``'s weights, generation
    on rank 0 (``owner``), serving fixed weights until a sync is attached (``receiver``).
    ``spawned``: rank 0's servers from ``spawn_engine``."""
    return HANDLES[ENGINES[cfg.engine.kind].runs].start(cfg, owner=owner, spawned=spawned)
