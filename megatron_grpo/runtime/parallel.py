"""Process groups: torch.distributed + megatron-core model-parallel state, on CPU or GPU.

One entry point, ``initialize(tp, pp, seed)``, used by the trainer, the conversion tools
and the tests. The backend is ``runtime.device.default_backend()`` (NCCL when CUDA is
available, gloo otherwise); on CPU the ``cpu_shim`` redirections are installed first.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron_grpo.runtime import cpu_shim
from megatron_grpo.runtime.device import cuda_available, default_backend
from megatron_grpo.runtime.process import free_port


def initialize(tp: int = 1, pp: int = 1, seed: int = 1234, timeout_s: float = 600.0, *,
               ep: int = 1, etp: int | None = None, vpp: int | None = None, cp: int = 1) -> None:
    """Start torch.distributed from the torchrun environment (or a single process) and
    megatron's parallel state with ``tp`` x ``pp`` x ``cp`` (dp = world / (tp * pp * cp)).

    ``cp``: context-parallel size (each sequence split over cp ranks, ``models.context_parallel``;
    gradients are reduced over megatron's data-and-context-parallel group).

    ``ep``: expert-parallel size (MoE experts split over ``ep`` of the dp ranks); ``etp``:
    tensor-parallel size of the experts (default: ``tp``). world / pp must be divisible by
    etp * ep. ``vpp``: virtual pipeline stages per PP rank (None or 1: none); vpp > 1 needs
    pp >= 2 (``build_model`` then builds one chunk per virtual stage).

    Idempotent for the process group; re-initialises megatron's model-parallel state so a
    test may switch sizes between cases. ``timeout_s`` bounds every collective, in the
    default group and in megatron's tp/pp/dp groups alike (megatron's own default is 30
    minutes): a rank whose peer died silently fails after it instead of hanging.
    """
    from megatron.core import parallel_state, tensor_parallel

    cpu_shim.install()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if cuda_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            default_backend(), rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
    world = dist.get_world_size()
    if world % (tp * pp * cp) != 0:
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    etp = tp if etp is None else etp
    vpp = None if vpp in (None, 1) else vpp
    if vpp is not None and pp < 2:
        raise ValueError(f"parallel.vpp={vpp} needs pp >= 2, got pp={pp}")
    if world % (etp * ep * pp) != 0:
        raise ValueError(f"world size {world} is not divisible by etp*ep*pp = {etp}*{ep}*{pp}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        distributed_timeout_minutes=timeout_s / 60,  # a timedelta(minutes=...): fractions are kept
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()




def peer_failure(error: BaseException) -> Optional[str]:
    """What torch.distributed said, in one line, if ``error`` (or an error it was raised
    from) reports another process of a collective gone: it closed its connections (it
    died) or did not answer within the group's timeout. None for any other error.

    NCCL and the c10d store raise ``torch.distributed.DistError``; gloo raises a plain
    RuntimeError whose text starts with the source file of its TCP transport, e.g.
    ``[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4321. This is
    typically caused by ...``. The location and the advice after the first sentence are cut.
    """
    seen: Optional[BaseException] = error
    while seen is not None:
        text = " ".join(str(seen).split())
        if isinstance(seen, dist.DistError) or (isinstance(seen, RuntimeError) and "/gloo/transport/" in text):
            text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # the C++ source location
            return re.split(r"\.\s+(?=[A-Z])", text, maxsplit=1)[0].rstrip(".")
        seen = seen.__cause__ or seen.__context__
    return None
