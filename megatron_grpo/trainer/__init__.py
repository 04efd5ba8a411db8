"""The GRPO trainer: driver loop, Megatron steps, batches, optimizer, checkpoints, entry points."""
