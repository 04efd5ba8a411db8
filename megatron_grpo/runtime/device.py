"""Where tensors live: the one device seam of the package.

Every decision of the form "is this on the GPU?" is made here, and every module that creates
or moves a tensor the model, a collective or the engine reads asks this module:

* ``compute_device()``: the device of this process's model and its inputs: ``cuda:<i>`` with
  CUDA (``i`` = torchrun's LOCAL_RANK, made current by ``runtime.parallel.initialize``), else
  the CPU;
* ``default_backend()``: the default process group's backend (NCCL with CUDA, gloo without);
* ``to_device(x)``: batch placement: a tensor, a dataclass of tensors (``TrainBatch``), a
  dict/list/tuple of them, moved to ``compute_device()`` (a no-op for what is already there);
* ``collective_device(group)``: the side of a collective a tensor must live on: the GPU for an
  NCCL group (NCCL rejects CPU tensors), the CPU for gloo (gloo's CUDA support is partial);
* ``collective_tensor(values, group)``: a small tensor of ``values`` on that side;
* ``all_finite(tensors, group)``: whether every element of every tensor is finite on every
  rank of ``group``, with ONE all-reduce and ONE host sync, whatever the number of tensors.

``runtime.cpu_shim`` is the separate, single place that redirects megatron-core's own
hard-wired CUDA calls when CUDA is absent; this module never patches anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_grpo.config.base import ConfigError


def cuda_available() -> bool:
    """True when this process can use a CUDA device (the single test every branch uses)."""
    return torch.cuda.is_available()


def compute_device() -> torch.device:
    """The device of this rank's model and of the tensors fed to it."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_backend() -> str:
    """Backend of the default process group (and megatron's tp/pp/dp groups)."""
    return "nccl" if cuda_available() else "gloo"


def to_device(obj: Any, device: Optional[torch.device] = None) -> Any:
    """``obj`` with every tensor in it on ``device`` (default ``compute_device()``).

    Tensors, dataclasses (a new instance of the same class, non-tensor fields kept), dicts,
    lists and tuples are walked; anything else is returned as is. Host-to-device copies are
    ``non_blocking`` (the CUDA stream orders them before the kernels that read them).
    """
    device = compute_device() if device is None else device
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: to_device(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a tensor must live to take part in a collective over ``group`` (None: the
    default group): the current GPU for NCCL, the CPU for anything else."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def collective_tensor(values: Sequence[float] | float, group: Optional[dist.ProcessGroup] = None,
                      dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A 1-d tensor of ``values`` on ``collective_device(group)``."""
    if not isinstance(values, (list, tuple)):
        values = [values]
    return torch.tensor(list(values), dtype=dtype, device=collective_device(group))


def local_finite_flag(tensors: Iterable[Optional[torch.Tensor]], extra_ok: bool = True) -> torch.Tensor:
    """0-d bool tensor: every element of every tensor (None skipped) is finite, and ``extra_ok``.

    One ``isfinite().all()`` per tensor, queued on the tensors' device without a host sync;
    the flags are stacked and reduced on that device. (Not ``torch._foreach_norm``: an
    inf-norm whose max reduction drops NaN, or a 2-norm that overflows on large finite
    values, would give the wrong answer.)
    """
    flags = [torch.isfinite(t).all() for t in tensors if t is not None]
    ok = torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool)
    return ok if extra_ok else torch.zeros_like(ok)


def all_finite(tensors: Iterable[Optional[torch.Tensor]], group: Optional[dist.ProcessGroup] = None,
               extra_ok: bool = True) -> bool:
    """True iff ``local_finite_flag`` holds on every rank of ``group`` (None: the default
    group). Collective: one MIN all-reduce on ``collective_device(group)``, one host sync."""
    bad = (~local_finite_flag(tensors, extra_ok)).to(device=collective_device(group), dtype=torch.float32)
    bad = bad.reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return bad.item() == 0.0


def resolve_distributed_optimizer(setting, cuda: bool) -> bool:
    """``parallel.use_distributed_optimizer`` (auto | true | false) on a machine with or
    without CUDA -> whether megatron-core's DistributedOptimizer is used. Never a silent
    drop: true without CUDA is a ConfigError (the pre-flight reports it before any rank starts)."""
    if setting == "auto":
        return cuda
    if setting is True and not cuda:
        raise ConfigError("parallel.use_distributed_optimizer",
                          "true needs CUDA (megatron-core's DistributedOptimizer); this machine has no usable GPU "
                          "(use auto or false)")
    return bool(setting)
