"""Named tensors through shared memory, in SGLang's ``/update_weights_from_tensor`` format.

SGLang's ``MultiprocessingSerializer`` pickles ``[(name, tensor), ...]`` with torch's
``ForkingPickler`` (the tensor data moves to shared memory; only a handle is pickled) and
base64-encodes the bytes for JSON. The sender must use the ``file_system`` sharing strategy:
the default ``file_descriptor`` strategy hands file descriptors over a socket authenticated
with the parent's key, which an unrelated server process does not have (SGLang's scheduler
dies with "digest sent was rejected").

The receiver unpickles with an allow-list of the globals torch's reductions use, so a
request cannot run arbitrary code through pickle.
"""

from __future__ import annotations

import base64
import io
import pickle
from typing import Any

import torch
import torch.multiprocessing as torch_mp

_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "UntypedStorage"),
    ("torch.nn.parameter", "Parameter"),
}


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
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401 - registers the tensor reductions

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named_tensors)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in serialized tensors")


def deserialize_named_tensors(text: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of ``serialize_named_tensors`` (allow-listed unpickling); ValueError if malformed."""
    import torch.multiprocessing.reductions  # noqa: F401

    try:
        data = _SafeUnpickler(io.BytesIO(base64.b64decode(text, validate=True))).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError) as e:
        raise ValueError(f"cannot deserialize named tensors: {e}") from None
    if not isinstance(data, list) or not all(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], torch.Tensor)
        for x in data
    ):
        raise ValueError("serialized_named_tensors must hold a list of (name, tensor) pairs")
    return data
