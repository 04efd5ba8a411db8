"""A flattened bucket in a shared-memory file: the embedded engine's CPU tensor-transport wire.

SGLang's ``/update_weights_from_tensor`` format (``serialize.py``) pickles one handle per
tensor; on the CPU the receiver rebuilds them from torch's shared-memory file and maps that
file anew for every request (its tensors are dropped after loading), paying a page fault per
4 KiB each time. The embedded engine
accepts a cheaper wire on the CPU (``/update_weights_from_shm``): the sender packs each bucket
(``buckets.py``'s flattened layout) into ONE file in ``/dev/shm`` that it creates once and
reuses for every bucket of every sync; only its path and the tensors' names, dtypes and shapes
travel over HTTP. The engine maps the file read-only once (kept until the path changes) and
copies the views straight into its parameters: two copies per byte in all (pack, load), no
pickling, no fresh pages after the first sync.

Lifetime: the sender owns the file and unlinks it when its transport is reset or closed (also
after a failed send, an engine death included) and at interpreter exit. A trainer killed with
SIGKILL cannot unlink: the next sender on the machine removes segments whose creating process
(its pid is in the name) no longer exists (``remove_stale_segments``).
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import uuid
import warnings
import weakref
from pathlib import Path
from typing import Optional

import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "megatron_grpo_bucket_"
_NAME = re.compile(rf"^{PREFIX}(\d+)_[0-9a-f]{{16}}$")

TORCH_SEGMENT = re.compile(r"^torch_\d+_\d+_\d+$")
"""A torch ``file_system`` sharing segment (``/dev/shm/torch_<pid>_<random>_<counter>``): what
SGLang's tensor format names for a CPU tensor (``serialize.py``)."""

TORCH_MANAGER_SOCKET = re.compile(r"^/(?:[^/\0]+/)*torch-shm-dir-[A-Za-z0-9_]+/manager\.sock$")
"""torch_shm_manager's socket, which the receiver of a torch segment registers it with."""

_KIND = {_NAME: "megatron-grpo bucket", TORCH_SEGMENT: "torch shared-memory"}


def segment_problem(path: str | Path, pattern: re.Pattern, directory: Path = SHM_DIR) -> Optional[str]:
    """Why a request may not make this process map ``path`` (None: it may). The one check every
    route that takes a shared-memory name applies: a file named like ``pattern`` directly in
    ``directory`` (no ``..``, no other directory), a regular file and not a link, owned by this
    process's user. Another user's segment is refused even when readable; this user's other
    processes are the same trust domain (they could read this process's memory anyway)."""
    p = Path(path)
    if p.parent != directory or not pattern.match(p.name):
        return f"shm name {str(path)!r} is not a {_KIND.get(pattern, 'shared-memory')} segment in {directory}"
    try:
        st = os.lstat(p)
    except OSError as e:
        return f"cannot open shm segment {p}: {e.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"shm segment {p} is not a regular file"
    if st.st_uid != os.getuid():
        return f"shm segment {p} belongs to another user"
    return None


def torch_segment_problem(manager: bytes | str, handle: bytes | str) -> Optional[str]:
    """``segment_problem`` for a torch ``file_system`` handle (``/torch_...``, the name given to
    shm_open) and the manager socket it is registered with (this user's socket, named as
    torch_shm_manager names it); None when both may be used."""
    manager = os.fsdecode(manager)
    handle = os.fsdecode(handle)
    if not handle.startswith("/"):
        return f"shm name {handle!r} is not a torch shared-memory segment in {SHM_DIR}"
    problem = segment_problem(SHM_DIR / handle[1:], TORCH_SEGMENT)
    if problem is not None:
        return problem
    if not TORCH_MANAGER_SOCKET.match(manager) or "/../" in manager or "/./" in manager:
        return f"shm manager {manager!r} is not a torch_shm_manager socket"
    try:
        st = os.lstat(manager)
    except OSError as e:
        return f"cannot use shm manager {manager}: {e.strerror}"
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        return f"shm manager {manager} is not a socket of this user"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Unlink this user's bucket segments whose creating process is gone; returns their names.
    Another user's segments are left alone (their pid may live in another pid namespace, and
    /dev/shm's sticky bit refuses the unlink anyway): they are theirs to clean."""
    removed = []
    for path in directory.glob(PREFIX + "*"):
        match = _NAME.match(path.name)
        try:
            if not match or path.stat().st_uid != os.getuid() or _pid_alive(int(match.group(1))):
                continue
            path.unlink()
            removed.append(path.name)
        except (FileNotFoundError, PermissionError):  # gone meanwhile, or not ours to remove
            pass
    return removed


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmSegment:
    """The sender's segment: a ``/dev/shm`` file of ``nbytes`` mapped as a uint8 tensor [nbytes]."""

    def __init__(self, nbytes: int, directory: Path = SHM_DIR):
        if not directory.is_dir():
            raise RuntimeError(f"{directory} does not exist: the CPU tensor transport needs shared memory "
                               "(use sync.transport: distributed)")
        self.nbytes = nbytes
        self.path = str(directory / f"{PREFIX}{os.getpid()}_{uuid.uuid4().hex[:16]}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        # unlinked at exit even if nobody calls close(); close() runs it once, now
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def close(self) -> None:
        """Unlink the file (the pages go when the engine drops its mapping too)."""
        self.tensor = None  # the mapping itself is released with the last view of it
        self._finalizer()


def open_segment(path: str, nbytes: int, directory: Path = SHM_DIR) -> tuple[mmap.mmap, torch.Tensor]:
    """The receiver's read-only mapping of a sender's segment: (mmap, uint8 tensor [size]).

    Only this user's files named like a ``ShmSegment`` directly in ``directory`` are opened
    (``segment_problem``: a request cannot make the engine map an arbitrary file); ValueError
    otherwise or if the file holds fewer than ``nbytes`` bytes.
    """
    problem = segment_problem(path, _NAME, directory)
    if problem is not None:
        raise ValueError(problem)
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ValueError(f"cannot open shm segment {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():  # swapped in after the check
            raise ValueError(f"shm segment {path} belongs to another user")
        size = st.st_size
        if size < nbytes:
            raise ValueError(f"shm segment {path} holds {size} bytes, the bucket needs {nbytes}")
        # MAP_POPULATE: map every page now, not one fault per 4 KiB during the first copy
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only by design: the engine only reads from it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return mapping, torch.frombuffer(mapping, dtype=torch.uint8)
