"""The local spec's SDPA core attention (``models.attention``) computes what megatron-core's
unfused attention and the HF reference compute: logits and gradients at TP1 (in-process),
TP2 and PP2 (gloo ranks), for a grouped-query model with QKV bias (qwen2) and one with
q/k layernorm and an explicit head_dim (qwen3). Every tiny model has 4 heads over 2 key/value
groups, so TP2 still runs grouped-query attention on each rank.

Reference: HF's fp32 logits (max |Δ| <= 1e-5, as tests/test_models_equivalence.py); sdpa vs
unfused gradients of one loss on the per-token log-probs (max |Δ| <= 1e-5 relative to the
gradient's scale).

Packed sequences (``models.packing``, ``parallel.pack_sequences``): packed vs unpacked logits,
log-probs and gradients with the same tolerances at TP1, TP2 and PP2, for rows of 1 to 12
tokens, and for a micro-batch whose rows share prompts (``parallel.share_prefix``: three rows
run one prompt once, two of them share their first response token too, a fourth row has its
own prompt, two identical rows share everything); and the refusals (unfused attention, MoE models) at build time and in preflight.
"""

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.models_fixtures import PROBE_IDS, hf_reference_logits, make_hf_model

TOL = 1e-5
MODELS = ("qwen2", "qwen3")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """model_type -> (hf_dir, HF reference logits [B, S, V] of PROBE_IDS)."""
    root = tmp_path_factory.mktemp("attn_models")
    out = {}
    for seed, model_type in enumerate(MODELS):
        path = make_hf_model(root / model_type, model_type, tied=False, seed=seed)
        out[model_type] = (str(path), hf_reference_logits(path))
    return out




# ---- work done on every rank --------------------------------------------------------------
def loss_weights(shape) -> torch.Tensor:
    """Fixed per-token weights [B, S - 1] of the test loss (the same on every rank)."""
    shape = (shape[0], shape[1] - 1)
    return torch.randn(shape, generator=torch.Generator().manual_seed(7))


def logits_and_grads(chunks, items, step, variable_seq_lengths=False):
    """One forward-backward through ``run_schedule`` (the trainer's path) of the micro-batches
    ``items`` with the forward step ``step``. Returns (the loss functions' outputs on the last
    stage's TP rank 0, else None; {parameter name: gradient} of this rank)."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.models.forward import run_schedule

    for c in chunks:
        c.zero_grad()
    outs = run_schedule(chunks, items, step, forward_only=False, num_microbatches=len(items),
                        seq_length=items[0][0].shape[1], micro_batch_size=items[0][0].shape[0],
                        variable_seq_lengths=variable_seq_lengths)
    held = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    grads = {f"{i}.{n}": p.grad.clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}
    return (outs if held else None), grads


def unpacked_step(vocab_size):
    """Forward step of items (tokens [B, S], lengths, weights [B, S - 1]); loss
    sum(weights * log p(token t+1 | ..t)) over each row's first length - 1 positions."""
    from megatron_grpo.models.forward import causal_logits, gather_vocab
    from megatron_grpo.ops import vocab_parallel_log_probs

    def step(data_iterator, model):
        tokens, lengths, weights, _ = next(data_iterator)

        def loss_func(output):
            logits = gather_vocab(output.detach(), vocab_size)
            lp, _ = vocab_parallel_log_probs(output[:, :-1], tokens[:, 1:], vocab_size=vocab_size,
                                             with_entropy=False)
            valid = torch.arange(tokens.shape[1] - 1) < torch.tensor(lengths).unsqueeze(1) - 1
            return (lp * weights * valid).sum(), {"logits": logits, "log_probs": lp * valid}

        return causal_logits(model, tokens), loss_func

    return step


def _backends_worker(rank, world_size, hf_dirs):
    """Per model: (sdpa logits, unfused logits, max |Δgrad| / max |grad|) of this rank."""
    from megatron_grpo.models import build_model, load_hf_config, load_hf_weights

    items = [(PROBE_IDS, [PROBE_IDS.shape[1]] * PROBE_IDS.shape[0], loss_weights(PROBE_IDS.shape), None)]
    out = {}
    for model_type, hf_dir in hf_dirs.items():
        cfg = load_hf_config(hf_dir)
        runs = {}
        for backend in ("sdpa", "unfused"):
            chunks = build_model(cfg, init_weights=False, attention_backend=backend)
            load_hf_weights(chunks, hf_dir, cfg)
            runs[backend] = logits_and_grads(chunks, items, unpacked_step(cfg.vocab_size))
        (sdpa_outs, sdpa_grads), (unfused_outs, unfused_grads) = runs["sdpa"], runs["unfused"]
        logits = [None if o is None else o[0]["logits"] for o in (sdpa_outs, unfused_outs)]
        out[model_type] = (*logits, relative_grad_delta(sdpa_grads, unfused_grads))
    return out


