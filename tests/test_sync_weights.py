"""Per-step weight sync, end to end on CPU: Megatron chunks (TP1 with DP2, TP2, PP2) built
from a tiny HF model, weights perturbed like an optimizer step, synced into a real embedded
engine over HTTP with each transport; then the engine's log-probs of its own samples must
equal the trainer's recomputation (fp32, mean |delta| <= 1e-5). Also: a bucket corrupted on
the wire is caught by the same sync's verification, naming a tensor. The probe and the worker
are tests/support/sync_checks.py's.
"""

import pytest

from megatron_grpo.generation.manager import RolloutServerManager, weight_sync_dir
from tools.tiny import save_tiny_model
from tests.support.distributed import run_distributed
from tests.support.sync_checks import NUM_HF_TENSORS, check_sync, sync_worker
from megatron_grpo.config import EngineConfig
from tests.support.configs import experiment

TRANSPORTS = ["distributed", "tensor", "disk"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2", seed=11))


@pytest.fixture(scope="module")
def engine_url(model_dir, tmp_path_factory):
    """(url, the run's weight-sync directory: the disk transport's work_dir, which it trusts)."""
    cfg = experiment(engine=EngineConfig(dtype="float32", launch_timeout_s=180))
    run_dir = tmp_path_factory.mktemp("run")
    with RolloutServerManager(cfg, model_dir=model_dir, run_dir=run_dir) as manager:
        yield manager.urls[0], str(weight_sync_dir(run_dir))


@pytest.mark.slow
def test_sync_tp1_dp2_all_transports(engine_url, model_dir):
    results = run_distributed(sync_worker, 2, *engine_url, model_dir, TRANSPORTS, False,
                              tp=1, pp=1, timeout_s=400)
    assert check_sync(results, TRANSPORTS, 2) == ["coordinator+sender", "idle"]  # DP replica 1 sends nothing
    assert results[0]["stats"]["distributed"][1] == NUM_HF_TENSORS


@pytest.mark.slow
def test_sync_tp2_all_transports_and_corruption(engine_url, model_dir):
    results = run_distributed(sync_worker, 2, *engine_url, model_dir, TRANSPORTS, True,
                              tp=2, pp=1, timeout_s=400)
    assert check_sync(results, TRANSPORTS, 2) == ["coordinator+sender", "peer"]
    for r in results:  # every rank raises the same error, naming a tensor
        assert "differs between the trainer and engine" in r["corrupt"], r["corrupt"]
        assert "model." in r["corrupt"] or "lm_head" in r["corrupt"]
    assert results[0]["corrupt"] == results[1]["corrupt"]
    delta, versions = results[0]["recovered"]
    assert delta <= 1e-5 and versions == {"1000"}
    print(results[0]["corrupt"])


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tied") / "llama", "llama", seed=12, tie_word_embeddings=True))


@pytest.fixture(scope="module")
def tied_engine_url(tied_model_dir, tmp_path_factory):
    cfg = experiment(engine=EngineConfig(dtype="float32", launch_timeout_s=180))
    run_dir = tmp_path_factory.mktemp("run")
    with RolloutServerManager(cfg, model_dir=tied_model_dir, run_dir=run_dir) as manager:
        yield manager.urls[0], str(weight_sync_dir(run_dir))


@pytest.mark.slow
def test_sync_pp2_tied_embeddings_all_transports(tied_engine_url, tied_model_dir):
    """PP2 with tied embeddings: the word embedding lives on stage 0 and the output layer on
    stage 1; the tied tensor is sent once (by stage 0) and serves both in the engine."""
    results = run_distributed(sync_worker, 2, *tied_engine_url, tied_model_dir, TRANSPORTS, False,
                              tp=1, pp=2, timeout_s=400)
    assert check_sync(results, TRANSPORTS, 2) == ["coordinator+sender", "sender"]
    num_tied_llama = 1 + 2 * 9 + 1  # embed, 2 layers x (2 norms, q, k, v, o, gate, up, down), norm
    assert sum(r["stats"]["tensor"][1] for r in results) == num_tied_llama  # split over the two stages
