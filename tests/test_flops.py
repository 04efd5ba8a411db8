"""Parameter counts and model FLOPs (``tools/bench/flops.py``) and the sized models built from
``tools/bench/model_shapes/`` (``tools/bench/make_sized_model.py``).

* the shipped shapes' parameter counts equal the published totals (Qwen2.5-0.5B: 0.49B, 0.36B
  without embeddings; Qwen2.5-1.5B: 1.54B, 1.31B) and transformers' own count of the same
  config (instantiated on the meta device: no memory);
* ``count_parameters`` equals a real instantiated tiny model's ``numel`` for every
  architecture (dense, tied and untied, q/k norm, MoE);
* the FLOPs of a tiny config equal a hand count written out term by term, and at short
  sequences a training token costs ~6N (N: the parameters a token's matmuls touch);
* a shrunk sized model loads in the Megatron converter and matches transformers' logits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.bench.flops import (
    ModelShape,
    count_parameters,
    forward_flops,
    forward_flops_per_token,
    mfu,
    peak_bf16_flops,
    train_flops,
)

ROOT = Path(__file__).resolve().parent.parent
SHAPES = ROOT / "tools" / "bench" / "model_shapes"


def _shape(name: str) -> ModelShape:
    return ModelShape.from_hf_config(json.loads((SHAPES / f"{name}.json").read_text()))


@pytest.mark.parametrize("name, total, non_embedding", [
    ("qwen2.5-0.5b", 0.49e9, 0.36e9),  # the Qwen2.5 model cards' figures
    ("qwen2.5-1.5b", 1.54e9, 1.31e9),
])
def test_qwen25_shapes_have_the_published_parameter_counts(name, total, non_embedding):
    counts = count_parameters(_shape(name))
    assert round(counts.total / 1e9, 2) == total / 1e9
    assert round(counts.non_embedding / 1e9, 2) == non_embedding / 1e9
    assert counts.active == counts.total  # dense


def test_the_moe_shape_is_about_1b_with_a_fraction_active():
    counts = count_parameters(_shape("qwen3-moe-1b-a0.5b"))
    assert counts.total == 999_592_960 and counts.active == 471_110_656  # docs/gpu.md's table
    assert counts.active - counts.embedding == 159_945_728  # 4 of 32 experts


@pytest.mark.parametrize("name", sorted(p.stem for p in SHAPES.glob("*.json")))
def test_shipped_shapes_count_like_transformers(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads((SHAPES / f"{name}.json").read_text()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert count_parameters(ModelShape.from_hf_config(config)).total == model.num_parameters()


@pytest.mark.parametrize("model_type, tied", [("qwen2", True), ("qwen2", False), ("llama", False),
                                              ("qwen3", False), ("qwen3_moe", False), ("mixtral", True)])
def test_parameter_count_equals_an_instantiated_models_numel(model_type, tied):
    from transformers import AutoModelForCausalLM

    from tools.tiny import tiny_config

    config = tiny_config(model_type, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    numel = sum(p.numel() for p in model.parameters())  # tied weights once
    assert count_parameters(ModelShape.from_hf_config(config)).total == numel


def test_flops_of_a_tiny_dense_config_by_hand():
    # h 8, 2 layers, 2 heads of 4 (q 8), 1 kv head (kv 4), MLP 16, vocab 32, sequence of 5
    s = ModelShape(hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                   intermediate_size=16, vocab_size=32, tie_word_embeddings=True, qkv_bias=True)
    q_proj, k_proj, v_proj, o_proj = 2 * 8 * 8, 2 * 8 * 4, 2 * 8 * 4, 2 * 8 * 8  # 128 + 64 + 64 + 128
    qk_t, a_v = 2 * 8 * 5, 2 * 8 * 5  # per token: its row of the full 5 x 5 matrices, all heads
    gate, up, down = 2 * 8 * 16, 2 * 8 * 16, 2 * 16 * 8  # 256 each
    lm_head = 2 * 8 * 32
    per_token = 2 * (q_proj + k_proj + v_proj + o_proj + qk_t + a_v + gate + up + down) + lm_head
    assert per_token == 2 * (384 + 160 + 768) + 512 == 3136
    assert forward_flops_per_token(s, 5) == per_token
    assert forward_flops(s, [5]) == 5 * per_token
    assert train_flops(s, [5, 5]) == 3 * 2 * 5 * per_token


def test_flops_of_a_tiny_moe_config_by_hand():
    # as above with 4 experts of width 6, 2 per token
    s = ModelShape(hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                   intermediate_size=16, vocab_size=32, tie_word_embeddings=False, qk_norm=True,
                   num_experts=4, experts_per_token=2, moe_intermediate_size=6)
    attention = (128 + 64 + 64 + 128) + 2 * 2 * 8 * 5
    router = 2 * 8 * 4
    experts = 2 * (3 * 2 * 8 * 6)  # only the 2 routed experts' gate, up and down
    assert forward_flops_per_token(s, 5) == 2 * (attention + router + experts) + 2 * 8 * 32


@pytest.mark.parametrize("name", sorted(p.stem for p in SHAPES.glob("*.json")))
def test_training_flops_follow_the_6n_rule_at_short_sequences(name):
    """6N per token (Kaplan et al.), N = the parameters whose matmuls a token runs: the active
    ones without the input embedding (a lookup), the LM head in (tied or not). The rest is
    norms and biases (<0.1%); the attention term grows with the sequence."""
    s = _shape(name)
    counts = count_parameters(s)
    n = counts.active - s.vocab_size * s.hidden_size + (s.vocab_size * s.hidden_size if s.tie_word_embeddings else 0)
    assert 3 * forward_flops_per_token(s, 1) == pytest.approx(6 * n, rel=1e-3)
    # at 2k tokens the attention term adds 12 * L * q_dim * s over 6N (PaLM's 6N + 12LHQT)
    extra = 3 * forward_flops_per_token(s, 2048) - 3 * forward_flops_per_token(s, 1)
    assert extra == 12 * s.num_layers * s.q_dim * 2047


def test_mfu_uses_the_specified_peak_of_known_gpus_only():
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("NVIDIA GeForce RTX 4090") is None
    assert mfu(989e12 * 0.4, 1.0, "NVIDIA H200") == pytest.approx(0.4)
    assert mfu(1e12, 1.0, "cpu") is None


def _convert_and_compare(rank, world, hf_dir):
    from megatron_grpo.models import build_model, load_hf_config, load_hf_weights
    from megatron_grpo.models.self_check import run_self_check

    cfg = load_hf_config(hf_dir)
    chunks = build_model(cfg, init_weights=False)
    load_hf_weights(chunks, hf_dir, cfg)
    result = run_self_check(chunks, cfg, hf_dir)
    return result.ok, result.max_abs_diff


@pytest.mark.slow
def test_a_shrunk_sized_model_loads_in_the_converter(tmp_path):
    from transformers import AutoTokenizer

    from tests.support.distributed import run_distributed

    out = tmp_path / "q05"
    subprocess.run([sys.executable, "-m", "tools.bench.make_sized_model", "--shape", "qwen2.5-0.5b",
                    "--out", str(out), "--dtype", "fp32", "--set", "num_hidden_layers=2", "hidden_size=64",
                    "intermediate_size=128", "num_attention_heads=4", "num_key_value_heads=2"],
                   check=True, capture_output=True, cwd=ROOT)
    info = json.loads((out / "sized_model.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 151936 and config["tie_word_embeddings"] and config["rope_parameters"]["rope_theta"] == 1e6
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == info["tokenizer_size"] == 151665
    assert config["eos_token_id"] == tokenizer.eos_token_id
    (ok, diff), = run_distributed(_convert_and_compare, 1, str(out), tp=1, pp=1, timeout_s=300)
    assert ok, diff
