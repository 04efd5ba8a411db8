"""The device seam (runtime/device.py) on CPU: the trainer's step feeds the model through it,
the forward path the equivalence tests check is the trainer's own, the fused finiteness check
still catches a single NaN in any parameter at TP2, and sequence-parallel padding leaves the
loss and gradients of a step unchanged (TP2 and PP2 against TP1 unpadded).

Sequence parallelism itself cannot be built on a CPU (megatron-core's local spec has no
sequence-parallel norm; TransformerEngine needs CUDA): the padding it requires is tested by
forcing the pad multiple, which is the one decision the sequence-parallel flag changes in
``models.forward``.
"""

import math

import pytest
import torch

from megatron_grpo.runtime import device
from tests.support.distributed import run_distributed
from megatron_grpo.rollout.batch import TrainBatch, build_train_batch

N_SEQ, MICRO = 4, 2


def _batch():
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(7, 200, (3 + i % 2,), generator=gen).tolist() for i in range(N_SEQ)]
    outputs = [torch.randint(7, 200, (2 + i % 3,), generator=gen).tolist() for i in range(N_SEQ)]
    logps = [(-torch.rand(len(o), generator=gen) * 3).tolist() for o in outputs]
    return build_train_batch(prompts, outputs, logps, torch.tensor([1.0, -0.5, 0.25, -0.75]), pad_id=0)


def _policy(hf_dir):
    from megatron_grpo.config import ModelConfig, OptimizerConfig
    from tests.support.policy import build_test_policy

    return build_test_policy(ModelConfig(hf_dir=hf_dir, dtype="float32"), OptimizerConfig(name="sgd", lr=1.0, clip_grad=0.0))


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tools.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("hf"), "qwen2", seed=4))


# ---- pure parts -------------------------------------------------------------------------------

def test_to_device_moves_every_tensor_field_and_keeps_the_rest():
    batch = _batch()
    batch.old_log_probs = torch.zeros_like(batch.rollout_log_probs)
    moved = device.to_device(batch, torch.device("cpu"))
    assert isinstance(moved, TrainBatch) and moved.ref_log_probs is None
    assert all(moved.tensors()[k] is v for k, v in batch.tensors().items())  # already there: no copy
    meta = device.to_device({"a": [batch.tokens], "b": 3}, torch.device("meta"))
    assert meta["a"][0].device.type == "meta" and meta["b"] == 3
    assert device.to_device(batch, torch.device("meta")).loss_mask.device.type == "meta"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_local_finite_flag_catches_one_bad_element_in_any_tensor(bad):
    tensors = [torch.randn(3, 5), None, torch.randn(7), torch.randn(2, 2, 2)]
    assert bool(device.local_finite_flag(tensors))
    for t in (x for x in tensors if x is not None):
        for i in range(t.numel()):
            saved = t.view(-1)[i].item()
            t.view(-1)[i] = bad
            assert not bool(device.local_finite_flag(tensors))
            t.view(-1)[i] = saved
    assert not bool(device.local_finite_flag(tensors, extra_ok=False))
    assert bool(device.local_finite_flag([]))


def test_distributed_optimizer_is_explicit_never_dropped():
    from megatron_grpo.config.base import ConfigError

    assert device.resolve_distributed_optimizer("auto", cuda=True) is True
    assert device.resolve_distributed_optimizer("auto", cuda=False) is False
    assert device.resolve_distributed_optimizer(True, cuda=True) is True
    assert device.resolve_distributed_optimizer(False, cuda=True) is False
    with pytest.raises(ConfigError, match="parallel.use_distributed_optimizer: true needs CUDA"):
        device.resolve_distributed_optimizer(True, cuda=False)


def test_layer_spec_choice(monkeypatch):
    """TE specs only with CUDA and an importable transformer_engine; local specs otherwise."""
    import sys
    import types

    from megatron_grpo.models import builder

    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # `import` raises ImportError
    monkeypatch.setattr(builder, "cuda_available", lambda: True)
    assert builder.use_transformer_engine() is False
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    assert builder.use_transformer_engine() is True
    monkeypatch.setattr(builder, "cuda_available", lambda: False)
    assert builder.use_transformer_engine() is False