def relative_grad_delta(a: dict, b: dict) -> float:
    """max over parameters of max |a - b| / max |b| (every parameter must get a gradient)."""
    assert a.keys() == b.keys()
    worst = 0.0
    for name, g in b.items():
        scale = g.abs().max().item()
        assert scale > 0, f"{name}: no gradient"
        worst = max(worst, (a[name] - g).abs().max().item() / scale)
    return worst


def assert_backends_agree(per_rank, hf_models):
    for model_type in MODELS:
        ref = hf_models[model_type][1]
        held = [r[model_type] for r in per_rank if r[model_type][0] is not None]
        assert len(held) == 1
        sdpa, unfused, _ = held[0]
        assert (sdpa - ref).abs().max().item() <= TOL, model_type
        assert (unfused - ref).abs().max().item() <= TOL, model_type
        for r in per_rank:
            assert r[model_type][2] <= TOL, f"{model_type}: sdpa vs unfused gradients differ by {r[model_type][2]}"


# ---- tests -------------------------------------------------------------------------------
def test_backend_choice_and_refusals(hf_models, single_rank):
    from megatron_grpo.models import build_model, load_hf_config
    from megatron_grpo.models.attention import SDPAttention
    from megatron_grpo.models.builder import resolve_attention_backend
    from megatron_grpo.models.errors import ModelError

    assert resolve_attention_backend("auto") == "sdpa"  # no TransformerEngine on CPU
    cfg = load_hf_config(hf_models["qwen2"][0])
    for backend, cls in (("auto", "SDPAttention"), ("sdpa", "SDPAttention"), ("unfused", "DotProductAttention")):
        chunk = build_model(cfg, attention_backend=backend)[0]
        assert type(chunk.decoder.layers[0].self_attention.core_attention).__name__ == cls
    with pytest.raises(ModelError, match="auto, sdpa or unfused"):
        resolve_attention_backend("flash")
    config = chunk.config
    config.attention_dropout = 0.1
    with pytest.raises(ValueError, match="attention_dropout 0"):
        SDPAttention(config, 1, None, "self")


def test_tp1_sdpa_matches_unfused_and_hf(hf_models, single_rank):
    assert_backends_agree([_backends_worker(0, 1, {m: hf_models[m][0] for m in MODELS})], hf_models)


# ---- packed sequences (models.packing) ------------------------------------------------------
# rows of very different lengths, one of length 1 (it scores nothing), two micro-batches whose
# packed rows differ in length (13 and 7 tokens: pipeline stages exchange shapes), and a third
# whose rows share prompts (prompt lengths given: the shared-prefix layout)
BATCH = torch.cat([PROBE_IDS, PROBE_IDS.flip(1)])  # [4, 12]
LENGTHS = [12, 1, 5, 2]
MICRO_BATCHES = [(0, 1), (2, 3)]
_P, _R = PROBE_IDS[0, :5].tolist(), PROBE_IDS[1].tolist()
SHARED_ROWS = [_P + _R[:5], _P + _R[:1] + _R[6:9], PROBE_IDS[1, :4].tolist() + _R[:3], _P + _R[9:12],
               PROBE_IDS[0].tolist(), PROBE_IDS[0].tolist()]
# rows 0, 1, 3: one prompt (rows 0 and 1 share a response token too); rows 4 and 5: identical
# samples of another prompt, the micro-batch's longest rows, shared whole
SHARED_PROMPTS = [5, 5, 4, 5, 3, 3]
SHARED_LENGTHS = [len(r) for r in SHARED_ROWS]
SHARED_BATCH = torch.tensor([r + [0] * (12 - len(r)) for r in SHARED_ROWS])


def packing_items():
    weights = loss_weights(BATCH.shape)
    items = [(BATCH[list(rows)], [LENGTHS[r] for r in rows], weights[list(rows)], None) for rows in MICRO_BATCHES]
    return items + [(SHARED_BATCH, SHARED_LENGTHS, loss_weights(SHARED_BATCH.shape), SHARED_PROMPTS)]


