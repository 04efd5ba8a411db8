"""The weight-transfer wire format, below both of its ends.

The trainer's weight sync (``megatron_grpo.sync``) sends what the rollout engines receive
(``megatron_grpo.inference``, or SGLang itself): the bytes and the group they travel in
are defined once, here, and both ends import this package, never each other.

* ``buckets``: SGLang's ``flattened_bucket`` layout (one uint8 buffer per single-dtype bucket);
* ``serialize``: named tensors through shared memory (``/update_weights_from_tensor``);
* ``checksum``: the per-tensor checksum both sides compute to verify a sync;
* ``group``: the process group between a trainer rank and the engines' ranks.
"""
