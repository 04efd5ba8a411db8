"""Let megatron-core run on a machine without CUDA (gloo backend). A no-op when CUDA exists.

megatron-core 0.16 assumes a GPU in a handful of places that the CPU path reaches; ``install()``
redirects exactly these, and only when ``torch.cuda.is_available()`` is false, so GPU code paths
never see it. It is idempotent and process-local; call it before building models or schedules
(``runtime.parallel.initialize`` does). What it redirects:

* ``torch.cuda.current_device()`` / ``synchronize()`` and ``device="cuda"`` tensor factories in
  the p2p code, schedules, causal-mask helper, optimizer and gradient buffers (those modules see
  a ``torch`` whose factories map "cuda" to the CPU; the real ``torch`` is untouched);
* the ``torch.cuda.FloatTensor`` assert in gradient clipping (same scaling, no assert);
* two scoped redirections: ``Tensor.cuda`` while a tied-embedding model is built at PP > 1
  (``tensor_cuda_is_identity``), and the CUDA type names by which the mixed-precision optimizer
  sorts bf16/fp16 parameters (``tensor_type_names_cuda``, in ``trainer.optim``);
* the CUDA RNG states tracker, activation recomputation's CUDA RNG state save/restore, the MoE
  router's ``te_general_gemm`` (None: the ``torch.mm`` path), and context parallelism's RoPE slice.

The DistributedOptimizer type-checks CUDA tensors and is not supported on CPU: the trainer uses
the plain megatron optimizer there. One redirection is for speed only (CPU path only; the GPU
path was measured with megatron's own): ``_fork_write_results_queue`` starts the checkpoint
writer's result manager with *fork* instead of *spawn* (the child dies with its rank).

Each redirection, why, and what it saves: docs/design.md#megatron-core-on-cpu.
"""

from __future__ import annotations

import contextlib
import types

import torch

from megatron_grpo.runtime.process import forks_die_with_this_process

_INSTALLED = False

# megatron-core modules that create tensors with a hard-wired device="cuda" on paths the
# CPU trainer reaches (schedules' token counter, the causal mask, the optimizer's scalars).
_MODULES_WITH_CUDA_FACTORIES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",  # local_multi_tensor_l2_norm (gradient clipping without apex)
)


def cuda_absent() -> bool:
    """True when this process has no usable CUDA device."""
    return not torch.cuda.is_available()


class CpuRNGStatesTracker:
    """Drop-in for megatron's ``CudaRNGStatesTracker`` that forks the CPU generator.

    Named streams (``model-parallel-rng``, ...) get their own seeded CPU generator state;
    ``fork`` swaps it in and restores the caller's state afterwards, which is what the
    CUDA tracker does with the CUDA generator.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        gen = torch.Generator()
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _strip_cuda_device(fn):
    def wrapper(*args, **kwargs):
        dev = kwargs.get("device")
        if dev == "cuda" or (isinstance(dev, torch.device) and dev.type == "cuda"):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


def _torch_with_cpu_factories() -> types.ModuleType:
    """A stand-in for the ``torch`` name inside megatron's schedules: same module, except the
    tensor factories map ``device="cuda"`` to the CPU."""
    proxy = types.ModuleType("torch_cpu_factories")
    proxy.__dict__.update(torch.__dict__)
    for name in ("zeros", "ones", "empty", "tensor", "full"):
        setattr(proxy, name, _strip_cuda_device(getattr(torch, name)))
    return proxy


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's ``clip_grad_by_total_norm_fp32`` minus its ``torch.cuda.FloatTensor`` type
    assert: scale every fp32 gradient in place by max_norm / (total_norm + 1e-6) if < 1."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


@contextlib.contextmanager
def tensor_cuda_is_identity():
    """While building a GPTModel without CUDA, ``Tensor.cuda`` returns the tensor itself.

    With tied embeddings and PP > 1, megatron-core's ``setup_embeddings_and_output_layer``
    moves the first/last stage copies to CUDA (``weight.data.cuda()``) before the all-reduce
    that makes them equal; on CPU the gloo all-reduce then runs on the CPU tensors. Scoped to
    the model constructor (``models.builder``), a no-op with CUDA."""
    if not cuda_absent():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


@contextlib.contextmanager
def tensor_type_names_cuda():
    """While building megatron's optimizer without CUDA, ``Tensor.type()`` (no argument) of a
    CPU tensor answers the CUDA name (``torch.BFloat16Tensor`` -> ``torch.cuda.BFloat16Tensor``).

    ``Float16OptimizerWithFloat16Params.__init__`` decides by these names which parameters
    are float16/bfloat16 (they get an fp32 main copy that the optimizer steps) and raises on
    any other name; the CPU tensors are the same dtypes. Scoped to that constructor, a no-op
    with CUDA; ``Tensor.type(dtype)`` (a cast) is untouched."""
    if not cuda_absent():
        yield
        return
    original = torch.Tensor.type

    def cuda_named_type(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or self.is_cuda or not name.startswith("torch."):
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_named_type
    try:
        yield
    finally:
        torch.Tensor.type = original


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim: int, cp_group):
    """megatron's ``get_pos_emb_on_this_cp_rank`` (the angles of CP rank r's chunks r and
    2cp-1-r, ``models.context_parallel``) without its pinned-memory ``.cuda()`` index."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _fork_write_results_queue():
    """megatron's ``filesystem_async._get_write_results_queue`` (one manager queue per
    process, created on the first save) with a fork-context manager (module docstring)."""
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from multiprocessing.managers import SyncManager

    if filesystem_async._results_queue is None:
        # the forked server must die with the rank; it closes the copies of the rank's sockets
        # it inherited first, so that a connection the rank closes is closed (a peer blocked
        # in a collective sees a rank that gave its group up at once: models.checkpoint.AgreedSave)
        with forks_die_with_this_process():
            manager = SyncManager(ctx=mp.get_context("fork"))
            manager.start(_close_inherited_sockets)
        filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive
    return filesystem_async._results_queue


def _close_inherited_sockets() -> None:
    """In a forked child: close every socket it inherited (gloo's connections, the c10d
    store's); a multiprocessing manager's server makes its own listener after this runs."""
    import os
    import stat

    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: nothing to close by
        return
    for fd in fds:
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:  # the directory's own descriptor, gone by now
            pass


def install() -> bool:
    """Apply the CPU redirections if CUDA is absent. Returns True when they are active."""
    global _INSTALLED
    if not cuda_absent():
        return False
    if _INSTALLED:
        return True
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]

    import importlib

    from megatron.core.tensor_parallel import random as mcore_random

    proxy = _torch_with_cpu_factories()
    for name in _MODULES_WITH_CUDA_FACTORIES:
        importlib.import_module(name).torch = proxy
    from megatron.core.optimizer import clip_grads, optimizer

    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._get_write_results_queue = _fork_write_results_queue
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    mcore_random.initialize_rng_tracker(force_reset=True)
    _INSTALLED = True
    return True
