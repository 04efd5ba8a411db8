"""Rollout: the client for SGLang's HTTP API, the embedded engine, and server management.

The trainer uses ``RolloutClient`` (synchronous, several servers round-robin) and gets
``Sample``s back; it never needs to know whether the server is SGLang or the embedded engine.
"""

from megatron_grpo.rollout.client import AsyncRolloutClient, RolloutClient
from megatron_grpo.rollout.types import RolloutError, Sample, SamplingParams

__all__ = ["AsyncRolloutClient", "RolloutClient", "RolloutError", "Sample", "SamplingParams"]
