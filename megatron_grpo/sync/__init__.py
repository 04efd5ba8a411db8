"""Per-step weight sync from the Megatron trainer into the rollout engine(s)."""
