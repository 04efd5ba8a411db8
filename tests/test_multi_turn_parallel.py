"""One GRPO step on a multi-turn batch (model turns interleaved with observation tokens of
loss mask 0, ``testing/batches.py:random_multi_turn_batch``) at TP2, PP2 and TP2xPP2 equals the
TP1 step: same loss, grad norm and updated weights (max |delta| <= 1e-5), through the real
Megatron schedule, vocab-parallel op and loss; and the TP1 loss equals a hand computation from
the batch's masks for two reductions (observation tokens in no count)."""

import pytest
import torch

from tests.support.distributed import run_distributed

N_SEQ, GLOBAL_BATCH, MICRO = 8, 8, 2


def _one_step(rank, world, hf_dir, reduction):
    from megatron.core import parallel_state as ps

    from megatron_grpo.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from megatron_grpo.models import iter_hf_weights
    from tests.support.batches import random_multi_turn_batch
    from tests.support.policy import build_test_policy
    from megatron_grpo.rollout.batch import dp_shard
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs, train_mini_batch

    # SGD: the update is proportional to the gradient, so any gradient difference shows
    policy = build_test_policy(ModelConfig(hf_dir=hf_dir, dtype="float32"),
                               OptimizerConfig(name="sgd", lr=1.0, clip_grad=0.0))
    algo = AlgorithmConfig(loss_reduction=reduction)
    spec = ScoringSpec(temperature=0.7, vocab_size=policy.hf_config.vocab_size)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    full = random_multi_turn_batch(N_SEQ)
    local = dp_shard(full, dp_rank, dp, GLOBAL_BATCH)
    old_lp = compute_log_probs(policy.chunks, local, MICRO, spec)
    local.old_log_probs = old_lp if old_lp is not None else torch.zeros_like(local.rollout_log_probs)
    metrics, applied, grad_norm = train_mini_batch(
        policy.chunks, policy.optimizer, local, algo, spec, MICRO, int(full.loss_mask.sum()),
        full.num_sequences, dp, ps.get_data_parallel_group())
    weights = {k: v.clone() for k, v in iter_hf_weights(policy.modules, policy.hf_config)}
    return {"metrics": metrics, "applied": applied, "grad_norm": grad_norm, "weights": weights}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tools.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("hf"), "qwen2", seed=1))


_REFERENCES: dict = {}


def _reference(tiny_hf, reduction):
    if reduction not in _REFERENCES:
        (_REFERENCES[reduction],) = run_distributed(_one_step, 1, tiny_hf, reduction, tp=1, pp=1, timeout_s=400)
    return _REFERENCES[reduction]


def test_the_batch_interleaves_observations():
    from tests.support.batches import random_multi_turn_batch

    b = random_multi_turn_batch(N_SEQ)
    # rows with an observation between two model turns: a 0 inside the loss mask's span of 1s
    spans = ["".join(str(int(x)) for x in row).strip("0") for row in b.loss_mask]
    assert sum("0" in s for s in spans) >= N_SEQ // 2
    assert (b.rollout_log_probs[b.loss_mask == 0] == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean"])
def test_tp1_loss_is_the_hand_computation_over_model_tokens(tiny_hf, reduction):
    """First step: pi_old = pi_theta, so every ratio is 1 and the PPO loss per token is -A_i.
    token_mean: -sum_i A_i m_i / sum_i m_i (m_i: row i's model tokens, observations not counted);
    seq_mean_token_mean: -mean_i A_i (each row's mean over its model tokens is A_i)."""
    from tests.support.batches import random_multi_turn_batch

    b = random_multi_turn_batch(N_SEQ)
    m = b.loss_mask.sum(dim=1)
    by_hand = {"token_mean": -(b.advantages * m).sum() / m.sum(),
               "seq_mean_token_mean": -b.advantages.mean()}[reduction]
    ref = _reference(tiny_hf, reduction)
    assert ref["applied"]
    assert ref["metrics"]["num_valid_tokens"] == float(m.sum())
    assert abs(ref["metrics"]["loss"] - float(by_hand)) <= 1e-5, (ref["metrics"]["loss"], float(by_hand))


@pytest.mark.slow
@pytest.mark.parametrize("reduction,world,tp,pp", [("token_mean", 2, 2, 1), ("token_mean", 2, 1, 2),
                                                   ("token_mean", 4, 2, 2), ("seq_mean_token_mean", 2, 2, 1)],
                         ids=["token_mean-tp2", "token_mean-pp2", "token_mean-tp2pp2", "seq_mean-tp2"])
def test_multi_turn_step_matches_tp1(tiny_hf, reduction, world, tp, pp):
    reference = _reference(tiny_hf, reduction)
    results = run_distributed(_one_step, world, tiny_hf, reduction, tp=tp, pp=pp, timeout_s=600)
    reporters = [r for r in results if r["metrics"] is not None]
    assert reporters
    ref_m = reference["metrics"]
    for r in reporters:
        assert r["applied"]
        assert abs(r["metrics"]["loss"] - ref_m["loss"]) <= 1e-5 * max(1, abs(ref_m["loss"])), (
            r["metrics"]["loss"], ref_m["loss"])
        assert r["metrics"]["num_valid_tokens"] == ref_m["num_valid_tokens"]
        assert abs(r["grad_norm"] - reference["grad_norm"]) <= 1e-5 * max(1, reference["grad_norm"]), (
            r["grad_norm"], reference["grad_norm"])
    merged = {}
    for r in results:
        merged.update(r["weights"])
    assert set(merged) == set(reference["weights"])
    worst = max((merged[k] - reference["weights"][k]).abs().max().item() for k in merged)
    assert worst <= 1e-5, worst
    from safetensors.torch import load_file

    initial = load_file(f"{tiny_hf}/model.safetensors")
    assert any(not torch.equal(reference["weights"][k], v) for k, v in initial.items())  # the step moved them