def packed_step(vocab_size):
    """``unpacked_step``'s loss on the packed rows (a shared prefix where the item gives prompt
    lengths): log-probs of every (row, position) pair on the packed logits [1, T, V/tp]
    (``models.packing.pairs``), scattered back to [B, S - 1]; the logits are scattered to
    [B, S, V] through ``where`` for the comparison only."""
    from megatron_grpo.models.forward import gather_vocab, packed_logits
    from megatron_grpo.models.packing import pack, pairs, shared_prefix_groups
    from megatron_grpo.ops import vocab_parallel_log_probs

    def step(data_iterator, model):
        tokens, lengths, weights, prompts = next(data_iterator)
        groups = None if prompts is None else shared_prefix_groups(tokens, lengths, prompts)
        packed = pack(tokens, lengths, groups)
        assert any(packed.segment_shared) == (prompts is not None)

        def loss_func(output):
            logits_T = gather_vocab(output.detach(), vocab_size)[0]
            logits = logits_T.new_zeros((*tokens.shape, vocab_size))
            held = packed.where >= 0
            logits[held] = logits_T[packed.where[held]]
            p = pairs(packed)
            lp, _ = vocab_parallel_log_probs(output[:, p.index], tokens[p.rows, p.cols + 1].unsqueeze(0),
                                             vocab_size=vocab_size, with_entropy=False)
            lp = lp.new_zeros(tokens.shape[0], tokens.shape[1] - 1).index_put((p.rows, p.cols), lp[0])
            return (lp * weights).sum(), {"logits": logits, "log_probs": lp}

        return packed_logits(model, packed), loss_func

    return step


def _packing_worker(rank, world_size, hf_dir):
    """(unpacked outputs, packed outputs, max |Δgrad| / max |grad|) of this rank (sdpa)."""
    from megatron_grpo.models import build_model, load_hf_config, load_hf_weights

    cfg = load_hf_config(hf_dir)
    chunks = build_model(cfg, init_weights=False, attention_backend="sdpa")
    load_hf_weights(chunks, hf_dir, cfg)
    unpacked_outs, unpacked_grads = logits_and_grads(chunks, packing_items(), unpacked_step(cfg.vocab_size),
                                                     variable_seq_lengths=True)  # 2 rows, then 4
    packed_outs, packed_grads = logits_and_grads(chunks, packing_items(), packed_step(cfg.vocab_size),
                                                 variable_seq_lengths=True)
    return unpacked_outs, packed_outs, relative_grad_delta(packed_grads, unpacked_grads)


def assert_packing_exact(per_rank):
    held = [r for r in per_rank if r[0] is not None]
    assert len(held) == 1
    unpacked, packed, _ = held[0]
    row_lengths = [[LENGTHS[r] for r in rows] for rows in MICRO_BATCHES] + [SHARED_LENGTHS]
    assert len(unpacked) == len(packed) == len(row_lengths)
    for lengths, u, p in zip(row_lengths, unpacked, packed):
        for i, n in enumerate(lengths):
            assert (u["logits"][i, :n] - p["logits"][i, :n]).abs().max().item() <= TOL
            assert (u["log_probs"][i] - p["log_probs"][i]).abs().max().item() <= TOL
            assert not p["log_probs"][i, n - 1:].any()  # past the row: never filled
    for r in per_rank:
        assert r[2] <= TOL, f"packed vs unpacked gradients differ by {r[2]}"


