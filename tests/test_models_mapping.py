"""Tensor layouts, vocab padding, config reading and the architecture registry: pure
functions, checked against layouts and numbers written out by hand."""

import json

import pytest
import torch
import torch.nn.functional as F

from megatron_grpo.models import ARCHITECTURES, ModelError, get_architecture, load_hf_config, padded_vocab_size
from megatron_grpo.models.layouts import FusedQKV, GatedFC1, Replicated, TPSplit, VocabSplit
from tools.tiny import save_tiny_model, tiny_config


def rows(*values):
    """A [len, 1] weight whose rows are the given numbers (a row = one output feature)."""
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)


def test_fused_qkv_groups_queries_with_their_kv_head_and_splits_groups_over_tp():
    # 4 query heads, 2 kv groups, head_dim 1: q = 10..13, k = 20, 21, v = 30, 31.
    q, k, v = rows(10, 11, 12, 13), rows(20, 21), rows(30, 31)
    layout = FusedQKV(num_heads=4, num_query_groups=2, head_dim=1)
    full = layout.to_shard([q, k, v], tp_rank=0, tp=1)
    assert full.squeeze(1).tolist() == [10, 11, 20, 30, 12, 13, 21, 31]  # [q0 q1 k0 v0 | q2 q3 k1 v1]
    shards = [layout.to_shard([q, k, v], r, 2) for r in range(2)]
    assert shards[0].squeeze(1).tolist() == [10, 11, 20, 30]
    assert shards[1].squeeze(1).tolist() == [12, 13, 21, 31]
    back = layout.from_shards(shards)
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v]))
    # biases ([rows]) use the same interleaving
    bias = layout.to_shard([q.squeeze(1), k.squeeze(1), v.squeeze(1)], 1, 2)
    assert bias.tolist() == [12, 13, 21, 31]


def test_fused_qkv_with_head_dim_2_keeps_head_rows_together():
    # 2 query heads, 1 kv group, head_dim 2
    q, k, v = rows(1, 2, 3, 4), rows(5, 6), rows(7, 8)
    full = FusedQKV(num_heads=2, num_query_groups=1, head_dim=2).to_shard([q, k, v], 0, 1)
    assert full.squeeze(1).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    out = FusedQKV(2, 1, 2).from_shards([full])
    assert [t.squeeze(1).tolist() for t in out] == [[1, 2, 3, 4], [5, 6], [7, 8]]
    assert len({t.untyped_storage().data_ptr() for t in out}) == 3  # safetensors needs own storage


def test_gated_fc1_is_gate_then_up_within_each_tp_shard():
    gate, up = rows(1, 2, 3, 4), rows(5, 6, 7, 8)
    layout = GatedFC1()
    assert layout.to_shard([gate, up], 0, 1).squeeze(1).tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    shards = [layout.to_shard([gate, up], r, 2) for r in range(2)]
    assert [s.squeeze(1).tolist() for s in shards] == [[1, 2, 5, 6], [3, 4, 7, 8]]
    g2, u2 = layout.from_shards(shards)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_gated_fc1_matches_megatron_swiglu_halves():
    # megatron's gated MLP computes silu(first half) * second half of linear_fc1's output
    h = torch.randn(3, 4)
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    fc1 = GatedFC1().to_shard([gate, up], 0, 1)
    a, b = torch.chunk(h @ fc1.T, 2, dim=-1)
    torch.testing.assert_close(F.silu(a) * b, F.silu(h @ gate.T) * (h @ up.T))


def test_vocab_split_pads_with_zero_rows_and_drops_them_back():
    emb = rows(1, 2, 3, 4, 5)
    layout = VocabSplit(vocab_size=5, padded_vocab_size=8)
    shards = [layout.to_shard([emb], r, 2) for r in range(2)]
    assert [s.squeeze(1).tolist() for s in shards] == [[1, 2, 3, 4], [5, 0, 0, 0]]
    (back,) = layout.from_shards(shards)
    assert torch.equal(back, emb)
    with pytest.raises(ValueError, match="expected 5 vocabulary rows"):
        layout.to_shard([rows(1, 2)], 0, 2)


def test_tp_split_row_and_column_parallel():
    w = torch.arange(12.0).reshape(3, 4)
    assert TPSplit(dim=1).to_shard([w], 1, 2).tolist() == [[2, 3], [6, 7], [10, 11]]
    assert torch.equal(TPSplit(dim=1).from_shards([TPSplit(1).to_shard([w], r, 2) for r in range(2)])[0], w)
    norm = torch.ones(3)
    assert Replicated().replicated and not TPSplit(0).replicated
    assert torch.equal(Replicated().from_shards([norm, norm])[0], norm)


