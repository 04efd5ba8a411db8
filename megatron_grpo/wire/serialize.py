"""Named tensors by handle, in SGLang's ``/update_weights_from_tensor`` format.

SGLang's ``MultiprocessingSerializer`` pickles ``[(name, tensor), ...]`` with torch's
``ForkingPickler`` (only a handle to the tensor's memory is pickled, never its data) and
base64-encodes the bytes for JSON. Two kinds of handle:

* a CPU tensor moves to shared memory. The sender must use the ``file_system`` sharing
  strategy: the default ``file_descriptor`` strategy hands file descriptors over a socket
  authenticated with the parent's key, which an unrelated server process does not have
  (SGLang's scheduler dies with "digest sent was rejected");
* a CUDA tensor travels as a CUDA IPC handle (``rebuild_cuda_tensor``): the receiver maps
  the sender's GPU memory, zero copy. Its device is sent as the GPU's UUID, not its index,
  as SGLang's own sender does (``patch_torch.monkey_patch_torch_reductions``, which SGLang's
  receiver expects): two processes may number the GPUs differently (CUDA_VISIBLE_DEVICES).
  The receiver maps the UUID back to its own index. The sender must keep the tensor alive
  until the receiver has loaded it (the tensor transport waits for the answer).

The receiver unpickles with an allow-list of exactly the globals the sender produces, so a
request cannot run arbitrary code through pickle, and maps a CPU tensor's segment only after
the check every shared-memory route applies (``shm.segment_problem``).
"""

from __future__ import annotations

import base64
import copyreg
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import torch
import torch.multiprocessing as torch_mp
import torch.multiprocessing.reductions as reductions

from megatron_grpo.wire.shm import torch_segment_problem

# Exactly the globals the trainer's own sender (``serialize_named_tensors`` of views of one
# packed bucket) produces: a CPU tensor (file_system sharing) and a CUDA tensor (its reduction
# carries its storage's class, ``type(tensor._typed_storage())``). Pinned by
# tests/test_security.py: growing it is a security decision, not a refactoring.
_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
}

# Position of the storage device in ``rebuild_cuda_tensor``'s arguments (the tuple that
# ``reductions.reduce_tensor`` returns for a CUDA tensor); SGLang patches the same slot.
CUDA_DEVICE_ARG = 6


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` of this process."""
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(device: int | str, uuids: list[str]) -> int:
    """This process's index of ``device``: an index as is, a UUID looked up in ``uuids``
    (this process's devices in index order). ValueError for a GPU this process cannot see."""
    if isinstance(device, int):
        return device
    if device not in uuids:
        raise ValueError(f"the sender's GPU {device} is not visible to this process "
                         "(the engine must run on the same machine and see the trainer's GPUs)")
    return uuids.index(device)


def _with_device(args: tuple, convert: Callable[[Any], Any]) -> tuple:
    return (*args[:CUDA_DEVICE_ARG], convert(args[CUDA_DEVICE_ARG]), *args[CUDA_DEVICE_ARG + 1:])


def reduce_tensor_by_uuid(tensor: torch.Tensor):
    """torch's tensor reduction, with a CUDA tensor's device index replaced by its UUID."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        args = _with_device(args, device_uuid)
    return rebuild, args


def rebuild_cuda_tensor_by_uuid(*args):
    """Inverse of ``reduce_tensor_by_uuid`` for a CUDA tensor: open the IPC handle on the
    local index of the sender's GPU."""
    uuids = [device_uuid(i) for i in range(torch.cuda.device_count())]
    return reductions.rebuild_cuda_tensor(*_with_device(args, lambda d: device_index(d, uuids)))


def use_file_system_sharing() -> None:
    """Make this process share tensors through named files (see the module docstring).

    Process-wide and idempotent; the tensor transport calls it once when it is created.
    """
    if torch_mp.get_sharing_strategy() != "file_system":
        torch_mp.set_sharing_strategy("file_system")


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """``[(name, tensor)]`` -> base64 text; tensors are moved to (or already in) shared memory.

    The caller must keep the tensors alive until the receiver has loaded them.
    """
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer)
    # torch registers its reductions on ForkingPickler; only the plain-Tensor entry differs
    # here (UUID devices), on this pickler alone: torch's global reductions stay untouched.
    pickler.dispatch_table = {**copyreg.dispatch_table, **ForkingPickler._extra_reducers,
                              torch.Tensor: reduce_tensor_by_uuid}
    pickler.dump(named_tensors)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def rebuild_storage_filename_checked(cls, manager, handle, size, dtype=None):
    """torch's ``rebuild_storage_filename``, once the segment and its manager socket pass the
    check every shared-memory route applies (``shm.torch_segment_problem``): a payload cannot
    make the receiver map another user's segment, a file outside /dev/shm, or talk to an
    arbitrary socket."""
    problem = torch_segment_problem(manager, handle)
    if problem is not None:
        raise pickle.UnpicklingError(problem)
    return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return rebuild_cuda_tensor_by_uuid
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_storage_filename"):
            return rebuild_storage_filename_checked
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in serialized tensors")


def deserialize_named_tensors(text: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``serialize_named_tensors`` (allow-listed unpickling); ValueError if malformed."""
    try:
        data = _SafeUnpickler(io.BytesIO(base64.b64decode(text, validate=True))).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, RuntimeError, OSError) as e:
        raise ValueError(f"cannot deserialize named tensors: {e}") from None
    if not isinstance(data, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)
        for x in data
    ):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return data