def test_pack_layout():
    from megatron_grpo.models.packing import pack, pairs

    packed = pack(torch.tensor([[5, 6, 7], [8, 0, 0], [9, 4, 0]]), [3, 1, 2])
    assert packed.tokens.tolist() == [[5, 6, 7, 8, 9, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 6] and packed.max_seqlen == 3
    assert packed.branch.tolist() == [0] * 6 and not any(packed.segment_shared)
    assert packed.where.tolist() == [[0, 1, 2], [3, -1, -1], [4, 5, -1]]
    p = pairs(packed)
    assert (p.rows.tolist(), p.cols.tolist(), p.index.tolist()) == ([0, 0, 2], [0, 1, 0], [0, 1, 4])
    scored = pairs(packed, torch.tensor([[0, 1], [1, 1], [1, 0]]))  # masked, and never past a row
    assert (scored.rows.tolist(), scored.cols.tolist()) == ([0, 2], [1, 0])


def test_shared_prefix_layout():
    """Rows 0, 1 and 3 share the prompt [1, 2] and rows 0 and 1 also their next token; row 2
    has its own prompt: one segment [1, 2] + row 0's 3, 4 + row 1's 5 + row 3's 6, and row 2
    alone. Each row's tokens keep their own positions; the prefix's last index is read by the
    pairs of every row of its group."""
    from megatron_grpo.models.attention import branched_mask
    from megatron_grpo.models.packing import pack, pairs, shared_prefix_groups

    tokens = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5], [1, 9, 9, 0], [1, 2, 6, 0]])
    lengths = [4, 4, 3, 3]
    groups = shared_prefix_groups(tokens, lengths, [2, 2, 2, 2])
    assert groups == [((0, 1, 3), 2), ((2,), 0)]  # row 3 differs from rows 0, 1 at token 2
    assert shared_prefix_groups(tokens, lengths, [2, 2, 2, 0]) == [((0, 1), 3), ((2,), 0), ((3,), 0)]
    packed = pack(tokens, lengths, groups)
    assert packed.tokens.tolist() == [[1, 2, 3, 4, 3, 5, 6, 1, 9, 9]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 2, 0, 1, 2]]
    assert packed.branch.tolist() == [0, 0, 1, 1, 2, 2, 3, 0, 0, 0]
    assert packed.cu_seqlens.tolist() == [0, 7, 10] and packed.segment_shared == (True, False)
    assert packed.where.tolist() == [[0, 1, 2, 3], [0, 1, 4, 5], [7, 8, 9, -1], [0, 1, 6, -1]]
    # every row's token t is the packed token at where[b, t]
    for b, n in enumerate(lengths):
        assert packed.tokens[0, packed.where[b, :n]].tolist() == tokens[b, :n].tolist()
    p = pairs(packed)
    assert p.index.tolist().count(1) == 3  # the prompt's last token scores rows 0, 1 and 3
    # the mask: each packed token sees exactly its own row's earlier tokens
    mask = branched_mask(packed.cu_seqlens, packed.position_ids[0], packed.branch)
    for b, n in enumerate(lengths):
        for t in range(n):
            seen = set(mask[packed.where[b, t]].nonzero().flatten().tolist())
            assert seen == set(packed.where[b, : t + 1].tolist()), (b, t)
    # identical rows (a group whose samples all came out the same) share everything: no branches
    same = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    packed = pack(same, [3, 3, 3], shared_prefix_groups(same, [3, 3, 3], [1, 1, 1]))
    assert packed.tokens.tolist() == [[1, 2, 3]] and packed.where.tolist() == [[0, 1, 2]] * 3
    assert pairs(packed).index.tolist() == [0, 1] * 3


def test_packed_attention_paths_agree():
    """The CPU path (one call, block-diagonal mask) and the CUDA path (one causal call per
    row) compute the same, and equal each row's own causal attention; with a shared prefix the
    two paths (one [t, t] mask; a mask per shared segment) agree too."""
    import torch.nn.functional as F

    from megatron_grpo.models.attention import BranchedSeqParams, sdpa_packed

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(9, 4, 8, generator=g), torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    cu = torch.tensor([0, 1, 6, 9], dtype=torch.int32)
    masked, per_row = (sdpa_packed(q, k, v, cu, 0.3, per_row=flag) for flag in (False, True))
    assert (masked - per_row).abs().max().item() <= 1e-6
    for a, b in ((0, 1), (1, 6), (6, 9)):
        alone = F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True,
                                               scale=0.3, enable_gqa=True).transpose(0, 1)
        assert (per_row[a:b] - alone).abs().max().item() <= 1e-6
    # segment 1 = a prefix of 2 and two branches of 2 and 1; segment 2 a plain row
    params = BranchedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               position=torch.tensor([0, 0, 1, 2, 3, 2, 0, 1, 2]),
                               branch=torch.tensor([0, 0, 0, 1, 1, 2, 0, 0, 0]), segment_shared=(False, True, False))
    masked, per_row = (sdpa_packed(q, k, v, cu, 0.3, flag, params.masks(flag)) for flag in (False, True))
    assert (masked - per_row).abs().max().item() <= 1e-6
    rows = {"branch 1": [1, 2, 3, 4], "branch 2": [1, 2, 5]}  # each branch's row: the prefix, then its tokens
    for name, index in rows.items():
        alone = F.scaled_dot_product_attention(*(x[index].transpose(0, 1) for x in (q, k, v)), is_causal=True,
                                               scale=0.3, enable_gqa=True).transpose(0, 1)
        assert (masked[index] - alone).abs().max().item() <= 1e-6, name


