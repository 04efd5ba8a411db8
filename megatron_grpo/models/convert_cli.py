"""`megatron-grpo convert-hf-to-megatron` / `convert-megatron-to-hf` (and tools/convert_*.py).

Both run as one CPU process by default (``--tp 1 --pp 1``) or, unchanged, under
``torchrun --nproc-per-node N`` with ``--tp/--pp`` for models that need splitting. Every
conversion ends with a self-check (a probe batch through the Megatron model and the HF model,
max |Δlogits| printed, exit 1 above ``--tolerance``); ``--no-self-check`` skips it.

Exit codes: 0 success, 1 self-check failure, 2 user error (one line on stderr).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

from megatron_grpo.models.errors import ModelError
from megatron_grpo.models.builder import build_model
from megatron_grpo.models.checkpoint import (
    HF_SUBDIR,
    checkpoint_dtype,
    checkpoint_hf_config,
    checkpoint_lora,
    dir_bytes,
    load_lora_adapters,
    load_megatron_checkpoint,
    save_megatron_checkpoint,
)
from megatron_grpo.models.hf_config import load_hf_config, split_problem
from megatron_grpo.models.hf_export import config_dtype, save_hf_checkpoint
from megatron_grpo.models.lora import apply_lora, iter_adapters, spec_from_metadata
from megatron_grpo.models.lora_export import save_peft_adapter
from megatron_grpo.models.self_check import DEFAULT_TOLERANCE, round_params_, run_self_check
from megatron_grpo.models.weights import SafetensorsReader, load_hf_weights
from megatron_grpo.runtime import parallel
from megatron_grpo.runtime.errors import one_line
from megatron_grpo.runtime.files import check_writable
from megatron_grpo.runtime.library_warnings import quiet_library_warnings

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-dir", required=True, type=Path, help="directory to write (absent or empty, unless --overwrite)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of this run")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of this run")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size of this run (MoE models)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="dtype of the written weights (auto: config.json's)")
    p.add_argument("--no-self-check", dest="self_check", action="store_false",
                   help="skip the logits comparison (needs the full HF model in one process)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"max |Δlogits| accepted by the self-check (default {DEFAULT_TOLERANCE:g})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output-dir")


def hf_to_megatron_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convert-hf-to-megatron",
                                description="Hugging Face directory -> Megatron distributed checkpoint")
    p.add_argument("--hf-dir", required=True, type=Path, help="HF model directory")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    _common_args(p)
    return p


def megatron_to_hf_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convert-megatron-to-hf",
                                description="Megatron checkpoint (any TP/PP) -> Hugging Face directory")
    p.add_argument("--ckpt-dir", required=True, type=Path, help="megatron-grpo checkpoint directory")
    p.add_argument("--max-shard-size-gb", type=float, default=5.0, help="safetensors shard size")
    lora = p.add_mutually_exclusive_group()
    lora.add_argument("--lora", action="store_true",
                      help="a LoRA checkpoint: write its adapters as a peft adapter folder (self-check: peft on the HF base)")
    lora.add_argument("--merge", action="store_true",
                      help="a LoRA checkpoint: write the merged model (base + adapters) as an HF directory "
                           "(a full checkpoint converts as without it)")
    p.add_argument("--base", type=Path, default=None,
                   help="a LoRA checkpoint's base (HF directory or megatron-grpo checkpoint); default: the one it "
                        "was trained from, recorded in the checkpoint")
    _common_args(p)
    return p


def hf_to_megatron(args) -> int:
    hf_config = load_hf_config(args.hf_dir)
    SafetensorsReader(args.hf_dir)  # fail now on missing weights, before starting ranks
    _check_output(args.output_dir, args.overwrite, args.hf_dir)
    _check_split(hf_config, args, args.hf_dir)
    dtype = DTYPES.get(args.dtype) or config_dtype(hf_config)
    _initialize(args.tp, args.pp, args.ep)
    say = _printer()

    t0 = time.perf_counter()
    chunks = build_model(hf_config, dtype=dtype, init_weights=False,
                         make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    load_hf_weights(chunks, args.hf_dir, hf_config, progress=_is_rank0())
    save_megatron_checkpoint(chunks, args.output_dir, hf_dir=args.hf_dir)
    del chunks
    written = dir_bytes(args.output_dir)
    say(f"wrote {args.output_dir} ({written / 1e6:.1f} MB, {dtype}) in {time.perf_counter() - t0:.1f}s")
    if not args.self_check:
        return 0
    # Check what is on disk: a fresh fp32 model (NaN-filled, so a parameter the checkpoint
    # failed to cover shows up as NaN logits) loaded from the written checkpoint.
    chunks = build_model(hf_config, dtype=torch.float32, init_weights=False,
                         make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    _fill_nan(chunks)
    load_megatron_checkpoint(chunks, args.output_dir)
    result = run_self_check(chunks, hf_config, args.hf_dir, args.tolerance,
                            hf_round_to=dtype)
    say(result.line())
    return 0 if result.ok else 1


def megatron_to_hf(args) -> int:
    lora = checkpoint_lora(args.ckpt_dir)
    if lora is not None or args.lora:  # --merge on a full checkpoint: nothing to merge, converted as usual
        return lora_to_hf(args, lora)
    hf_config = checkpoint_hf_config(args.ckpt_dir)
    _check_output(args.output_dir, args.overwrite, args.ckpt_dir)
    _check_split(hf_config, args, Path(args.ckpt_dir) / HF_SUBDIR)
    out_dtype = DTYPES.get(args.dtype) or config_dtype(hf_config)
    # fp32 for the self-check's reference forward; the stored dtype otherwise (less memory).
    model_dtype = torch.float32 if args.self_check else (checkpoint_dtype(args.ckpt_dir) or out_dtype)
    _initialize(args.tp, args.pp, args.ep)
    say = _printer()

    t0 = time.perf_counter()
    chunks = build_model(hf_config, dtype=model_dtype, init_weights=False)
    _fill_nan(chunks)
    load_megatron_checkpoint(chunks, args.ckpt_dir)
    written = save_hf_checkpoint(chunks, hf_config, args.output_dir,
                                 sidecar_dir=Path(args.ckpt_dir) / HF_SUBDIR, dtype=out_dtype,
                                 max_shard_bytes=int(args.max_shard_size_gb * 1024**3),
                                 progress=_is_rank0())
    say(f"wrote {args.output_dir} ({written / 1e6:.1f} MB of {out_dtype} weights) "
        f"in {time.perf_counter() - t0:.1f}s")
    if not args.self_check:
        return 0
    # Compare with the weights as written (rounded to out_dtype), not as held in fp32.
    round_params_([p for c in chunks for p in c.parameters()], out_dtype)
    result = run_self_check(chunks, hf_config, args.output_dir, args.tolerance)
    say(result.line())
    return 0 if result.ok else 1


def lora_to_hf(args, lora: dict | None) -> int:
    """A LoRA checkpoint (adapters only) -> a peft adapter folder (``--lora``) or the merged HF
    model (``--merge``), each with its self-check against an independent HF forward."""
    if lora is None:
        raise ModelError(f"--lora: {args.ckpt_dir} holds no LoRA adapters (a full checkpoint: convert it "
                         "without --lora)")
    if not (args.lora or args.merge):
        raise ModelError(f"{args.ckpt_dir} holds LoRA adapters only: pass --lora (a peft adapter folder) or "
                         "--merge (the merged model)")
    base_hf, base_ckpt = _lora_base(args.base, lora["base"])
    hf_config = checkpoint_hf_config(args.ckpt_dir)
    _check_output(args.output_dir, args.overwrite, args.ckpt_dir)
    _check_split(hf_config, args, Path(args.ckpt_dir) / HF_SUBDIR)
    if args.lora and args.self_check and importlib.util.find_spec("peft") is None:
        raise ModelError("the --lora self-check loads the adapter with peft, which is not installed: "
                         "pip install 'megatron-grpo[lora]' or pass --no-self-check")
    out_dtype = DTYPES.get(args.dtype) or (torch.float32 if args.lora else config_dtype(hf_config))
    _initialize(args.tp, args.pp, args.ep)
    say = _printer()

    t0 = time.perf_counter()
    chunks = build_model(hf_config, dtype=torch.float32, init_weights=False)
    _fill_nan(chunks)
    if base_ckpt is not None:
        load_megatron_checkpoint(chunks, base_ckpt)
    else:
        load_hf_weights(chunks, base_hf, hf_config)
    spec = spec_from_metadata(lora)
    apply_lora(chunks, spec, base=lora["base"])
    load_lora_adapters(chunks, args.ckpt_dir)
    if args.lora:
        written = save_peft_adapter(chunks, hf_config, args.output_dir, spec=spec,
                                    base_model_name_or_path=str(base_hf), dtype=out_dtype)
        say(f"wrote the peft adapter {args.output_dir} (r={spec.rank}, lora_alpha={spec.alpha:g}, "
            f"{', '.join(spec.hf_target_modules())}; {written / 1e6:.2f} MB) in {time.perf_counter() - t0:.1f}s")
    else:
        written = save_hf_checkpoint(chunks, hf_config, args.output_dir, sidecar_dir=Path(args.ckpt_dir) / HF_SUBDIR,
                                     dtype=out_dtype, max_shard_bytes=int(args.max_shard_size_gb * 1024**3),
                                     progress=_is_rank0())
        say(f"wrote the merged model {args.output_dir} ({written / 1e6:.1f} MB of {out_dtype} weights) "
            f"in {time.perf_counter() - t0:.1f}s")
    if not args.self_check:
        return 0
    if args.lora:
        round_params_([p for _, a in iter_adapters(chunks) for p in a.parameters()], out_dtype)
        result = run_self_check(chunks, hf_config, base_hf, args.tolerance, adapter_dir=args.output_dir)
    else:
        _fold_adapters_(chunks, out_dtype)
        result = run_self_check(chunks, hf_config, args.output_dir, args.tolerance)
    say(result.line())
    return 0 if result.ok else 1


@torch.no_grad()
def _fold_adapters_(chunks: list, dtype: torch.dtype) -> None:
    """Make the chunks hold what ``--merge`` wrote: every adapted weight replaced by its merged
    value rounded to ``dtype``, the adapters zeroed (B = 0), every other weight rounded."""
    adapted = [p for c in chunks for p in c.parameters() if getattr(p, "lora_adapter", None) is not None]
    for param in adapted:
        param.copy_(param.lora_adapter.merged(param).to(dtype))
    round_params_([p for c in chunks for p in c.parameters()], dtype)
    for _, adapter in iter_adapters(chunks):
        adapter.lora_B.zero_()


def _lora_base(override: Path | None, recorded: dict) -> tuple[Path, Path | None]:
    """(HF directory of the base, its megatron-grpo checkpoint or None) of a LoRA export:
    ``--base`` if given, else the base recorded in the checkpoint; ModelError if missing."""
    if override is not None:
        if (override / "metadata.json").is_file():  # a megatron-grpo checkpoint: its hf/ has the config
            return override / HF_SUBDIR, override
        if not (override / "config.json").is_file():
            raise ModelError(f"--base {override}: neither an HF model directory nor a megatron-grpo checkpoint")
        return override, None
    ckpt = recorded.get("megatron_ckpt")
    hf_dir = Path(recorded.get("hf_dir") or "")
    if ckpt and not Path(ckpt).is_dir():
        raise ModelError(f"the LoRA base checkpoint {ckpt} (recorded at training) is gone: pass --base")
    if not (hf_dir / "config.json").is_file():
        raise ModelError(f"the LoRA base {hf_dir} (recorded at training) has no config.json: pass --base")
    return hf_dir, Path(ckpt) if ckpt else None


COMMANDS = {
    "convert-hf-to-megatron": (hf_to_megatron_parser, hf_to_megatron),
    "convert-megatron-to-hf": (megatron_to_hf_parser, megatron_to_hf),
}


def run_command(name: str, argv: list[str]) -> int:
    """Entry point of both sub-commands (``megatron_grpo.cli`` and tools/ call this)."""
    import torch.distributed as dist

    make_parser, run = COMMANDS[name]
    args = make_parser().parse_args(argv)
    quiet_library_warnings()
    started_here = not dist.is_initialized()
    try:
        return run(args)
    except ModelError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file that could not be read or written: its own line names it
        print(f"{name}: error: {one_line(e)}", file=sys.stderr)
        return 2
    finally:
        if started_here:
            parallel.destroy()


def _initialize(tp: int, pp: int, ep: int = 1) -> None:
    import torch.distributed as dist

    if tp < 1 or pp < 1 or ep < 1:
        raise ModelError(f"--tp/--pp/--ep must be >= 1, got --tp {tp} --pp {pp} --ep {ep}")
    launched = "WORLD_SIZE" in os.environ  # torchrun (or another launcher) set up the ranks
    if not launched and not dist.is_initialized():
        # One process: a MASTER_PORT inherited from the shell or an earlier run in this
        # process may be taken; let parallel.initialize pick a free port.
        os.environ.pop("MASTER_PORT", None)
    try:
        parallel.initialize(tp, pp, ep=ep)
    except ValueError as e:
        raise ModelError(f"{e}: run under torchrun --nproc-per-node {tp * pp * ep} "
                         f"for --tp {tp} --pp {pp} --ep {ep}") from None


def _check_output(out: Path, overwrite: bool, source: Path) -> None:
    """Refuse an output that is, holds, or lies inside the input: replacing it (``--overwrite``)
    would delete the input, or the new checkpoint would be written into the one being read."""
    out_r, src_r = out.resolve(), source.resolve()
    if out_r == src_r:
        raise ModelError(f"--output-dir {out} is the input directory")
    if out_r in src_r.parents:
        raise ModelError(f"--output-dir {out} contains the input directory {source}; choose another directory")
    if src_r in out_r.parents:
        raise ModelError(f"--output-dir {out} is inside the input directory {source}; choose another directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ModelError(f"--output-dir {out} exists and is not empty (pass --overwrite to replace it)")
    _check_writable(out)


def _check_writable(out: Path) -> None:
    """Refuse an output folder that cannot be written, before the model is built: an export
    writes a sibling temp folder and renames it, and a read-only parent failed there, after the
    work, with an ``OSError`` traceback (issue 64)."""
    try:
        check_writable(out.parent)
    except OSError as e:
        raise ModelError(f"--output-dir {out}: cannot write there ({one_line(e)})") from None


def _check_split(hf_config, args, config_dir: Path) -> None:
    """Refuse --tp/--pp the model cannot be split at, in one line, before any rank builds it
    (megatron-core would fail on every rank with a long traceback)."""
    problem = split_problem(hf_config, args.tp, args.pp)
    if problem:
        flag, why = problem
        raise ModelError(f"--{flag} {why.replace('(config.json)', f'({config_dir}/config.json)')}")


@torch.no_grad()
def _fill_nan(chunks: list) -> None:
    for c in chunks:
        for p in c.parameters():
            p.fill_(float("nan"))


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _printer():
    rank0 = _is_rank0()
    return (lambda msg: print(msg, flush=True)) if rank0 else (lambda msg: None)

