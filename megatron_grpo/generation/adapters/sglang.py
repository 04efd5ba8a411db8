"""SGLang (``python -m sglang.launch_server``), the rollout server users run on GPUs.

Facts about SGLang 0.5.23 that this adapter (and the sync) rely on, checked by
``tests/test_sglang_contract.py`` against the real server:

* tensor and distributed weight updates load only between ``/begin_weight_update`` and
  ``/end_weight_update`` (disk updates outside it); unknown request keys are rejected, so no
  extras are sent;
* ``/init_weights_update_group`` accepts gloo and NCCL;
* ``/get_weights_by_name`` returns the first ``truncate_size`` rows of a tensor by its HF name
  for some architectures (Llama) and fails for others (Qwen2, whose attention is fused): the
  row check is therefore partial, and each verified sync also compares the server's
  log-probs of a probe sequence with the trainer's;
* output log-probs are those of ``log_softmax(logits / temperature)``; *input* (prompt)
  log-probs are always at temperature 1;
* ``/release_memory_occupation`` calls CUDA and kills a CPU server: used only with
  ``engine.colocate``, which the pre-flight refuses without a GPU
  (``preflight.layout_problem``); ``/resume_memory_occupation`` takes ``tags``
  (``weights``, ``kv_cache``) so weights can come back before the sync and the KV cache after;
* ``--base-gpu-id N`` puts a server's tp ranks on devices N .. N+tp-1 of those it sees.

On a machine without CUDA the server runs on CPU through SGLang's CPU engine
(``SGLANG_USE_CPU_ENGINE=1``, plain-torch attention and sampling), from the environment
``launch/setup_sglang_cpu.sh`` builds (it provides the CPU stand-in for SGLang's kernels).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import yaml

from megatron_grpo.config.engine import EngineConfig
from megatron_grpo.config.experiment import ExperimentConfig
from megatron_grpo.generation.adapters.base import EngineAdapter, EngineKindMismatch
from megatron_grpo.wire.samples import RolloutError

log = logging.getLogger(__name__)

VENV_ENV = "MEGATRON_GRPO_SGLANG_VENV"
"""Environment variable naming the SGLang environment (also read by the setup script)."""

_STAMP = ".megatron_grpo_stamp"  # written last by launch/setup_sglang_cpu.sh: the env is complete

# What makes SGLang 0.5.23 serve on a CPU (no CUDA graphs, no overlap scheduler, plain-torch
# attention and sampling, no grammar backend; warm-up skipped, a small KV pool). --sleep-on-idle:
# an idle scheduler waits on its sockets instead of polling them, which otherwise takes 70-90% of
# a core (measured on 2 cores) from the trainer's ranks while they train.
CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--grammar-backend", "none", "--disable-overlap-schedule", "--cuda-graph-backend-decode", "disabled",
            "--cuda-graph-backend-prefill", "disabled", "--skip-server-warmup", "--max-total-tokens", "4096",
            "--sleep-on-idle"]
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}

_SAMPLE_ROWS = 8  # rows per tensor compared through /get_weights_by_name

# SGLang routes only this adapter calls (not in the client's shared ROUTES).
_RELEASE_MEMORY = ("POST", "/release_memory_occupation")
_RESUME_MEMORY = ("POST", "/resume_memory_occupation")


def default_sglang_venv() -> Path:
    """Where ``launch/setup_sglang_cpu.sh`` builds the SGLang environment by default."""
    if os.environ.get(VENV_ENV):
        return Path(os.environ[VENV_ENV])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "megatron-grpo" / "sglang-cpu"


def find_sglang_python(configured: Optional[str]) -> tuple[Optional[str], str]:
    """(interpreter, "") that runs SGLang, or (None, why not) — see ``engine.sglang.python``."""
    if configured:
        if not os.access(configured, os.X_OK):
            return None, f"engine.sglang.python: {configured} is not an executable interpreter"
        return configured, ""
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable, ""
    venv = default_sglang_venv()
    python = venv / "bin" / "python"
    if (venv / _STAMP).is_file() and os.access(python, os.X_OK):
        return str(python), ""
    return None, (f"engine.kind=sglang: no SGLang found (this interpreter cannot import sglang and "
                  f"{venv} holds no complete SGLang environment); run `bash launch/setup_sglang_cpu.sh` "
                  "on a CPU machine, `pip install sglang` on a GPU machine, or set engine.sglang.python")


def checkpoint_dtype(model_dir: str) -> str:
    """The dtype config.json declares (what engine.dtype=auto means). SGLang's own ``auto``
    would serve a float32 checkpoint in float16: a silent train/inference mismatch."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"  # the server reports the unreadable directory itself
    declared = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return declared if declared in ("float32", "bfloat16", "float16") else "auto"


def _cuda_available() -> bool:
    import torch  # at launch time torch is loaded anyway; config loading stays torch-free

    return torch.cuda.is_available()


