"""How the trainer gets generations: the engine protocol, the clients and one adapter per
engine kind.

* ``protocol``: ``RolloutEngine``, what the trainer calls (generate, sync, memory release);
* ``engines``: ``ENGINES[engine.kind]``, one adapter per kind (SGLang, the embedded engine
  over HTTP, the in-process engine), the only place that knows how the kinds differ;
* ``client``: SGLang's HTTP API (``RolloutClient``: synchronous, several servers round-robin;
  ``AsyncRolloutClient``), spoken by SGLang and by our embedded engine alike;
* ``manager``: launching and stopping rollout servers; ``http_engine``: a launched or external
  server as a ``RolloutEngine``; ``inprocess``: the embedded engine in rank 0's process;
  ``handles``: which of the two an engine kind is (``HANDLES[adapter.runs]``), started.

The engine we ship is ``megatron_grpo.inference``; this package is its client side (the
in-process engine is the one place it is imported, through ``inprocess``).
"""

from megatron_grpo.generation.client import AsyncRolloutClient, RolloutClient
from megatron_grpo.wire.samples import RolloutError, Sample, SamplingParams

__all__ = ["AsyncRolloutClient", "RolloutClient", "RolloutError", "Sample", "SamplingParams"]
