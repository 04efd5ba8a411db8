"""The embedded engine (``python -m megatron_grpo.inference.serve``): this package's own server."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from megatron_grpo.config.engine import EngineConfig
from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.generation.adapters.base import EngineAdapter, EngineKindMismatch
from megatron_grpo.wire.checksum import compare_checksums

API_KEY_ENV = "MEGATRON_GRPO_API_KEY"
"""Environment variable holding the launched engine's API key (``megatron-grpo serve`` reads it
when --api-key is not given; keeps the key out of the process list)."""


class EmbeddedAdapter(EngineAdapter):
    name = "embedded"
    transports = frozenset({"distributed", "tensor", "disk"})
    # gloo on the CPU; NCCL once the model is on a GPU (the engine refuses NCCL on a CPU).
    backends = frozenset({"gloo", "nccl"})
    returns_routing = True  # engine.routing
    reports_sampling_mask = True  # engine.sampling
    sampling_mask_budget_per_request = True
    reports_token_versions = True  # engine.scheduler (sample_step, RETRACT)
    quantizations = frozenset({"fp8", "int8"})  # engine.quantize, on CPU and GPU
    fp8_formats = frozenset({"e4m3", "e5m2"})
    merges_lora = True  # engine.lora_update: the adapters alone after the base

    def sequences_per_request(self, engine_cfg: EngineConfig) -> Optional[int]:
        # The servers a run launches take engine.embedded.max_request_sequences per request: a
        # step's groups then travel in one request each way instead of one per prompt (each
        # request costs the launched engine and the client about a millisecond of Python).
        return None if engine_cfg.urls else engine_cfg.embedded.max_request_sequences

    def launch_command(self, cfg: ExperimentConfig, model_dir: str, host: str, port: int,
                       gpu_ids: Optional[list[int]] = None, trusted_weight_dirs: Sequence[str] = ()) -> list[str]:
        # The API key travels in the environment (launch_env), not argv, where `ps` shows it.
        device = f"cuda:{gpu_ids[0]}" if gpu_ids else "cpu"
        engine_cfg, master_address = cfg.engine, cfg.sync.master_address
        embedded = engine_cfg.embedded
        cmd = [sys.executable, "-m", "megatron_grpo.inference.serve", "--model-dir", model_dir, "--host", host,
               "--port", str(port), "--dtype", engine_cfg.dtype,
               "--max-batch-size", str(embedded.max_batch_size), "--device", device,
               # what one request may make the server do (inference/limits.py)
               "--max-request-sequences", str(embedded.max_request_sequences),
               "--max-request-tokens", str(embedded.max_request_tokens),
               "--max-request-bytes", str(embedded.max_request_mb * 2**20),
               "--decode", embedded.decode, "--stop-check-every", str(embedded.stop_check_every)]
        for directory in trusted_weight_dirs:
            cmd += ["--trusted-weight-dir", str(directory)]
        if master_address:  # null: the trainer's 127.0.0.1, the server's default
            cmd += ["--weight-sync-master-address", master_address]
        if engine_cfg.quantization:
            cmd += ["--quantization", engine_cfg.quantization, "--fp8-format", engine_cfg.fp8_format]
        return cmd

    def launch_env(self, engine_cfg: EngineConfig, env: dict[str, str]) -> dict[str, str]:
        out = dict(env)
        if engine_cfg.api_key:
            out[API_KEY_ENV] = engine_cfg.api_key
        return out

    def check_server(self, url: str, server_info: dict) -> None:
        if server_info.get("engine") != "embedded":
            raise EngineKindMismatch(
                f"engine.urls: {url} is not a megatron-grpo embedded engine (it looks like "
                f"{_describe(server_info)}); set engine.kind to the server's kind")

    def tensor_wire(self, cuda_available: bool) -> str:
        # CUDA IPC handles on a GPU (SGLang's format, zero copy); on the CPU one reused
        # /dev/shm segment per sender instead of a fresh torch shared-memory file per bucket
        return "named_tensors" if cuda_available else "shm_bucket"

    def request_extras(self, verify: bool) -> dict:
        # The engine checksums what it loaded in the background, overlapping the next bucket.
        return {"compute_checksums": True} if verify else {}

    def verify(self, client, url: str, expected: dict[str, str], samples: dict, *,
               quantized: bool = False) -> list[str]:
        """Exact per-tensor checksums of the served weights (``/weights_checksum``); a quantized
        engine checksums the weights as received, which its quantized copy is rebuilt from."""
        answer = client.call("weights_checksum", {"names": sorted(expected)}, url=url)["checksums"]
        return compare_checksums(expected, {n: v["checksum"] for n, v in answer.items()})


def _describe(server_info: dict) -> str:
    if server_info.get("engine"):
        return f"a {server_info['engine']} engine"
    if server_info.get("version"):
        return f"SGLang {server_info['version']}"
    return "an unknown server"
