"""The embedded rollout engine: SGLang's HTTP API over a transformers model (CPU or GPU)."""