def _key_file(api_key: str) -> str:
    """A 0600 YAML file (``api-key: ...``) for SGLang's ``--config``, which merges it into its
    arguments in memory, so the key never appears on a command line. Removed when this
    process exits; a SIGKILL leaves it, readable by its owner only."""
    fd, path = tempfile.mkstemp(prefix="megatron-grpo-sglang-", suffix=".yaml")  # mode 0600
    with os.fdopen(fd, "w") as f:
        f.write(yaml.safe_dump({"api-key": api_key}))  # SGLang passes each key on as --<key>
    atexit.register(_remove, path)
    return path


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class SGLangAdapter(EngineAdapter):
    name = "sglang"
    transports = frozenset({"distributed", "tensor", "disk"})
    backends = frozenset({"gloo", "nccl"})
    supports_memory_release = True
    # --quantization fp8 on a bf16/fp32 checkpoint: online fp8 (per-channel weights, dynamic
    # per-token activations on CUDA), which ops/quantize.py reproduces for the probe
    quantizations = frozenset({"fp8"})
    fp8_formats = frozenset({"e4m3"})
    quantization_needs_cuda = True
    # SGLang 0.5.23 records, at each /update_weight_version, how many tokens every live request
    # had drawn under the old label, and answers with the spans (meta_info.weight_versions,
    # parsed by generation/client.py); its /pause_generation retract mode keeps the drawn tokens
    # and re-prefills them with the new weights on /continue_generation
    reports_token_versions = True
    # SGLang 0.5.23's return_sampling_mask: each draw's support (ids) and the sampled token's
    # log-prob renormalised over it, for a finite top_k <= --sampling-mask-max-tokens only
    reports_sampling_mask = True
    sampling_mask_needs_top_k = True

    def gpus_per_server(self, engine_cfg: EngineConfig) -> int:
        return engine_cfg.sglang.tp

    def preflight(self, engine_cfg: EngineConfig) -> Optional[str]:
        if engine_cfg.urls:
            return None
        return find_sglang_python(engine_cfg.sglang.python)[1] or None

    def launch_command(self, cfg: ExperimentConfig, model_dir: str, host: str, port: int,
                       gpu_ids: Optional[list[int]] = None, trusted_weight_dirs: Sequence[str] = ()) -> list[str]:
        # trusted_weight_dirs: SGLang has no option to restrict /update_weights_from_disk
        # (docs/fault_tolerance.md, "Security defaults", says what remains open)
        engine_cfg, rollout_cfg = cfg.engine, cfg.rollout
        python, problem = find_sglang_python(engine_cfg.sglang.python)
        if python is None:
            raise RuntimeError(problem)
        sglang_cfg = engine_cfg.sglang
        cmd = [python, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", host, "--port", str(port),
               "--tp-size", str(sglang_cfg.tp), "--mem-fraction-static", str(sglang_cfg.mem_fraction_static),
               "--dtype", checkpoint_dtype(model_dir) if engine_cfg.dtype == "auto" else engine_cfg.dtype]
        if not _cuda_available():
            cmd += CPU_ARGS
        elif gpu_ids:
            cmd += ["--base-gpu-id", str(gpu_ids[0])]
        if engine_cfg.quantization:
            cmd += ["--quantization", engine_cfg.quantization]
        if rollout_cfg.truncates and rollout_cfg.sampling_mask_replay:
            cmd += ["--sampling-mask-max-tokens", str(rollout_cfg.sampling_mask_max_kept)]
        if engine_cfg.colocate:
            cmd += ["--enable-memory-saver"]  # what /release_memory_occupation needs
        if engine_cfg.api_key:  # a 0600 file, not argv, where `ps` shows it to every local user
            cmd += ["--config", _key_file(engine_cfg.api_key)]
        return cmd + list(sglang_cfg.extra_args)

    def launch_env(self, engine_cfg: EngineConfig, env: dict[str, str]) -> dict[str, str]:
        out = dict(env)
        # The trainer's own PYTHONPATH (an editable install, test helpers) must not shadow the
        # packages of another interpreter's environment.
        python, _ = find_sglang_python(engine_cfg.sglang.python)
        if python is not None and python != sys.executable:
            out.pop("PYTHONPATH", None)
        if not _cuda_available():
            out.update(CPU_ENV)
        return out

    def check_server(self, url: str, server_info: dict) -> None:
        if server_info.get("engine") == "embedded" or "version" not in server_info:
            raise EngineKindMismatch(
                f"engine.urls: {url} is not an SGLang server (/get_server_info has "
                f"{'engine=embedded' if server_info.get('engine') else 'no version'}); set engine.kind "
                "to the server's kind")

    def verify(self, client, url: str, expected: dict[str, str], samples: dict, *,
               quantized: bool = False) -> list[str]:
        """The first rows of each tensor through ``/get_weights_by_name`` (partial: see the module
        docstring; a tensor the route cannot return is logged, and the probe covers it). A
        quantized server keeps only its fp8 copy of the projections, so no rows are compared
        then: the probe, run through the same quantization by the trainer, checks everything."""
        import torch

        if quantized:
            return []

        bad, unverifiable = [], 0
        for name, rows in samples.items():
            try:
                served = client.call("get_weights_by_name", {"name": name, "truncate_size": _SAMPLE_ROWS},
                                     url=url, retry=False)
            except RolloutError:
                unverifiable += 1
                continue
            got = torch.tensor(served, dtype=torch.float32)
            if got.shape != rows[:_SAMPLE_ROWS].shape or not torch.equal(got, rows[:_SAMPLE_ROWS].float()):
                bad.append(name)
        if unverifiable:
            log.info("%s: /get_weights_by_name could not return %d of %d tensors (checked by the log-prob probe)",
                     url, unverifiable, len(samples))
        return bad

    def release_memory(self, client, url: str) -> None:
        client.call(_RELEASE_MEMORY, {}, url=url, retry=False)

    def resume_memory(self, client, url: str, tags: Optional[list[str]] = None) -> None:
        client.call(_RESUME_MEMORY, {"tags": tags}, url=url, retry=False)

    @property
    def verifies_by_probe(self) -> bool:
        return True
