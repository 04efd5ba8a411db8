"""The rollout engine we ship: SGLang's HTTP API over a transformers model (CPU or GPU).

``engine`` (``EmbeddedEngine``: weights, generation, weight updates), ``scheduler`` and
``batch`` (continuous batching), ``sampling`` and ``generation`` (the sampler and its
log-probs), ``quantize`` (fp8/int8 rollouts), ``routing`` (MoE routing capture),
``server`` (the HTTP routes and their bounds), ``limits`` (who may call them, how much), ``serve``
(``megatron-grpo serve``). It imports only ``wire``, ``models``, ``ops`` and below; the
trainer reaches it only through ``generation.inprocess``.
"""
