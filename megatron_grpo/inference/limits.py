"""What one request may make the embedded engine's server do, decided before the engine acts.

A request comes from whoever holds the API key (or anyone, on a server started without one),
so the server checks every request against what it was told at launch (``megatron-grpo
serve``'s options; the trainer passes them from its config) instead of trusting the body:

* **bounded work**: a body of at most ``max_request_bytes`` (413), at most
  ``max_request_sequences`` sequences (the inputs times their ``n``) and at most
  ``max_request_tokens`` tokens in flight (each sequence's prompt plus its ``max_new_tokens``);
  past a bound the answer is a 413 naming it, before anything is queued;
* **weights from trusted directories only**: ``/update_weights_from_disk`` loads a directory
  inside one of ``trusted_weight_dirs`` (the model directory and the run's weight-sync
  directory), after resolving symbolic links, and reads nothing elsewhere;
* **the weight-update rendezvous the trainer configured**: ``/init_weights_update_group``
  joins a group only as a non-zero rank (rank 0, the trainer's sender, hosts the group's store:
  this engine never listens for it) of a group of consistent size, at the master address the
  server was launched with (``weight_sync_master_address``; loopback when not given);
* **LoRA merges of bounded size**: an adapter-only update (``lora_update.py``) merges only
  modules of rank at most ``min(out, in)`` of their weight, each parameter at most once.

Each check is a small pure function returning the one-line problem (None when fine), so the
HTTP layer (``server.py``) only maps problems to status codes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_grpo.config.engine import EmbeddedConfig
from megatron_grpo.runtime.placement import is_loopback

# ``megatron-grpo serve``'s defaults are the config's (engine.embedded.max_request_*), so a
# server started by hand bounds requests as one the trainer launches
_CONFIG = EmbeddedConfig()
DEFAULT_MAX_REQUEST_BYTES = _CONFIG.max_request_mb * 2**20
DEFAULT_MAX_REQUEST_SEQUENCES = _CONFIG.max_request_sequences
DEFAULT_MAX_REQUEST_TOKENS = _CONFIG.max_request_tokens
DEFAULT_READ_TIMEOUT_S = 60.0  # a 16 MiB body at ~0.3 MB/s; the trainer's requests are far smaller


@dataclass(frozen=True, kw_only=True)
class RequestLimits:
    """The launch-time bounds of the embedded engine's server (see the module docstring)."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Largest request body in bytes (413 past it)."""

    max_request_sequences: int = DEFAULT_MAX_REQUEST_SEQUENCES
    """Most sequences one /generate may ask for: its inputs times their ``n``."""

    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
    """Most tokens one /generate may put in flight: the sum over its sequences of the prompt's
    tokens plus ``max_new_tokens``."""

    trusted_weight_dirs: tuple[str, ...] = ()
    """Directories /update_weights_from_disk may load from (and anything inside them)."""

    weight_sync_master_address: Optional[str] = None
    """The one master address /init_weights_update_group may name; None: loopback addresses only."""

    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    """Deadline for reading one request's body once its headers arrived: a slow or stalled
    sender gets a 408 and its connection is closed, instead of holding a slot for ever.
    ``megatron-grpo serve`` bounds the headers by the same time (``runtime/http_guard.py``)."""

    def __post_init__(self):
        for key in ("max_request_bytes", "max_request_sequences", "max_request_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {self.read_timeout_s}")


def request_size_problem(limits: RequestLimits, num_sequences: int, num_tokens: int) -> Optional[str]:
    """Why a /generate of ``num_sequences`` sequences holding ``num_tokens`` tokens in all
    (prompts plus max_new_tokens, per sequence) is too large for ``limits`` (None: it is not)."""
    if num_sequences > limits.max_request_sequences:
        return (f"the request asks for {num_sequences} sequences (inputs x n); this server accepts at most "
                f"{limits.max_request_sequences} per request (--max-request-sequences)")
    if num_tokens > limits.max_request_tokens:
        return (f"the request puts {num_tokens} tokens in flight (prompt + max_new_tokens, per sequence); this "
                f"server accepts at most {limits.max_request_tokens} per request (--max-request-tokens)")
    return None


def trusted_weight_dir(limits: RequestLimits, model_path: str) -> Optional[Path]:
    """``model_path`` resolved (symbolic links followed), when it lies inside a trusted weight
    directory; None otherwise (the caller refuses it without reading anything there)."""
    try:
        resolved = Path(os.path.realpath(model_path))
    except (OSError, ValueError):  # an embedded NUL byte, a path too long
        return None
    for trusted in limits.trusted_weight_dirs:
        root = Path(os.path.realpath(trusted))
        if resolved == root or root in resolved.parents:
            return resolved
    return None


def untrusted_weight_path_message(limits: RequestLimits) -> str:
    """The one line answering a load from outside the trusted directories (it names neither the
    path's contents nor any tensor: what lies there is not the requester's to learn)."""
    dirs = ", ".join(limits.trusted_weight_dirs) or "none"
    return (f"model_path is outside the directories this server loads weights from ({dirs}); start it with "
            "--trusted-weight-dir DIR to add one")


def rendezvous_problem(limits: RequestLimits, *, master_address: str, rank_offset: int, world_size: int,
                       tp_size: int = 1) -> Optional[str]:
    """Why this engine (``tp_size`` ranks) must not join the group a request describes (None: it may).

    Rank 0 is the trainer's sending rank, which hosts the group's store: an engine rank 0
    would listen on ``master_address``, which a request must not choose. The master address
    must be the one the server was launched with (loopback when none was given).
    """
    if world_size < 1 + tp_size:
        return f"world_size must be >= {1 + tp_size} (the trainer's rank 0 and this engine's {tp_size}), got {world_size}"
    if not 1 <= rank_offset <= world_size - tp_size:
        return (f"rank_offset must be in [1, {world_size - tp_size}] for world_size {world_size}: rank 0 is the "
                f"trainer's sender, which hosts the group's store (got {rank_offset})")
    allowed = limits.weight_sync_master_address
    if allowed is None:
        if not is_loopback(master_address):
            return (f"master_address {master_address!r} is not a loopback address; this server joins weight-update "
                    "groups on loopback only (start it with --weight-sync-master-address ADDR to allow ADDR)")
    elif master_address != allowed:
        return (f"master_address {master_address!r} is not the weight-update master address this server was "
                f"started with ({allowed})")
    return None


def lora_rank_problem(name: str, rank: int, out_features: int, in_features: int) -> Optional[str]:
    """Why a LoRA module of ``rank`` on the ``[out_features, in_features]`` weight ``name`` must
    not be merged (None: it may). The merge costs ``out * in * rank`` multiply-adds and its A and
    B ``(out + in) * rank`` values: a rank above ``min(out, in)`` adds nothing a smaller one could
    not express, so the bound caps one request's work at a matmul the size of the weight."""
    if not 1 <= rank <= min(out_features, in_features):
        return (f"{name}: LoRA rank {rank} is outside [1, {min(out_features, in_features)}] "
                f"(min of the weight's {out_features} x {in_features})")
    return None
