"""Context parallelism (``parallel.cp``, ``models.context_parallel``) changes no number.

For the same batch and weights, one GRPO step at CP2 (and CP4, DP2 x CP2, TP2 x CP2, PP2 x CP2) gives the CP1 step's scored log-probs, every logged metric
(loss, entropy, KL, clip fraction, IS ratios, mismatch, token counts), grad norm and updated
weights within 1e-6 (fp32; SGD, so the update is the gradient), through the trainer's own
passes (``trainer.megatron_step``: the real megatron-core schedule, DDP, optimizer and
vocab-parallel op). Cases: every ``loss_reduction``, the ppo/gspo/cispo losses, the entropy
bonus and the KL term, padded and packed rows, a row shorter than 2 x cp, rows whose length
2 x cp does not divide, a fully masked response, multi-turn loss masks (observation tokens),
gradient accumulation over token-budget micro-batches of unequal token counts, and a LoRA
policy.

Independent references: the attention (``sdpa_context_parallel``, both its CPU mask path and
its per-chunk CUDA path) against plain causal SDPA over the whole sequence; the CP2 log-probs
against transformers' full-vocabulary log-softmax of the same HF model. And the refusals, each
in one line naming the key.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_grpo.models.context_parallel import (cp_attention_mask, local_index, local_of_global, rank_chunks,
                                                   sdpa_context_parallel)
from tests.support.cp_cases import BATCHES, cp_step
from tests.support.distributed import run_distributed

TOL = 1e-6


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tools.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("hf"), "qwen2", seed=1))


# ---- the layout (no ranks) ------------------------------------------------------------------
def test_rank_chunks_are_megatrons_load_balanced_layout():
    assert local_index([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert local_index([8], 2, 1).tolist() == [2, 3, 4, 5]
    assert local_index([8, 4], 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    assert local_index([16], 4, 3).tolist() == [6, 7, 8, 9]
    # every global index is held by exactly one rank
    for lengths, cp in (([8, 4, 12], 2), ([16, 8], 4)):
        held = torch.cat([local_index(lengths, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(sum(lengths)))
    assert local_of_global([8], 2, 1).tolist() == [-1, -1, 0, 1, 2, 3, -1, -1]
    chunks = rank_chunks([4, 8], 2, 0)
    assert [(c.segment_start, c.start, c.length, c.local_start) for c in chunks] == [
        (0, 0, 1, 0), (0, 3, 1, 1), (4, 4, 2, 2), (4, 10, 2, 4)]


def test_attention_mask_is_causal_inside_each_segment():
    mask = cp_attention_mask([4, 4], local_index([4, 4], 2, 1))  # queries at global 1, 2, 5, 6
    assert mask.int().tolist() == [[1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0],
                                   [0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0]]


@pytest.mark.parametrize("lengths,cp", [([12], 2), ([8, 4, 16], 2), ([16, 8], 4)])
@pytest.mark.parametrize("per_chunk,block", [(False, 256), (False, 3), (True, 256)],
                         ids=["mask", "mask_blocks_of_3", "per_chunk"])
def test_sdpa_context_parallel_is_causal_attention_of_the_whole_sequence(lengths, cp, per_chunk, block, monkeypatch):
    """Each rank's output (grouped-query: 4 heads over 2 groups) = the rows of plain causal SDPA
    over each whole segment at that rank's tokens; gradients too (the CPU mask path, in one
    query block or in blocks of 3 queries, and the per-chunk path CUDA runs compute the same
    function)."""
    from megatron_grpo.models import context_parallel

    monkeypatch.setattr(context_parallel, "_QUERY_BLOCK", block)
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(1, 4, total, 8, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, total, 8, generator=gen, requires_grad=True)
    v = torch.randn(1, 2, total, 8, generator=gen, requires_grad=True)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    reference = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                          scale=0.3, enable_gqa=True)
                           for a, b in zip(bounds[:-1], bounds[1:])], dim=2)
    weights = torch.randn(reference.shape, generator=gen)
    ref_grads = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for rank in range(cp):
        index = local_index(lengths, cp, rank)
        out = sdpa_context_parallel(q[:, :, index], k, v, lengths, cp, rank, 0.3, True, per_chunk)
        assert (out - reference[:, :, index]).abs().max() <= 1e-6
        for g, d in zip(grads, torch.autograd.grad((out * weights[:, :, index]).sum(), (q, k, v))):
            g += d
    for g, ref in zip(grads, ref_grads):
        assert (g - ref).abs().max() <= 1e-5


# ---- one step, CP vs CP1 --------------------------------------------------------------------
CASES = {
    "token_mean": dict(),
    "seq_mean_token_mean": dict(algorithm={"loss_reduction": "seq_mean_token_mean"}),
    "seq_mean_token_sum": dict(algorithm={"loss_reduction": "seq_mean_token_sum"}),
    "seq_mean_token_sum_norm": dict(algorithm={"loss_reduction": "seq_mean_token_sum_norm",
                                               "max_response_length": 32}),
    # GSPO's sequence ratio, sequence TIS and the geometric sequence mask: sums over each
    # sequence's chunks on every CP rank
    "gspo": dict(algorithm={"policy_loss_type": "gspo", "eps_clip_low": 3e-4, "eps_clip_high": 4e-4,
                            "loss_reduction": "seq_mean_token_mean",
                            "off_policy_correction": {"tis_ratio_type": "sequence", "sequence_mask_metric": "geometric",
                                                      "geo_mask_low": 0.5, "geo_mask_high": 1.5}}),
    "product_mask_outliers": dict(algorithm={"off_policy_correction": {
        "tis_ratio_type": "token", "sequence_mask_metric": "product", "product_mask_low": 0.2,
        "product_mask_high": 5.0, "outlier_token_is_threshold_low": 0.05, "outlier_token_is_threshold_high": 20.0}}),
    "cispo": dict(algorithm={"policy_loss_type": "cispo"}),
    "entropy_and_kl": dict(algorithm={"entropy_coef": 0.05, "kl_loss_coef": 0.05}, reference=True),
    "packed": dict(budget=64, pack=True),
    "edge": dict(batch="edge"),
    "edge_packed": dict(batch="edge", budget=24, pack=True),
    "multi_turn": dict(batch="multi_turn", algorithm={"loss_reduction": "seq_mean_token_mean"}),
    "accumulation": dict(budget=40),  # token-budget micro-batches of unequal token counts
    "lora": dict(lora=True),
}


def _step(world, hf, case, **layout):
    kwargs = dict(CASES[case])
    return run_distributed(cp_step, world, hf, kwargs.pop("batch", "long"), 2, kwargs.pop("budget", None),
                           kwargs.pop("pack", False), kwargs.pop("algorithm", None), kwargs.pop("reference", False),
                           layout.get("cp", 1), layout.pop("sequence_parallel", False), 1.0, kwargs.pop("lora", False),
                           tp=layout.get("tp", 1), pp=layout.get("pp", 1), cp=layout.get("cp", 1), timeout_s=300)


_REFERENCES: dict = {}


def _reference(hf, case):
    if case not in _REFERENCES:
        (_REFERENCES[case],) = _step(1, hf, case)
    return _REFERENCES[case]


def assert_same_step(results, ref, what=""):
    """Every reporting rank's metrics, grad norm, the merged weights and (dp 1) the scored
    log-probs equal ``ref``'s (CP1) within ``TOL``; the step moved the weights."""
    ref_m = ref["metrics"]
    assert ref["applied"] and ref_m["num_valid_tokens"] > 0
    reporters = [r for r in results if r["metrics"] is not None]
    assert reporters
    for r in reporters:
        assert r["applied"]
        for key, value in ref_m.items():
            if key == "num_padded_tokens":  # token slots run: CP pads each row to a multiple of 2 x cp
                continue
            assert abs(r["metrics"][key] - value) <= TOL * max(1.0, abs(value)), (what, key, r["metrics"][key], value)
        assert abs(r["grad_norm"] - ref["grad_norm"]) <= TOL * max(1.0, ref["grad_norm"]), (what, r["grad_norm"])
        if r["old_lp"] is not None and r["old_lp"].shape == ref["old_lp"].shape:
            scored = ref["loss_mask"] > 0
            assert (r["old_lp"][scored] - ref["old_lp"][scored]).abs().max() <= TOL, what
    weights = {}
    for r in results:
        weights.update(r["weights"])
    assert set(weights) == set(ref["weights"])
    worst = max((weights[k] - ref["weights"][k]).abs().max().item() for k in weights)
    assert worst <= TOL, (what, worst)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_cp2_step_equals_cp1(tiny_hf, case):
    assert_same_step(_step(2, tiny_hf, case, cp=2), _reference(tiny_hf, case), case)


