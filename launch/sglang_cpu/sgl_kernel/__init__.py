"""A CPU stand-in for SGLang's ``sgl_kernel`` package, for CPU-only test machines. Never on GPUs.

SGLang 0.5.23 runs on CPU (``SGLANG_USE_CPU_ENGINE=1 --device cpu``) only with a CPU build of
its kernels package, which is not published. Its plain-torch layer paths need one kernel from
it; this module implements that one as a Python loop and makes every other ``*_cpu`` kernel
raise ``NotImplementedError`` when called, so a code path that needs a real kernel fails
loudly instead of computing something else.

It deliberately registers no ``torch.ops.sgl_kernel.convert_weight_packed``: SGLang takes that
op's presence as "this CPU has AMX" and would then pack weights for kernels that do not exist.

``launch/setup_sglang_cpu.sh`` copies this package into the SGLang virtual environment it
builds; the trainer's own environment never imports it.
"""

import torch

__version__ = "0.0.0+megatron_grpo_cpu_stand_in"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Write each request's new KV-cache slots into its row of the request->token table.

    req_pool_indices [R] (row of req_to_token per request); req_to_token [pool, pool_len];
    start_offset / end_offset [R] (token positions the slots cover); out_cache_loc [sum(end -
    start)] (the slots, request after request). In place, like the C++ kernel.
    """
    pos = 0
    for i, req in enumerate(req_pool_indices.tolist()):
        start, end = int(start_offset[i]), int(end_offset[i])
        req_to_token[req, start:end] = out_cache_loc[pos: pos + end - start]
        pos += end - start


def __getattr__(name: str):
    if name.endswith("_cpu"):
        def missing(*args, **kwargs):
            raise NotImplementedError(f"sgl_kernel.{name} has no CPU stand-in (megatron-grpo's sgl_kernel "
                                      "implements only what SGLang's plain-torch CPU path needs)")
        missing.__name__ = name
        return missing
    raise AttributeError(f"module 'sgl_kernel' has no attribute {name!r}")
