"""What every rollout-engine adapter provides (the interface the manager and the sync use).

Kept free of torch and HTTP imports: the pre-flight (``preflight/rules.py``) checks a config
against the capabilities declared here when the config is loaded.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from megatron_grpo.config.engine import EngineConfig
from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.config.sync import SyncConfig

# Verifier signature: (client, url, expected checksums {name: hex}, first rows {name: tensor})
# -> names whose served values differ from what the trainer sent.
Verifier = Callable[..., list[str]]


class EngineKindMismatch(RuntimeError):
    """A server in engine.urls is not of the kind engine.kind names."""


class EngineAdapter:
    """Base adapter: subclasses set the class attributes and override what differs."""

    name: str = ""
    transports: frozenset[str] = frozenset()
    """sync.transport values the engine accepts."""
    backends: frozenset[str] = frozenset()
    """Process-group backends the engine's /init_weights_update_group accepts."""
    supports_memory_release: bool = False
    """True: the engine can give its GPU memory back between rollouts (engine.colocate)."""
    reports_sampling_mask: bool = False
    """True: /generate answers ``return_sampling_mask`` with each draw's kept set and its
    log-prob under the renormalised, truncated distribution (the embedded engine's
    ``meta_info.sampling_mask``, SGLang's ``output_token_sampling_mask`` and
    ``output_token_sampling_logprobs``; rollout.sampling_mask_replay needs it)."""
    sampling_mask_budget_per_request: bool = False
    """True: the largest kept set sent is a /generate key (the embedded engine's
    ``sampling_mask_max_kept``); False: a launch argument (SGLang's
    ``--sampling-mask-max-tokens``), and the request must not carry the key."""
    sampling_mask_needs_top_k: bool = False
    """True: the engine reports kept sets only for a finite ``1 < top_k <= sampling_mask_max_kept``
    (SGLang refuses the request otherwise: an unbounded top-p set has no size limit)."""
    quantizations: frozenset[str] = frozenset()
    """engine.quantization values the engine serves (besides null)."""
    fp8_formats: frozenset[str] = frozenset()
    """engine.fp8_format values its fp8 accepts."""
    quantization_needs_cuda: bool = False
    """True: a quantized engine runs only on a GPU (SGLang's fp8 kernels)."""
    runs: str = "servers"
    """Where the engine runs, which picks how it is started and called (``generation/handles.py``:
    ``HANDLES``) and how the weight sync reaches it (``sync/factory.py``: ``DELIVERIES``):
    ``servers`` (launched or external HTTP servers) or ``in_process`` (inside trainer rank 0's
    process: nothing is launched, ``engine.urls`` cannot name it, the sync is an in-memory copy)."""
    returns_routing: bool = False
    """True: /generate answers ``return_routed_experts`` with the MoE routing of every position
    (``meta_info.routed_experts``; algorithm.router_replay needs it)."""
    reports_token_versions: bool = False
    """True: /generate answers with the weight version of each output token (the embedded
    engine's ``meta_info.output_token_versions``, SGLang's ``meta_info.weight_versions`` spans)
    and ``/pause_generation`` mode ``retract`` re-prefills the retracted sequences with the new
    weights (rollout.mode async needs both)."""

    # ---- what the pre-flight asks ---------------------------------------------------------

    def gpus_per_server(self, engine_cfg: EngineConfig) -> int:
        """CUDA devices one launched server uses (its tensor-parallel size)."""
        return 1

    def preflight(self, engine_cfg: EngineConfig) -> Optional[str]:
        """A one-line problem with this machine's setup for launching (None if fine)."""
        return None

    def sequences_per_request(self, engine_cfg: EngineConfig) -> Optional[int]:
        """Most sequences the client may put in one /generate request, packing several prompt
        groups into it; None: one request per prompt group (SGLang's scheduler batches
        concurrent requests itself, and an external server's bounds are not known)."""
        return None

    # ---- launching ------------------------------------------------------------------------

    def launch_command(self, cfg: ExperimentConfig, model_dir: str, host: str, port: int,
                       gpu_ids: Optional[list[int]] = None, trusted_weight_dirs: Sequence[str] = ()) -> list[str]:
        """The server's command line (``cfg``: the engine section, and what a server is told of
        the weight sync and the sampling); ``gpu_ids``: the CUDA devices it runs on (None without
        CUDA), from ``runtime.placement.engine_gpu_ids``; ``trusted_weight_dirs``: the
        directories /update_weights_from_disk may load from besides the model directory (the
        run's weight-sync directory), for engines that can restrict it."""
        raise NotImplementedError

    def launch_env(self, engine_cfg: EngineConfig, env: dict[str, str]) -> dict[str, str]:
        """The launched server's environment, from the trainer's ``env``."""
        return dict(env)

    # ---- talking to a running server ------------------------------------------------------

    def check_server(self, url: str, server_info: dict) -> None:
        """Raise EngineKindMismatch if ``/get_server_info`` does not describe this kind."""

    def backend(self, sync_cfg: SyncConfig, cuda_available: bool) -> str:
        """The resolved sync.backend for this engine on this machine."""
        if sync_cfg.backend != "auto":
            return sync_cfg.backend
        return "nccl" if cuda_available and "nccl" in self.backends else "gloo"

    def tensor_wire(self, cuda_available: bool) -> str:
        """How the ``tensor`` transport hands a packed bucket to this engine (a key of
        ``sync.transports.TENSOR_WIRES``); SGLang's ``/update_weights_from_tensor`` format by default."""
        return "named_tensors"

    def request_extras(self, verify: bool) -> dict:
        """Extra keys for the engine's weight-update requests in a sync (``verify``: this sync
        is verified)."""
        return {}

    def verify(self, client, url: str, expected: dict[str, str], samples: dict, *,
               quantized: bool = False) -> list[str]:
        """Names of tensors the engine at ``url`` serves differently from what was sent
        (``quantized``: the engine runs engine.quantization; an adapter whose engine then keeps
        only its quantized copy cannot compare values and leaves the check to the probe)."""
        raise NotImplementedError

    def release_memory(self, client, url: str) -> None:
        """Free the engine's GPU memory (weights and KV cache) until ``resume_memory``."""
        raise NotImplementedError(f"engine.kind={self.name!r} cannot release its memory")

    def resume_memory(self, client, url: str, tags: Optional[list[str]] = None) -> None:
        """Take the memory back (``tags``: only these kinds, e.g. ["weights"]; None: all)."""
        raise NotImplementedError(f"engine.kind={self.name!r} cannot resume its memory")

    merges_lora: bool = False
    """True: the engine keeps a LoRA policy's frozen base and merges the adapters it is sent
    (the embedded engine's ``lora``/``lora_base`` update keys, ``inference/lora_update.py``), so
    the weight sync sends the adapters alone after the first sync (``sync/lora_sync.py``);
    False: it is sent the merged weights every sync."""

    @property
    def in_process(self) -> bool:
        """True: the engine runs inside trainer rank 0's process (``runs``)."""
        return self.runs == "in_process"

    @property
    def verifies_by_probe(self) -> bool:
        """True: the sync also compares the engine's log-probs of a probe sequence with the
        trainer's (for engines whose per-tensor check is partial)."""
        return False
