"""Mixture-of-experts in the trainer: one GRPO step at EP2 equals the EP1 step (loss, grad
norm, updated weights), and after a weight sync from EP2 ranks the embedded engine's
log-probs equal the trainer's on its own samples (fp32). The engine serves transformers'
fused expert parameters under the checkpoint's per-expert names, bitwise.
"""

import pytest
import torch

from megatron_grpo.generation.manager import RolloutServerManager, weight_sync_dir
from tests.support.distributed import run_distributed
from tools.tiny import save_tiny_model
from tests.support.models_fixtures import hf_tensors
from tests.support.sync_checks import check_sync, sync_worker
from tests.support.step_equivalence import initial_weights, merged_weights, one_step
from megatron_grpo.config import EngineConfig
from tests.support.configs import experiment


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", seed=4))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_engine_serves_fused_experts_under_checkpoint_names(model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_grpo.inference.served_names import served_tensors

    path = save_tiny_model(tmp_path / model_type, model_type, seed=5)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    on_disk = hf_tensors(path)
    params = dict(model.named_parameters())
    assert any(n.endswith("experts.gate_up_proj") for n in params)  # fused in memory
    served = served_tensors(params, list(on_disk))
    assert sorted(served) == sorted(on_disk)
    assert all(torch.equal(served[n], t) for n, t in on_disk.items())
    # a write through a served name lands in the fused parameter the forward uses
    name = next(n for n in on_disk if ".experts.3." in n and ("up_proj" in n or ".w3." in n))
    served[name].data.zero_()
    fused = params[name.split(".experts.")[0].replace("block_sparse_moe", "mlp") + ".experts.gate_up_proj"]
    assert fused[3, fused.shape[1] // 2:].abs().sum() == 0 and fused[3, : fused.shape[1] // 2].abs().sum() > 0


# ---- one GRPO step ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ep1_reference(moe_dir):
    (ref,) = run_distributed(one_step, 1, moe_dir, tp=1, pp=1, timeout_s=300)
    return ref


@pytest.mark.slow
def test_ep2_step_matches_ep1(moe_dir, ep1_reference):
    ref = ep1_reference
    results = run_distributed(one_step, 2, moe_dir, tp=1, pp=1, ep=2, timeout_s=400)
    assert ref["applied"]
    for r in results:  # dp = 2: both ranks are last-stage reporters
        assert r["applied"]
        assert abs(r["metrics"]["loss"] - ref["metrics"]["loss"]) <= 1e-5 * max(1, abs(ref["metrics"]["loss"]))
        assert abs(r["grad_norm"] - ref["grad_norm"]) <= 1e-5 * max(1, ref["grad_norm"]), (r["grad_norm"], ref["grad_norm"])
    for r in results:  # every EP rank exports every expert
        assert set(r["weights"]) == set(ref["weights"])
    weights = merged_weights(results)
    worst = max((weights[k] - ref["weights"][k]).abs().max().item() for k in weights)
    assert worst <= 1e-5, worst
    initial = initial_weights(moe_dir)
    moved = [k for k in initial if ".experts." in k and not torch.equal(ref["weights"][k], initial[k])]
    assert moved  # the experts were updated (the comparison is not vacuous)


# ---- weight sync ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_engine_url(moe_dir, tmp_path_factory):
    """(url, the run's weight-sync directory, which the engine trusts)."""
    cfg = experiment(engine=EngineConfig(dtype="float32", launch_timeout_s=180))
    run_dir = tmp_path_factory.mktemp("run")
    with RolloutServerManager(cfg, model_dir=moe_dir, run_dir=run_dir) as manager:
        yield manager.urls[0], str(weight_sync_dir(run_dir))


@pytest.mark.slow
def test_sync_from_ep2_ranks_engine_logprobs_match(moe_engine_url, moe_dir, tmp_path):
    transports = ["distributed", "tensor"]
    results = run_distributed(sync_worker, 2, *moe_engine_url, moe_dir, transports, False,
                              tp=1, pp=1, ep=2, timeout_s=400)
    # rank 1 holds half the experts: it takes part (a peer), rank 0 sends everything
    assert check_sync(results, transports, 2) == ["coordinator+sender", "peer"]
    assert results[0]["stats"]["distributed"][1] == len(hf_tensors(moe_dir))