def test_padding_helpers():
    from megatron_grpo.models.forward import pad_sequence, padded_length

    assert [padded_length(s, 2) for s in (1, 2, 7, 8)] == [2, 2, 8, 8]
    assert padded_length(7, 1) == 7
    tokens = torch.arange(14).view(2, 7)
    padded = pad_sequence(tokens, 4)
    assert padded.shape == (2, 8) and torch.equal(padded[:, :7], tokens) and (padded[:, 7] == 0).all()
    assert pad_sequence(tokens, 7) is tokens


# ---- the trainer's step goes through the seam (1 gloo rank) ---------------------------------

def _seam_use(rank, world, hf_dir):
    from megatron_grpo.config import AlgorithmConfig
    from megatron_grpo.models import forward
    from megatron_grpo.models.forward import forward_logits
    from megatron_grpo.ops import vocab_parallel_log_probs
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs, train_mini_batch

    policy = _policy(hf_dir)
    spec = ScoringSpec(temperature=1.0, vocab_size=policy.hf_config.vocab_size)
    placed, fed = [], []
    original = forward.model_inputs

    def spy(tokens):  # the real function; records what it hands the model
        out = original(tokens)
        placed.append(out[0])
        return out

    forward.model_inputs = spy
    embedding = policy.modules[0].embedding
    embedding.register_forward_pre_hook(lambda module, args, kwargs: fed.append(kwargs.get("input_ids", args[0] if args else None)),
                                        with_kwargs=True)
    out = {}
    batch = _batch()
    batch.old_log_probs = compute_log_probs(policy.chunks, batch, MICRO, spec)
    out["logprob_calls"] = len(placed)
    logits = forward_logits(policy.chunks, batch.tokens)
    out["forward_calls"] = len(placed) - out["logprob_calls"]
    # the equivalence tests' forward and the trainer's scoring agree on every scored position
    # (the trainer runs the output layer from a micro-batch's first scored position on)
    lp, _ = vocab_parallel_log_probs(logits[:, :-1], batch.tokens[:, 1:], temperature=1.0,
                                     vocab_size=spec.vocab_size)
    scored = batch.loss_mask > 0
    out["same_scores"] = torch.allclose(lp[scored], batch.old_log_probs[scored], rtol=0, atol=1e-6)
    before = len(placed)
    train_mini_batch(policy.chunks, policy.optimizer, batch, AlgorithmConfig(), spec, MICRO,
                     int(batch.loss_mask.sum()), N_SEQ, 1, None)
    out["train_calls"] = len(placed) - before
    out["all_fed_through_seam"] = len(fed) == len(placed) and all(f is p for f, p in zip(fed, placed))
    return out


@pytest.mark.slow
def test_the_trainer_step_and_the_checked_forward_go_through_the_seam(tiny_hf):
    (res,) = run_distributed(_seam_use, 1, tiny_hf, tp=1, pp=1, timeout_s=300)
    assert res["logprob_calls"] == N_SEQ // MICRO
    assert res["forward_calls"] == 1
    assert res["train_calls"] == N_SEQ // MICRO
    assert res["all_fed_through_seam"]
    assert res["same_scores"]


# ---- the fused finiteness check at TP2 ---------------------------------------------------------

def _finite_guard(rank, world, hf_dir):
    from megatron.core import parallel_state as ps

    from megatron_grpo.config import AlgorithmConfig
    from megatron_grpo.trainer.megatron_step import ScoringSpec, _all_finite, compute_log_probs, train_mini_batch

    policy = _policy(hf_dir)
    spec = ScoringSpec(temperature=1.0, vocab_size=policy.hf_config.vocab_size)
    batch = _batch()
    batch.old_log_probs = compute_log_probs(policy.chunks, batch, MICRO, spec)
    # a real backward fills the gradient buffers (the optimizer step is then applied)
    train_mini_batch(policy.chunks, policy.optimizer, batch, AlgorithmConfig(), spec, MICRO,
                     int(batch.loss_mask.sum()), N_SEQ, 1, ps.get_data_parallel_group())
    params = [p for c in policy.chunks for p in c.parameters()]
    grads = [p.main_grad for p in params]
    for g in grads:
        g.normal_()
    verdicts = {"clean": _all_finite(policy.chunks, [])}
    # every parameter of every rank in turn holds ONE NaN; every rank must see it
    num = torch.tensor([len(grads)])
    torch.distributed.all_reduce(num, op=torch.distributed.ReduceOp.MAX)
    missed = 0
    for owner in range(world):
        for i in range(int(num)):
            mine = rank == owner and i < len(grads)
            where = -1 if i % 2 else 0  # the first or the last element
            if mine:
                saved = grads[i].view(-1)[where].item()
                grads[i].view(-1)[where] = math.nan
            missed += _all_finite(policy.chunks, [])
            if mine:
                grads[i].view(-1)[where] = saved
    verdicts["missed"] = missed
    verdicts["checks"] = int(num) * world
    verdicts["loss_inf"] = _all_finite(policy.chunks, [{"loss": math.inf}] if rank == 1 else [{"loss": 1.0}])
    return verdicts


