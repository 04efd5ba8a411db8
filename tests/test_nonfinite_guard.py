"""Numerical faults: a non-finite loss or gradient skips the optimizer update and leaves no
trace, through the real Megatron schedule, DDP and megatron-core Adam on 1 gloo rank.

One rank builds three identical policies from the same tiny HF model:

* A: a mini-batch with +inf advantage on a valid sequence (the loss is then non-finite),
  then one with a NaN advantage, then the clean mini-batch;
* B: only the clean mini-batch;
* C: the clean mini-batch with NaN rollout / -inf old log-probs on every MASKED position
  (prompt, padding), which must be ignored: the step is applied and equals B's.

The poisoned steps must report ``applied=False`` with a non-finite loss and leave A's weights
bit for bit unchanged; A's clean step must then give exactly B's weights. With Adam any
leak shows: a gradient left in the buffer, a moment updated with NaN, or a step counter
advanced by a skipped update (it changes the bias correction) would all make A != B.

The driver counts the skips (``skipped_updates``) and aborts after
``trainer.max_consecutive_nonfinite`` consecutive bad steps; that end-to-end path is the
lead's (issue 8).
"""

import math

import pytest
import torch

from tests.support.distributed import run_distributed

N_SEQ, MICRO = 4, 2


def _batch():
    from megatron_grpo.rollout.batch import build_train_batch

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(7, 200, (3 + i % 2,), generator=gen).tolist() for i in range(N_SEQ)]
    outputs = [torch.randint(7, 200, (2 + i % 3,), generator=gen).tolist() for i in range(N_SEQ)]
    logps = [(-torch.rand(len(o), generator=gen) * 3).tolist() for o in outputs]
    return build_train_batch(prompts, outputs, logps, torch.tensor([1.0, -0.5, 0.25, -0.75]), pad_id=0)


def _policy(hf_dir):
    from megatron_grpo.config import ModelConfig, OptimizerConfig
    from tests.support.policy import build_test_policy

    return build_test_policy(ModelConfig(hf_dir=hf_dir, dtype="float32"), OptimizerConfig(name="adam", lr=1e-2, clip_grad=1.0))


def _weights(policy):
    return {name: p.detach().clone() for name, p in policy.modules[0].named_parameters()}


def _same(w1, w2):
    """Bit-for-bit equality of two name -> tensor dicts."""
    return w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


def _guard(rank, world, hf_dir):
    from megatron.core import parallel_state as ps

    from megatron_grpo.config import AlgorithmConfig
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs, train_mini_batch

    algo = AlgorithmConfig(off_policy_correction={"tis_ratio_type": "token"})
    a, b, c = _policy(hf_dir), _policy(hf_dir), _policy(hf_dir)
    spec = ScoringSpec(temperature=1.0, vocab_size=a.hf_config.vocab_size)
    clean = _batch()
    clean.old_log_probs = compute_log_probs(a.chunks, clean, MICRO, spec)

    def step(policy, batch):
        metrics, applied, grad_norm = train_mini_batch(
            policy.chunks, policy.optimizer, batch, algo, spec, MICRO, int(batch.loss_mask.sum()),
            batch.num_sequences, 1, ps.get_data_parallel_group())
        return {"loss": metrics["loss"], "applied": applied, "grad_norm": grad_norm}

    initial, out = _weights(a), {"steps": []}
    for value in (math.inf, math.nan):
        poisoned = clean.select(slice(None))
        poisoned.advantages = clean.advantages.clone()
        poisoned.advantages[1] = value  # sequence 1 has valid response tokens
        assert poisoned.loss_mask[1].sum() > 0
        out["steps"].append({**step(a, poisoned), "unchanged": _same(_weights(a), initial)})
    out["clean_a"] = step(a, clean)
    out["clean_b"] = step(b, clean)
    # NaN/inf where loss_mask is 0 (prompt and padding positions) must be ignored, not
    # poison the loss: a masked multiply would turn 0 * nan into nan.
    masked = clean.select(slice(None))
    invalid = masked.loss_mask == 0
    masked.rollout_log_probs = clean.rollout_log_probs.masked_fill(invalid, math.nan)
    masked.old_log_probs = clean.old_log_probs.masked_fill(invalid, -math.inf)
    out["masked_c"] = step(c, masked)
    out["c_equals_b"] = _same(_weights(c), _weights(b))
    final_a = _weights(a)
    out["moved"] = not _same(final_a, initial)  # the clean step changed the weights...
    out["a_equals_b"] = _same(final_a, _weights(b))  # ... exactly as on a fresh policy
    grads = [getattr(p, "main_grad", p.grad) for p in a.modules[0].parameters()]
    out["optimizer_steps_a"] = sorted({int(s["step"]) for s in a.optimizer.optimizer.state.values() if "step" in s})
    out["grads_finite"] = all(g is None or bool(torch.isfinite(g).all()) for g in grads)
    return out


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from tools.tiny import save_tiny_model

    hf_dir = str(save_tiny_model(tmp_path_factory.mktemp("hf"), "qwen2", seed=2))
    (res,) = run_distributed(_guard, 1, hf_dir, tp=1, pp=1, timeout_s=300)
    return res


@pytest.mark.slow
def test_nonfinite_loss_skips_the_update_bit_for_bit(result):
    for s, value in zip(result["steps"], ("inf", "nan")):
        assert not s["applied"], value
        assert not math.isfinite(s["loss"]), (value, s["loss"])
        assert math.isnan(s["grad_norm"]), value
        assert s["unchanged"], value


@pytest.mark.slow
def test_the_next_clean_step_is_applied_as_if_nothing_happened(result):
    assert result["clean_a"]["applied"] and result["clean_b"]["applied"]
    assert math.isfinite(result["clean_a"]["loss"])
    assert result["clean_a"]["loss"] == result["clean_b"]["loss"]
    assert result["clean_a"]["grad_norm"] == result["clean_b"]["grad_norm"]
    assert result["moved"]
    assert result["a_equals_b"]
    assert result["optimizer_steps_a"] == [1]  # Adam counted only the applied update
    assert result["grads_finite"]


@pytest.mark.slow
def test_nonfinite_values_on_masked_positions_are_ignored(result):
    assert result["masked_c"]["applied"], result["masked_c"]
    assert result["masked_c"]["loss"] == result["clean_b"]["loss"]
    assert result["c_equals_b"]
