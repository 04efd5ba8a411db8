"""Build a randomly initialised model of a real model's shape, with a tokenizer of its
vocabulary's size, as a Hugging Face directory (no downloads).

    python -m tools.bench.make_sized_model --shape qwen2.5-0.5b --out runs/sized/qwen2.5-0.5b [--dtype bf16]
    python -m tools.bench.make_sized_model --shape qwen2.5-0.5b --out /tmp/m --set num_hidden_layers=2 hidden_size=64

The shapes are the config.json files in ``tools/bench/model_shapes/`` (``--shape`` names one):

* ``qwen2.5-0.5b`` and ``qwen2.5-1.5b``: the published Qwen2.5 configs' sizes (qkv bias, tied
  embeddings, vocab 151936, rope_theta 1e6, RMSNorm eps 1e-6);
* ``qwen3-moe-1b-a0.5b``: a small Qwen3-MoE (q/k norm, 32 experts, 4 per token, untied).

Parameter counts (``tools.bench.flops.count_parameters``, equal to the HF model's
``num_parameters()``) are printed and written to ``OUT/sized_model.json``. Only time and
memory are meaningful with random weights: the model's outputs are noise.

The tokenizer is the test suite's word-level one (``testing.tiny_models.build_tokenizer``,
its chat template included) padded with filler tokens to Qwen2.5's 151665, so the embedding
and the LM head have their real sizes and the engine's and trainer's vocabularies match; the
config's bos/eos/pad ids are set to that tokenizer's. ``--set key=value ...`` changes config
fields (a shrunk model for tests and smoke runs: layers, widths, vocab); a vocabulary smaller
than the tokenizer shrinks the tokenizer to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from tools.bench.flops import ModelShape, count_parameters
from tools.bench.common import ROOT

SHAPES_DIR = ROOT / "tools" / "bench" / "model_shapes"
SHAPES = sorted(p.stem for p in SHAPES_DIR.glob("*.json"))
TOKENIZER_SIZE = 151665  # Qwen2.5's tokenizer: 151643 regular tokens + 22 special ones
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def shape_config(shape: str, overrides: dict | None = None) -> dict:
    """The config.json mapping of ``shape`` with ``overrides`` applied."""
    config = json.loads((SHAPES_DIR / f"{shape}.json").read_text())
    config.update(overrides or {})
    if "max_window_layers" in config:
        config["max_window_layers"] = config["num_hidden_layers"]
    return config


def parse_sets(items: list[str]) -> dict:
    """``["num_hidden_layers=2", ...]`` -> {"num_hidden_layers": 2, ...} (values parsed as JSON)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected key=value, e.g. num_hidden_layers=2")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def build(shape: str, out: Path, dtype: str = "bf16", overrides: dict | None = None, seed: int = 0) -> dict:
    """Write the model and tokenizer to ``out``; returns the parameter counts written beside them."""
    # imported here, not at the top: --help answers without loading torch and transformers
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tools.tiny import build_tokenizer

    raw = shape_config(shape, overrides)
    tokenizer = build_tokenizer(min(TOKENIZER_SIZE, raw["vocab_size"]))
    raw.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id, torch_dtype=DTYPES[dtype])
    config = AutoConfig.for_model(**raw)
    torch.manual_seed(seed)
    # random initialisation took over a minute per 300M parameters on 2 loaded CPU cores: on the
    # GPU where there is one
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, DTYPES[dtype]))
    counts = count_parameters(ModelShape.from_hf_config(config))
    assert model.num_parameters() == counts.total, (model.num_parameters(), counts)
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    info = {"shape": shape, "overrides": overrides or {}, "dtype": dtype, "seed": seed,
            "parameters": counts.total, "non_embedding_parameters": counts.non_embedding,
            "active_parameters": counts.active, "tokenizer_size": len(tokenizer)}
    (tmp / "sized_model.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", required=True, choices=SHAPES, help="a config in tools/bench/model_shapes/")
    parser.add_argument("--out", required=True, help="HF model directory to write (replaced if present)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the saved weights")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config.json fields to change (tests and smoke runs: a shrunk model)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        overrides = parse_sets(args.set)
    except ValueError as e:
        parser.error(str(e))
    info = build(args.shape, Path(args.out), args.dtype, overrides, args.seed)
    print(f"wrote {args.out}: {args.shape}{' ' + json.dumps(overrides) if overrides else ''}, "
          f"{info['parameters'] / 1e6:.1f}M parameters ({info['non_embedding_parameters'] / 1e6:.1f}M non-embedding, "
          f"{info['active_parameters'] / 1e6:.1f}M active per token), tokenizer of {info['tokenizer_size']} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