def test_the_cases_exercise_what_they_name():
    """The batches really hold the corner cases the suite names (not vacuous)."""
    from megatron_grpo.trainer.microbatch import plan_micro_batches, sequence_lengths

    edge = BATCHES["edge"]()
    lengths = sequence_lengths(edge).tolist()
    assert min(lengths) < 4 and any(n % 4 for n in lengths)  # shorter than 2 x cp, not divisible
    assert (edge.loss_mask.sum(dim=1) == 0).any()  # a fully masked response
    multi = BATCHES["multi_turn"]()
    inside = [(row[: int(row.nonzero().max()) + 1] == 0).any() for row in multi.loss_mask if row.any()]
    assert any(inside)  # observation tokens inside a response
    plan = plan_micro_batches(BATCHES["long"](), 2, 40)
    counts = {int(BATCHES["long"]().loss_mask[list(rows)].sum()) for rows in plan.rows}
    assert len(plan.rows) > 2 and len(counts) > 1  # several micro-batches of unequal token counts


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(cp=4), dict(cp=2), dict(tp=2, cp=2), dict(pp=2, cp=2)],
                         ids=["cp4", "dp2xcp2", "tp2xcp2", "pp2xcp2"])
@pytest.mark.parametrize("case", ["token_mean", "packed", "edge"])
def test_four_rank_layouts_equal_cp1(tiny_hf, layout, case):
    assert_same_step(_step(4, tiny_hf, case, **layout), _reference(tiny_hf, case), f"{case} {layout}")


