"""Virtual pipeline parallelism (``parallel.vpp``, megatron-core's interleaved 1F1B schedule).

At PP2 x VPP2 (2 gloo ranks, 4-layer tiny models: each rank holds two chunks of one layer):

* Megatron's logits equal the HF model's (fp32, max |Δ| <= 1e-5) for a dense model with tied
  embeddings and for a MoE model, and the HF weights come back bitwise;
* a checkpoint saved at VPP2 loads at PP2 without VPP, and one saved there loads at VPP2;
* one GRPO step at VPP2 equals the step at PP2 without VPP (loss, grad norm, updated weights),
  dense and MoE;
* after a weight sync from VPP2 ranks, the engine's log-probs equal the trainer's.

The reference of the step test is the plain PP2 step, itself tested against TP1 in
tests/test_trainer_step_equivalence.py; 4 micro-batches, so the schedule runs two groups.
"""

import pytest
import torch

from megatron_grpo.config.base import ConfigValueError
from megatron_grpo.config.model import ParallelConfig
from megatron_grpo.models.errors import ModelError
from megatron_grpo.generation.manager import RolloutServerManager, weight_sync_dir
from tests.support.distributed import run_distributed
from tools.tiny import save_tiny_model
from tests.support.models_fixtures import hf_reference_logits, make_hf_model
from tests.support.sync_checks import check_sync, sync_worker
from tests.support.step_equivalence import merged_weights, one_step
from tests.support.models_reference import assert_matches, build_and_load, build_from_checkpoint, probe
from megatron_grpo.config import EngineConfig
from tests.support.configs import experiment

NUM_LAYERS = 4  # pp * vpp chunks of one layer each
CASES = {"qwen3-tied": ("qwen3", True), "mixtral": ("mixtral", False)}


# ---- validation ---------------------------------------------------------------------------
def test_vpp_config_is_validated():
    ParallelConfig(pp=2, vpp=2, world_size=2, global_batch_size=4, micro_batch_size=1)
    ParallelConfig(pp=1, vpp=1)  # 1 = off
    with pytest.raises(ConfigValueError, match=r"vpp: 2 needs pp >= 2"):
        ParallelConfig(pp=1, vpp=2)
    with pytest.raises(ConfigValueError, match=r"vpp: must be >= 1 or null"):
        ParallelConfig(pp=2, vpp=0)
    with pytest.raises(ConfigValueError, match=r"vpp: 2 needs micro-batches per step .* = 3 to be a multiple of pp=2"):
        ParallelConfig(pp=2, vpp=2, world_size=2, global_batch_size=3, micro_batch_size=1)


def test_layers_must_split_over_the_chunks():
    from megatron_grpo.models.builder import check_pipeline_layers

    cfg = type("Cfg", (), {"num_hidden_layers": 6})()
    check_pipeline_layers(cfg, 2, None)
    check_pipeline_layers(cfg, 3, 2)
    with pytest.raises(ModelError, match=r"num_hidden_layers=6 is not divisible by parallel pp\*vpp = 2\*2"):
        check_pipeline_layers(cfg, 2, 2)


def test_training_needs_a_multiple_of_pp_micro_batches(monkeypatch):
    from megatron.core import parallel_state

    from megatron_grpo.models.forward import interleaved_microbatches

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 2)
    assert interleaved_microbatches(4, forward_only=False) == 4
    assert interleaved_microbatches(3, forward_only=True) == 4  # forward-only: padded
    with pytest.raises(ValueError, match=r"multiple of pp=2, got 3"):
        interleaved_microbatches(3, forward_only=False)


# ---- logits, round trip, checkpoints ------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """case -> (hf_dir, HF reference logits)."""
    root = tmp_path_factory.mktemp("vpp_models")
    out = {}
    for seed, (name, (model_type, tied)) in enumerate(CASES.items()):
        path = make_hf_model(root / name, model_type, tied, seed=20 + seed, num_layers=NUM_LAYERS)
        out[name] = (str(path), hf_reference_logits(path))
    return out


def _probe_worker(rank, world_size, cases, ckpt_out=None):
    from megatron_grpo.models import save_megatron_checkpoint

    results = {}
    for name, hf_dir in cases:
        cfg, chunks = build_and_load(hf_dir)
        layers = [[layer.layer_number for layer in c.decoder.layers] for c in chunks]
        results[name] = (*probe(cfg, chunks, hf_dir), layers)
        if ckpt_out and name == ckpt_out[0]:
            save_megatron_checkpoint(chunks, ckpt_out[1], extra_state={"step": 3})
    return results


