"""Write Megatron chunks as a Hugging Face directory (config.json, safetensors shards + index,
tokenizer files), loadable by ``AutoModelForCausalLM.from_pretrained``.

Collective over all ranks. The tensors come from ``weights.iter_hf_weights`` (the same
mapping the weight sync uses; with expert parallelism the ep ranks of the first expert replica
all iterate, gathering the experts). Writers are the TP-rank-0, DP-rank-0 rank of each PP stage:
each writes its stage's shards into a temp directory; global rank 0 then names the shards
``model-0000i-of-0000N.safetensors`` in stage order, writes the index and the config, and
renames the directory into place.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch

from megatron_grpo.models.checkpoint import replace_dir
from megatron_grpo.models.hf_config import sidecar_files
from megatron_grpo.models.weights import chunk_params, exports_weights, iter_hf_weights

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def config_dtype(hf_config) -> torch.dtype:
    """The weights' dtype declared in config.json (``dtype`` / ``torch_dtype``), fp32 if none."""
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value)
    return value or torch.float32


def save_hf_checkpoint(model_chunks: list, hf_config, out_dir: str | Path, *,
                       sidecar_dir: str | Path, dtype: torch.dtype | None = None,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       progress: bool = True) -> int:
    """Export the chunks to ``out_dir`` (replaced if it exists); returns the bytes of weights
    written. ``sidecar_dir``: where config.json and the tokenizer files are copied from.
    ``dtype``: of the written tensors; default: config.json's."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dtype = dtype or config_dtype(hf_config)
    final = Path(out_dir)
    tmp = final.with_name(f".{final.name}.tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()

    stage = ps.get_pipeline_model_parallel_rank()
    written: list[tuple[str, list[str], int]] = []  # (file, tensor names, bytes)
    if exports_weights():  # DP replicas hold the same weights (MoE: the ep ranks' experts differ)
        is_writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0
        total = sum(len(m.hf_names) * max(1, len(m.ep_hf_names))
                    for c in model_chunks for m, _ in chunk_params(c, hf_config)
                    if m.exported)
        bar = _progress_bar(total, progress and rank == 0)
        buffer: dict[str, torch.Tensor] = {}
        buffered = 0

        def flush():
            nonlocal buffer, buffered
            if buffer:
                name = f"stage{stage:03d}-{len(written):05d}.safetensors"
                _save_safetensors(buffer, tmp / name)
                written.append((name, list(buffer), buffered))
                buffer, buffered = {}, 0

        for name, tensor in iter_hf_weights(model_chunks, hf_config):
            bar.update(1)
            if not is_writer:
                continue  # TP peers only take part in the gathers
            tensor = tensor.to("cpu", dtype).contiguous()
            if buffered and buffered + tensor.nbytes > max_shard_bytes:
                flush()
            buffer[name] = tensor
            buffered += tensor.nbytes
            bar.set_postfix_str(f"{(sum(w[2] for w in written) + buffered) / 1e6:.1f} MB written",
                                refresh=False)
        flush()
        bar.close()

    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (stage, written))
    total_bytes = 0
    if rank == 0:
        shards = [w for _, ws in sorted(everyone, key=lambda x: x[0]) for w in ws]
        total_bytes = _write_index(tmp, shards)
        _write_config(tmp, Path(sidecar_dir), hf_config, dtype)
        replace_dir(tmp, final)
    dist.barrier()
    return total_bytes


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_index(tmp: Path, shards: list[tuple[str, list[str], int]]) -> int:
    """Rename the stage shards to HF's model-0000i-of-0000N names and write the index."""
    weight_map, total = {}, 0
    for i, (name, tensor_names, nbytes) in enumerate(shards):
        final_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (tmp / name).rename(tmp / final_name)
        weight_map.update({t: final_name for t in tensor_names})
        total += nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def _write_config(tmp: Path, sidecar_dir: Path, hf_config, dtype: torch.dtype) -> None:
    for f in sidecar_files(sidecar_dir):
        shutil.copy2(f, tmp / f.name)
    source = sidecar_dir / "config.json"
    if source.is_file() and config_dtype(hf_config) == dtype:
        shutil.copy2(source, tmp / "config.json")  # verbatim when nothing changed
    else:
        config = copy.deepcopy(hf_config)  # the caller's config keeps its dtype
        config.dtype = dtype
        config.to_json_file(str(tmp / "config.json"))


class _NoBar:
    def update(self, n): ...
    def set_postfix_str(self, s, refresh=True): ...
    def close(self): ...


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="export", unit="tensor", mininterval=1.0)