def test_padded_vocab_size_by_hand():
    assert padded_vocab_size(255, 1) == 256
    assert padded_vocab_size(256, 1) == 256
    assert padded_vocab_size(257, 1) == 384
    assert padded_vocab_size(255, 4) == 512  # multiple of 128 * 4
    assert padded_vocab_size(151936, 1) == 151936  # Qwen2.5: 1187 * 128
    assert padded_vocab_size(151936, 2) == 152064  # 594 * 256
    assert padded_vocab_size(255, 2, divisor=1) == 256


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_transformer_config_fields_come_from_config_json(model_type):
    cfg = tiny_config(model_type, tie_word_embeddings=True, hidden_size=64, num_heads=4, num_kv_heads=2,
                      intermediate_size=96)
    arch = get_architecture(model_type)
    kw = arch.transformer_config_kwargs(cfg)
    assert (kw["num_layers"], kw["hidden_size"], kw["ffn_hidden_size"]) == (2, 64, 96)
    assert (kw["num_attention_heads"], kw["num_query_groups"], kw["kv_channels"]) == (4, 2, 16)
    assert kw["normalization"] == "RMSNorm" and kw["layernorm_epsilon"] == 1e-6
    assert kw["gated_linear_unit"] and kw["activation_func"] is F.silu and not kw["add_bias_linear"]
    assert kw["attention_dropout"] == kw["hidden_dropout"] == 0.0
    assert kw["add_qkv_bias"] == (model_type == "qwen2")
    assert kw["qk_layernorm"] == (model_type in ("qwen3", "qwen3_moe"))
    assert (kw.get("num_moe_experts"), kw.get("moe_router_topk")) == ((4, 2) if model_type in ("qwen3_moe", "mixtral") else (None, None))
    gpt = arch.gpt_model_kwargs(cfg)
    assert gpt["share_embeddings_and_output_weights"] is True
    assert gpt["rotary_base"] == 10000.0 and gpt["position_embedding_type"] == "rope"


def test_qwen3_explicit_head_dim_differs_from_hidden_over_heads():
    cfg = tiny_config("qwen3")
    cfg.head_dim = 24
    assert get_architecture("qwen3").transformer_config_kwargs(cfg)["kv_channels"] == 24


def test_llama3_rope_scaling_maps_to_megatron_and_other_variants_are_rejected():
    cfg = tiny_config("llama")
    cfg.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}
    kw = get_architecture("llama").gpt_model_kwargs(cfg)
    assert (kw["rotary_base"], kw["rope_scaling"], kw["rope_scaling_factor"]) == (500000.0, True, 32.0)
    cfg.rope_parameters = dict(cfg.rope_parameters, high_freq_factor=2.0)
    with pytest.raises(ModelError, match="rope_type='llama3' is not supported"):
        get_architecture("llama").gpt_model_kwargs(cfg)
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ModelError, match=r"llama: config.json rope_parameters.rope_type='yarn'"):
        get_architecture("llama").gpt_model_kwargs(cfg)


@pytest.mark.parametrize("model_type,key,value", [
    ("llama", "hidden_act", "gelu"),
    ("llama", "attention_bias", True),
    ("llama", "mlp_bias", True),
    ("qwen3", "attention_bias", True),
    ("qwen2", "use_sliding_window", True),
])
def test_unsupported_features_are_one_line_errors_naming_the_key(model_type, key, value):
    cfg = tiny_config(model_type)
    setattr(cfg, key, value)
    with pytest.raises(ModelError) as e:
        get_architecture(model_type).transformer_config_kwargs(cfg)
    assert key in str(e.value) and "\n" not in str(e.value)


def test_load_hf_config_errors(tmp_path):
    with pytest.raises(ModelError, match="Hugging Face model directory not found"):
        load_hf_config(tmp_path / "nope")
    with pytest.raises(ModelError, match=r"config.json: not found"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n "hidden_size": }')
    with pytest.raises(ModelError, match=r"config.json:2: invalid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelError, match=r"config.json: expected a JSON object, got list"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelError) as e:
        load_hf_config(tmp_path)
    assert str(e.value).endswith("model_type 'gpt2' is not supported (supported: llama, mixtral, qwen2, qwen3, qwen3_moe)")


def test_load_hf_config_reads_a_saved_tiny_model(tmp_path):
    cfg = load_hf_config(save_tiny_model(tmp_path / "m", "qwen3", tie_word_embeddings=True))
    assert cfg.model_type == "qwen3" and cfg.tie_word_embeddings and cfg.vocab_size == 255
