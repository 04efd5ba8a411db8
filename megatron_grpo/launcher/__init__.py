"""``megatron-grpo train``: pre-flight, the run directory's lock, and this machine's ranks
started under torchrun's agent (``agent``), one node of several (``nodes``: ``--nnodes``,
Slurm). The ranks themselves run ``megatron_grpo.train`` (``trainer.rank``)."""
