"""Full activation recomputation (``model.recompute_activations``) changes memory, not maths.

One fp32 GRPO step at TP2 with recomputation equals the same step without it (loss, grad
norm and every updated weight to 1e-6; measured: identical), and the recomputation really
happens: each transformer layer runs its forward twice per training micro-batch (once
without autograd, once again in the backward pass) instead of once.

On CPU this runs through the CPU shim's redirection of megatron's CUDA RNG save/restore
(``runtime/cpu_shim.py``); on a GPU it ran in ``tools/bench/gpu_smoke.py``'s ``features`` check.
"""

import pytest
import torch

from tests.support.distributed import run_distributed

N_SEQ, MICRO = 8, 2


def _one_step(hf_dir, recompute):
    from megatron.core import parallel_state as ps

    from megatron_grpo.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from megatron_grpo.models import iter_hf_weights
    from tests.support.batches import random_train_batch
    from tests.support.policy import build_test_policy
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs, train_mini_batch

    policy = build_test_policy(ModelConfig(hf_dir=hf_dir, recompute_activations=recompute),
                               OptimizerConfig(name="sgd", lr=1.0, clip_grad=0.0))  # the update is the gradient
    layers = [m for c in policy.modules for m in c.modules() if type(m).__name__ == "TransformerLayer"]
    calls = []
    for layer in layers:
        layer.register_forward_hook(lambda *_: calls.append(1))
    batch = random_train_batch(N_SEQ)
    spec = ScoringSpec(temperature=0.7, vocab_size=policy.hf_config.vocab_size)
    batch.old_log_probs = compute_log_probs(policy.chunks, batch, MICRO, spec)
    calls.clear()  # count the training forward only
    metrics, applied, grad_norm = train_mini_batch(
        policy.chunks, policy.optimizer, batch, AlgorithmConfig(), spec, MICRO, int(batch.loss_mask.sum()),
        batch.num_sequences, 1, ps.get_data_parallel_group())
    weights = {k: v.clone() for k, v in iter_hf_weights(policy.modules, policy.hf_config)}
    return {"loss": metrics["loss"], "applied": applied, "grad_norm": grad_norm, "weights": weights,
            "forwards_per_layer_per_micro": len(calls) / (len(layers) * (N_SEQ // MICRO))}


def _both_steps(rank, world, hf_dir):
    return _one_step(hf_dir, False), _one_step(hf_dir, True)  # same initial weights, same batch


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tools.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("hf"), "qwen2", seed=3))


@pytest.mark.slow
def test_recomputed_step_equals_the_plain_step_at_tp2(tiny_hf):
    for p, r in run_distributed(_both_steps, 2, tiny_hf, tp=2, pp=1, timeout_s=300):
        assert p["applied"] and r["applied"]
        assert p["forwards_per_layer_per_micro"] == 1
        assert r["forwards_per_layer_per_micro"] == 2  # the backward re-ran each layer's forward
        assert abs(p["loss"] - r["loss"]) <= 1e-6 and abs(p["grad_norm"] - r["grad_norm"]) <= 1e-6 * p["grad_norm"]
        assert p["weights"].keys() == r["weights"].keys()
        for k in p["weights"]:
            torch.testing.assert_close(r["weights"][k], p["weights"][k], rtol=0, atol=1e-6, msg=k)