@pytest.mark.slow
def test_fused_finiteness_check_catches_a_single_nan_in_any_parameter_at_tp2(tiny_hf):
    results = run_distributed(_finite_guard, 2, tiny_hf, tp=2, pp=1, timeout_s=600)
    for r in results:
        assert r["clean"] is True
        assert r["checks"] > 10 and r["missed"] == 0, r
        assert r["loss_inf"] is False


# ---- sequence-parallel padding: loss and gradients unchanged ---------------------------------

def _padded_step(rank, world, hf_dir, multiple):
    from megatron.core import parallel_state as ps

    from megatron_grpo.config import AlgorithmConfig
    from megatron_grpo.models import forward, iter_hf_weights
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs, train_mini_batch

    lengths = []
    if multiple > 1:  # what parallel.sequence_parallel makes sequence_multiple return (tp)
        forward.sequence_multiple = lambda model: multiple
    original = forward.model_inputs
    forward.model_inputs = lambda tokens: lengths.append(tokens.shape[1]) or original(tokens)
    policy = _policy(hf_dir)
    spec = ScoringSpec(temperature=0.8, vocab_size=policy.hf_config.vocab_size)
    batch = _batch()
    batch.old_log_probs = compute_log_probs(policy.chunks, batch, MICRO, spec)
    if batch.old_log_probs is None:
        batch.old_log_probs = torch.zeros_like(batch.rollout_log_probs)
    batch.old_log_probs = batch.old_log_probs - 0.05  # off-policy: the ratio and clipping act
    metrics, applied, grad_norm = train_mini_batch(
        policy.chunks, policy.optimizer, batch, AlgorithmConfig(), spec, MICRO, int(batch.loss_mask.sum()),
        N_SEQ, 1, ps.get_data_parallel_group())
    weights = {k: v.clone() for k, v in iter_hf_weights(policy.modules, policy.hf_config)}
    return {"loss": metrics["loss"] if metrics else None, "grad_norm": grad_norm, "applied": applied,
            "weights": weights, "lengths": sorted(set(lengths)), "seq": batch.seq_length}


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_sequence_padding_keeps_loss_and_gradients(tiny_hf, tp, pp):
    (ref,) = run_distributed(_padded_step, 1, tiny_hf, 1, tp=1, pp=1, timeout_s=300)
    results = run_distributed(_padded_step, 2, tiny_hf, 4, tp=tp, pp=pp, timeout_s=600)
    assert ref["lengths"] == [ref["seq"]] and ref["seq"] % 4 != 0  # the padded runs really pad
    assert all(r["lengths"] == [-(-ref["seq"] // 4) * 4] for r in results)
    reporters = [r for r in results if r["loss"] is not None]
    assert reporters and all(r["applied"] for r in results)
    for r in reporters:
        assert abs(r["loss"] - ref["loss"]) <= 1e-5 * max(1.0, abs(ref["loss"])), (r["loss"], ref["loss"])
        assert abs(r["grad_norm"] - ref["grad_norm"]) <= 1e-5 * max(1.0, ref["grad_norm"])
    merged = {}
    for r in results:
        merged.update(r["weights"])
    worst = max((merged[k] - ref["weights"][k]).abs().max().item() for k in ref["weights"])
    assert worst <= 1e-5, worst
