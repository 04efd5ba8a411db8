"""A GGUF file (llama.cpp's format) as an ordinary Hugging Face model directory in float32.

transformers reads GGUF itself (``from_pretrained(dir, gguf_file=name)``): it dequantizes every
tensor with the ``gguf`` package and undoes llama.cpp's q/k row permutation (llama.cpp rotates
adjacent pairs, HF the two halves of each head). What it keeps is the quantization marker:
``config.quantization_config`` and ``model.hf_quantizer`` still say "gguf" although the weights
are plain float32 now, so ``save_pretrained`` refuses to save, or writes a config.json that
sends the next loader looking for a GGUF file. ``gguf_to_hf`` drops the marker and writes
config.json, model.safetensors, the tokenizer (its chat template inside tokenizer_config.json,
which older transformers versions read and chat_template.jinja they do not) and
generation_config.json.

The values are the GGUF's dequantized ones: a model quantized to 4 bits stays as degraded as it
was; only its storage is full precision.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_grpo.models.architectures import get_architecture
from megatron_grpo.models.errors import ModelError

# Attributes transformers sets on a model loaded from a quantized checkpoint (5.x names).
_QUANTIZER_ATTRS = {"hf_quantizer": None, "is_quantized": False, "quantization_method": None}


def load_gguf(gguf_path: Path):
    """``(model, tokenizer)`` of ``gguf_path``: the model dequantized to float32, its
    quantization marker dropped. ModelError (one line) for a file transformers cannot read."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except ImportError as e:  # transformers' GGUF loader needs the gguf package and accelerate
        raise ModelError(f"{gguf_path}: reading GGUF needs gguf and accelerate: pip install 'megatron-grpo[gguf]' "
                         f"({str(e).splitlines()[0]})") from None
    except (ValueError, KeyError, OSError) as e:  # unknown architecture, tokenizer or file
        raise ModelError(f"{gguf_path}: transformers cannot read it as GGUF ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    drop_quantization_marker(model)
    return model, tokenizer


def drop_quantization_marker(model) -> None:
    """Make a dequantized model an ordinary one: no ``quantization_config`` in its config, no
    quantizer on the model (what ``save_pretrained`` checks)."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for name, plain in _QUANTIZER_ATTRS.items():
        if name in vars(model):
            setattr(model, name, plain)


def set_eos_token(model, tokenizer, eos_token: str) -> int:
    """Make ``eos_token`` the end of generation everywhere it is read (tokenizer, config,
    generation config); returns its id. ModelError if the vocabulary lacks it."""
    eos_id = tokenizer.convert_tokens_to_ids(eos_token)
    if eos_id is None or eos_id == tokenizer.unk_token_id:
        raise ModelError(f"eos token {eos_token!r} is not in the GGUF's vocabulary")
    tokenizer.eos_token = eos_token
    model.config.eos_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    return eos_id


def check_written_config(out_dir: Path) -> None:
    """The written config.json is an ordinary float32 one (an internal invariant)."""
    raw = json.loads((out_dir / "config.json").read_text())
    assert "quantization_config" not in raw, f"{out_dir}/config.json kept the GGUF quantization marker"
    assert raw.get("dtype", raw.get("torch_dtype")) == "float32", raw.get("dtype")


def gguf_to_hf(gguf_path: str | Path, out_dir: str | Path, *, eos_token: str | None = None) -> Path:
    """Write ``gguf_path`` as a float32 Hugging Face directory into ``out_dir`` (created; files
    in it are overwritten). ``eos_token``: the token that ends a turn (e.g. ChatML's
    ``<|im_end|>``) when the GGUF's own eos is not it. ModelError (one line) for a GGUF that
    transformers cannot read or whose architecture this package does not train."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    model, tokenizer = load_gguf(gguf_path)
    get_architecture(model.config.model_type, where=str(gguf_path))
    if eos_token is not None:
        set_eos_token(model, tokenizer, eos_token)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    # the template inside tokenizer_config.json, not in chat_template.jinja: older readers
    # (transformers < 4.43) know only the former
    tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)
    check_written_config(out_dir)
    return out_dir
