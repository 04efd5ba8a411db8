"""One adapter per rollout-engine kind: the single place that knows how the kinds differ.

``ENGINES[engine.kind]`` is an ``EngineAdapter`` (see ``base.py``). The server manager asks
it for the launch command and environment; the weight sync asks it which transports and
process-group backends the engine accepts, which extra keys its update requests take, and how
to verify what it serves; the pre-flight (``preflight/rules.py``) checks the config against
what it declares (transports, backends, memory release, MoE routing). No other module
branches on the engine kind.
"""

from megatron_grpo.generation.adapters.base import EngineAdapter, EngineKindMismatch
from megatron_grpo.generation.adapters.embedded import EmbeddedAdapter
from megatron_grpo.generation.adapters.inprocess import InProcessAdapter
from megatron_grpo.generation.adapters.sglang import SGLangAdapter, default_sglang_venv, find_sglang_python

# engine.kind -> adapter (the Literal of EngineConfig.kind is pinned to these keys by a test)
ENGINES: dict[str, EngineAdapter] = {
    "embedded": EmbeddedAdapter(),
    "sglang": SGLangAdapter(),
    "inprocess": InProcessAdapter(),
}

__all__ = ["ENGINES", "EngineAdapter", "EngineKindMismatch", "default_sglang_venv", "find_sglang_python"]