def test_tp1_packed_matches_unpacked(hf_models, single_rank):
    assert_packing_exact([_packing_worker(0, 1, hf_models["qwen3"][0])])


def _layout_worker(rank, world_size, hf_dirs, packed_model):
    """Both checks in one set of ranks (a spawn costs seconds): the backends on every model,
    packing on ``packed_model``."""
    return _backends_worker(rank, world_size, hf_dirs), _packing_worker(rank, world_size, hf_dirs[packed_model])


@pytest.mark.parametrize("tp,pp,packed_model", [(2, 1, "qwen2"), (1, 2, "qwen3")], ids=["tp2", "pp2"])
def test_multi_rank_sdpa_and_packing(hf_models, tp, pp, packed_model):
    """At TP2 and PP2: sdpa = unfused = HF (logits), sdpa = unfused (gradients), and packed =
    unpacked (logits, log-probs, gradients; at PP2 the packed rows' shapes vary)."""
    hf_dirs = {m: hf_models[m][0] for m in MODELS}
    results = run_distributed(_layout_worker, 2, hf_dirs, packed_model, tp=tp, pp=pp, timeout_s=300)
    assert_backends_agree([r[0] for r in results], hf_models)
    assert_packing_exact([r[1] for r in results])


def test_packing_refusals(hf_models):
    from megatron_grpo.models import load_hf_config
    from megatron_grpo.models.builder import check_packing
    from megatron_grpo.models.errors import ModelError
    from tools.tiny import tiny_config

    dense = load_hf_config(hf_models["qwen2"][0])
    check_packing(dense, "auto")  # sdpa on CPU
    check_packing(dense, "sdpa")
    with pytest.raises(ModelError, match="needs model.attention_backend sdpa"):
        check_packing(dense, "unfused")
    with pytest.raises(ModelError, match="mixture-of-experts"):
        check_packing(tiny_config("qwen3_moe"), "sdpa")


def test_preflight_refuses_packing_an_moe_model(tmp_path):
    from types import SimpleNamespace

    from megatron_grpo.config import ConfigError
    from megatron_grpo.preflight.run import check_model_dir
    from tools.tiny import save_tiny_model

    hf_dir = str(save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=4))
    cfg = SimpleNamespace(model=SimpleNamespace(hf_dir=hf_dir, attention_backend="auto", lora=None),
                          parallel=SimpleNamespace(tp=1, pp=1, cp=1, pack_sequences=True))
    with pytest.raises(ConfigError, match="^parallel.pack_sequences: is not supported for the mixture-of-experts"):
        check_model_dir(cfg)
    cfg.parallel.pack_sequences = False
    check_model_dir(cfg)


def test_packed_log_prob_pass_with_kept_sets(hf_models, single_rank):
    """The trainer's log-prob pass (``compute_log_probs``) packed = unpacked, with the
    sampling-mask replay's kept sets (``kept_ids``, gathered into the packed layout)."""
    from megatron_grpo.models import build_model, load_hf_config, load_hf_weights
    from tests.support.batches import random_train_batch
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs
    from megatron_grpo.trainer.microbatch import MicroBatching

    hf_dir = hf_models["qwen2"][0]
    cfg = load_hf_config(hf_dir)
    chunks = build_model(cfg, init_weights=False)
    load_hf_weights(chunks, hf_dir, cfg)
    batch = random_train_batch(6)
    g = torch.Generator().manual_seed(3)
    others = torch.randint(7, 200, (*batch.loss_mask.shape, 3), generator=g)
    kept = torch.cat([batch.tokens[:, 1:, None], others], dim=2)  # the sampled token and 3 others
    kept[batch.loss_mask == 0] = -1  # context positions: the full distribution
    kept[0, :, 2:] = -1  # sets of different sizes
    batch.kept_ids = kept
    spec = ScoringSpec(temperature=0.7, vocab_size=cfg.vocab_size)
    unpacked = compute_log_probs(chunks, batch, MicroBatching(2, 16), spec)
    packed = compute_log_probs(chunks, batch, MicroBatching(2, 16, pack=True), spec)
    mask = batch.loss_mask > 0
    assert (packed[mask] - unpacked[mask]).abs().max().item() <= TOL
    batch.kept_ids = None
    full = compute_log_probs(chunks, batch, MicroBatching(2, 16, pack=True), spec)
    assert (packed[mask] > full[mask] + 1e-3).all()  # the truncated distribution really applied