def _load_worker(rank, world_size, hf_dir, ckpt_in, ckpt_out):
    from megatron_grpo.models import save_megatron_checkpoint

    cfg, chunks, extra = build_from_checkpoint(hf_dir, ckpt_in)
    logits, report = probe(cfg, chunks, hf_dir)
    save_megatron_checkpoint(chunks, ckpt_out, extra_state=extra)
    return logits, report, extra, len(chunks)


@pytest.mark.slow
def test_pp2_vpp2_logits_round_trip_and_checkpoints(models, tmp_path):
    cases = [(n, models[n][0]) for n in CASES]
    saved_vpp, saved_pp = str(tmp_path / "vpp2"), str(tmp_path / "pp2")
    results = run_distributed(_probe_worker, 2, cases, ("qwen3-tied", saved_vpp), tp=1, pp=2, vpp=2, timeout_s=500)
    for name in CASES:
        assert_matches([r[name][:2] for r in results], *models[name])
        # rank r holds virtual stages r and r + 2: global layers (1-based) r+1 and r+3
        assert [r[name][2] for r in results] == [[[1], [3]], [[2], [4]]]
    hf_dir, ref = models["qwen3-tied"]
    # saved at VPP2 -> loaded at PP2 without VPP (NaN-filled first: every weight must come back)
    plain = run_distributed(_load_worker, 2, hf_dir, saved_vpp, saved_pp, tp=1, pp=2, timeout_s=400)
    assert [r[3] for r in plain] == [1, 1] and plain[0][2] == {"step": 3}
    assert_matches([r[:2] for r in plain], hf_dir, ref)
    # and back: saved at PP2 -> loaded at VPP2
    back = run_distributed(_load_worker, 2, hf_dir, saved_pp, str(tmp_path / "again"), tp=1, pp=2, vpp=2,
                           timeout_s=400)
    assert [r[3] for r in back] == [2, 2]
    assert_matches([r[:2] for r in back], hf_dir, ref)


# ---- one GRPO step -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3_moe"])
def test_vpp2_step_matches_pp2(model_type, tmp_path):
    hf_dir = str(save_tiny_model(tmp_path / model_type, model_type, seed=4, num_layers=NUM_LAYERS))
    plain = run_distributed(one_step, 2, hf_dir, tp=1, pp=2, timeout_s=500)
    vpp = run_distributed(one_step, 2, hf_dir, tp=1, pp=2, vpp=2, timeout_s=500)
    ref = next(r for r in plain if r["metrics"] is not None)
    got = next(r for r in vpp if r["metrics"] is not None)
    assert ref["applied"] and got["applied"]
    assert abs(got["metrics"]["loss"] - ref["metrics"]["loss"]) <= 1e-6 * max(1, abs(ref["metrics"]["loss"]))
    for r in vpp:
        assert abs(r["grad_norm"] - ref["grad_norm"]) <= 1e-5 * max(1, ref["grad_norm"]), (r["grad_norm"], ref["grad_norm"])
    want, have = merged_weights(plain), merged_weights(vpp)
    assert set(have) == set(want)
    worst = max((have[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-5, worst
    assert (got["old_lp"] - ref["old_lp"]).abs().max().item() <= 1e-5  # log-probs after the step


# ---- weight sync ---------------------------------------------------------------------------
@pytest.mark.slow
def test_sync_from_vpp2_ranks_engine_logprobs_match(models, tmp_path):
    hf_dir = models["qwen3-tied"][0]
    transports = ["distributed", "tensor"]
    cfg = experiment(engine=EngineConfig(dtype="float32", launch_timeout_s=180))
    with RolloutServerManager(cfg, model_dir=hf_dir, run_dir=tmp_path / "run") as manager:
        results = run_distributed(sync_worker, 2, manager.urls[0], str(weight_sync_dir(tmp_path / "run")), hf_dir,
                                  transports, False,
                                  tp=1, pp=2, vpp=2, timeout_s=500)
    assert check_sync(results, transports, 2) == ["coordinator+sender", "sender"]
    # every HF tensor of the tied model is sent exactly once over the two stages' four chunks
    num_tensors = 1 + NUM_LAYERS * 11 + 1  # embed, 4 x (2 norms, q, k, v, o, q/k norm, gate, up, down), norm
    assert sum(r["stats"]["tensor"][1] for r in results) == num_tensors