@pytest.fixture(scope="module")
def tiny_hf_4_layers(tmp_path_factory):
    from tools.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("hf4"), "qwen2", seed=2, num_layers=4))


@pytest.mark.slow
def test_virtual_pipeline_with_cp_equals_cp1(tiny_hf_4_layers):
    """PP2 x VPP2 x CP2 (megatron's interleaved schedule, 4 model chunks of one layer)."""
    (ref,) = _step(1, tiny_hf_4_layers, "token_mean")
    kwargs = dict(tp=1, pp=2, cp=2, timeout_s=300)
    results = run_distributed(cp_step, 4, tiny_hf_4_layers, "long", 2, None, False, None, False, 2, False,
                              vpp=2, **kwargs)
    assert_same_step(results, ref, "pp2 x vpp2 x cp2")


# ---- an independent reference: transformers --------------------------------------------------
def _cp_log_probs(rank, world, hf_dir, pack):
    from types import SimpleNamespace

    from megatron_grpo.config import ModelConfig, OptimizerConfig
    from megatron_grpo.config.model import ParallelConfig
    from megatron_grpo.trainer.components import build_policy
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs
    from megatron_grpo.trainer.microbatch import MicroBatching

    policy = build_policy(SimpleNamespace(model=ModelConfig(hf_dir=hf_dir, dtype="float32"),
                                          optimizer=OptimizerConfig(name="sgd", lr=1.0), parallel=ParallelConfig(cp=2)))
    spec = ScoringSpec(temperature=0.7, vocab_size=policy.hf_config.vocab_size)
    return compute_log_probs(policy.chunks, BATCHES["long"](), MicroBatching(4, 80 if pack else None, pack, False),
                             spec)


@pytest.mark.slow
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_cp2_log_probs_equal_transformers_full_vocab(tiny_hf, pack):
    from transformers import AutoModelForCausalLM

    batch = BATCHES["long"]()
    results = run_distributed(_cp_log_probs, 2, tiny_hf, pack, cp=2, timeout_s=300)
    model = AutoModelForCausalLM.from_pretrained(tiny_hf, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch.tokens).logits[:, :-1] / 0.7  # right padding: real positions never see it
    expected = torch.log_softmax(logits.double(), dim=-1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    scored = batch.loss_mask > 0
    for lp in results:  # every CP rank holds the whole sequences' log-probs
        assert (lp[scored].double() - expected[scored]).abs().max() <= 1e-5


# ---- refusals -----------------------------------------------------------------------------------
def test_config_refuses_what_cp_does_not_compose_with():
    from megatron_grpo.config.base import ConfigValueError
    from megatron_grpo.config.model import ParallelConfig

    with pytest.raises(ConfigValueError, match="share_prefix.*cp=2"):
        ParallelConfig(cp=2, pack_sequences=True, max_tokens_per_microbatch=64, share_prefix=True)
    with pytest.raises(ConfigValueError, match=r"world_size.*tp\*pp\*cp = 1\*1\*2"):
        ParallelConfig(cp=2, world_size=3)
    with pytest.raises(ConfigValueError, match="cp.*>= 1"):
        ParallelConfig(cp=0)
    assert ParallelConfig(cp=2, world_size=4).dp(4) == 2


def test_model_refuses_unfused_attention_and_moe_under_cp(tiny_hf):
    from megatron_grpo.models.builder import check_context_parallel
    from megatron_grpo.models.errors import ModelError
    from megatron_grpo.models.hf_config import load_hf_config

    config = load_hf_config(tiny_hf)
    check_context_parallel(config, "sdpa", 2)
    check_context_parallel(config, "unfused", 1)
    with pytest.raises(ModelError, match="parallel.cp=2 needs model.attention_backend sdpa"):
        check_context_parallel(config, "unfused", 2)
    moe = type("Config", (), {"model_type": "qwen3_moe"})()
    with pytest.raises(ModelError, match="mixture-of-experts"):
        check_context_parallel(moe, "sdpa", 2)
