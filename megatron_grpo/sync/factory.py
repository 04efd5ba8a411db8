"""``build_engine``: the run's engine handle with its weight sync, the one place both are built.

The engine kind's adapter says where the engine runs (``EngineAdapter.runs``); that picks the
handle (``generation/handles.py``: ``HANDLES``, started there) and the sync's delivery into it
(``DELIVERIES`` here: over ``sync.transport`` into servers, or an in-memory copy into the
in-process engine), which ``WeightSync`` drives. The trainer builds it with a sync (every
rank), ``megatron-grpo eval`` without one (the engine serves the checkpoint's fixed weights).
"""

from __future__ import annotations

from typing import Callable, Optional

from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.generation.adapters import ENGINES
from megatron_grpo.generation.handles import start_engine
from megatron_grpo.generation.manager import RolloutServerManager
from megatron_grpo.generation.protocol import RolloutEngine
from megatron_grpo.sync.driver import Delivery, Probe, WeightSync
from megatron_grpo.sync.in_memory import InMemoryDelivery
from megatron_grpo.sync.servers import ServerDelivery

# EngineAdapter.runs -> (cfg, hf_config, the started handle) -> the sync's delivery into it
DELIVERIES: dict[str, Callable[..., Delivery]] = {
    "servers": ServerDelivery.of_engine,
    "in_process": InMemoryDelivery.of_engine,
}


def build_engine(cfg: ExperimentConfig, hf_config=None, *, owner: bool = True, synced: bool = True,
                 probe: Optional[Probe] = None, spawned: Optional[RolloutServerManager] = None) -> RolloutEngine:
    """Collective: rank 0 (``owner``) starts (or connects to) the engine of ``cfg.engine``; with
    ``synced`` every rank builds its half of the weight sync into it (``hf_config``: the
    policy's; ``probe``: the trainer's log-probs of the verification sequence). ``spawned``:
    rank 0's servers already started at its start-up (``generation.handles.spawn_engine``)."""
    engine = start_engine(cfg, owner=owner, spawned=spawned)
    if synced:
        try:
            delivery = DELIVERIES[ENGINES[cfg.engine.kind].runs](cfg, hf_config, engine)
            engine.receiver = WeightSync(cfg, hf_config, delivery, probe=probe)
        except BaseException:  # nothing this run started outlives a failed build
            engine.close()
            raise
    return engine
