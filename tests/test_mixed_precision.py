"""bf16 training on CPU through megatron-core's mixed-precision optimizer.

* one bf16 GRPO step at TP2, PP2 and DP2 equals the TP1 bf16 step within bf16 tolerance, and
  the step really is mixed precision: bf16 parameters, fp32 main copies, fp32 gradient
  buffers, the bf16 parameters equal to the rounded main copies after the step;
* the fp32 main weights and the fp32 Adam state survive a checkpoint save/resume bitwise
  (and are not recoverable from the bf16 parameters: the checkpoint must hold them);
* an fp32 engine fed by a bf16 trainer receives exactly the main weights (cast once), not
  the bf16 parameters.

Tolerance of the step comparison (``STEP_RTOL``): bf16 keeps 8 significant bits (relative
rounding up to 2^-9 ~ 2e-3 per operation). TP, PP and DP change where the bf16 activations
are rounded and in which order partial results are summed (TP's row-parallel all-reduce sums
bf16 partial outputs; the fp32 gradient buffers are reduced in another order), so each layer
adds a few 2^-9 relative differences to the gradient. Measured on the tiny model (SGD, lr 1:
the update is the gradient): the worst weight difference is 6e-3 of the largest update at TP2
(1.2e-4 vs 2.0e-2) and 0 at PP2 and DP2 (the same bf16 operations per sequence, fp32
reduction). ``STEP_RTOL = 5e-2`` leaves margin for other sizes while a real error (a gradient
counted twice over DP, a missing TP reduction: an error of order 1 of the update) fails it.
"""

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.step_equivalence import policy_step
from megatron_grpo.config import EngineConfig, SyncConfig
from tests.support.configs import experiment

N_SEQ, GLOBAL_BATCH, MICRO = 8, 8, 2
STEP_RTOL = 5e-2


def _batch():
    from tests.support.batches import random_train_batch

    return random_train_batch(N_SEQ)


def _policy(hf_dir, optimizer):
    from megatron_grpo.config import ModelConfig
    from tests.support.policy import build_test_policy

    return build_test_policy(ModelConfig(hf_dir=hf_dir, dtype="bfloat16"), optimizer)


def _model_params(policy):
    return [p for c in policy.modules for p in c.parameters() if p.requires_grad]


def _bf16_step(rank, world, hf_dir):
    from megatron_grpo.config import OptimizerConfig
    from megatron_grpo.models import iter_hf_weights

    # SGD: the update is the gradient, so any gradient difference shows.
    policy = _policy(hf_dir, OptimizerConfig(name="sgd", lr=1.0, clip_grad=0.0))
    params = _model_params(policy)
    initial = {k: v.clone() for k, v in iter_hf_weights(policy.modules, policy.hf_config)}
    metrics, applied, grad_norm = policy_step(policy)
    # the mixed-precision structure, on every rank
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert all(p.main_param.dtype == torch.float32 for p in params)  # fp32 main weights
    assert all(p.main_grad.dtype == torch.float32 for p in params)  # fp32 grad accumulation/reduction
    assert all(torch.equal(p, p.main_param.to(torch.bfloat16)) for p in params)  # bf16 = rounded main
    weights = {k: v.clone() for k, v in iter_hf_weights(policy.modules, policy.hf_config)}
    assert all(v.dtype == torch.float32 for v in weights.values())  # exported: the main weights
    return {"metrics": metrics, "applied": applied, "grad_norm": grad_norm, "weights": weights, "initial": initial}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tools.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("hf"), "qwen2", seed=1))


@pytest.fixture(scope="module")
def reference(tiny_hf):
    (ref,) = run_distributed(_bf16_step, 1, tiny_hf, tp=1, pp=1, timeout_s=300)
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 1)], ids=["tp2", "pp2", "dp2"])
def test_bf16_step_matches_tp1(tiny_hf, reference, tp, pp):
    results = run_distributed(_bf16_step, 2, tiny_hf, tp=tp, pp=pp, timeout_s=300)
    ref_m = reference["metrics"]
    assert reference["applied"]
    update = max((reference["weights"][k] - v).abs().max().item() for k, v in reference["initial"].items())
    assert update > 0
    weights = {}
    for r in results:
        weights.update(r["weights"])
    assert set(weights) == set(reference["weights"])
    worst = max((weights[k] - reference["weights"][k]).abs().max().item() for k in weights)
    assert worst <= STEP_RTOL * update, (worst, update)
    for r in (r for r in results if r["metrics"] is not None):
        assert r["applied"]
        assert abs(r["metrics"]["loss"] - ref_m["loss"]) <= STEP_RTOL * max(abs(ref_m["loss"]), 1e-2)
        assert abs(r["grad_norm"] - reference["grad_norm"]) <= STEP_RTOL * reference["grad_norm"]


def _save_resume(rank, world, hf_dir, run_dir):
    from pathlib import Path

    from megatron_grpo.config import OptimizerConfig
    from megatron_grpo.trainer.checkpoint import load_training_checkpoint, save_training_checkpoint

    # Adam at a small lr: the first step moves every weight by ~lr, below bf16's resolution
    # for most of them, so the fp32 main weights differ from the bf16 parameters.
    opt = OptimizerConfig(name="adam", lr=1e-4, clip_grad=0.0)
    policy = _policy(hf_dir, opt)
    policy_step(policy)
    params = _model_params(policy)
    main = [p.main_param.detach().clone() for p in params]
    state = [{k: v.clone() for k, v in policy.optimizer.optimizer.state[p.main_param].items()} for p in params]
    assert all(s["exp_avg"].dtype == torch.float32 and s["exp_avg_sq"].dtype == torch.float32 for s in state)
    lost_by_rounding = sum(int((m != p.detach().float()).sum()) for m, p in zip(main, params))
    ckpt = save_training_checkpoint(run_dir, 1, policy.modules, policy.optimizer, {"step": 1}, keep_last=1)

    fresh = _policy(hf_dir, opt)  # starts again from the HF weights
    load_training_checkpoint(Path(ckpt), fresh.modules, fresh.optimizer)
    fresh_params = _model_params(fresh)
    return {
        "lost_by_rounding": lost_by_rounding,
        "main_equal": all(torch.equal(a, p.main_param) and a.dtype == p.main_param.dtype == torch.float32
                          for a, p in zip(main, fresh_params)),
        "state_equal": all(torch.equal(s[k], fresh.optimizer.optimizer.state[p.main_param][k])
                           for s, p in zip(state, fresh_params) for k in ("exp_avg", "exp_avg_sq")),
        "params_equal": all(torch.equal(a, b) for a, b in zip(params, fresh_params)),
    }


@pytest.mark.slow
def test_fp32_main_weights_survive_resume_bitwise(tiny_hf, tmp_path):
    results = run_distributed(_save_resume, 2, tiny_hf, str(tmp_path / "run"), tp=2, pp=1, timeout_s=300)
    for r in results:
        assert r["lost_by_rounding"] > 0  # the bf16 parameters alone could not restore the main weights
        assert r["main_equal"] and r["state_equal"] and r["params_equal"], r


def _save_before_the_first_step(rank, world, hf_dir, run_dir, dtype):
    """A checkpoint written before any optimizer step (every step so far skipped: no group had
    a learning signal, or a stop came first) resumes, and the resumed policy's first step is
    the uninterrupted one's."""
    from pathlib import Path

    from megatron_grpo.config import ModelConfig, OptimizerConfig
    from megatron_grpo.trainer.checkpoint import load_training_checkpoint, save_training_checkpoint
    from tests.support.policy import build_test_policy

    opt = OptimizerConfig(name="adam", lr=1e-3, clip_grad=0.0)
    policy = build_test_policy(ModelConfig(hf_dir=hf_dir, dtype=dtype), opt)
    ckpt = save_training_checkpoint(run_dir, 1, policy.modules, policy.optimizer, {"step": 1}, keep_last=1)
    resumed = build_test_policy(ModelConfig(hf_dir=hf_dir, dtype=dtype), opt)
    load_training_checkpoint(Path(ckpt), resumed.modules, resumed.optimizer)
    policy_step(policy)
    policy_step(resumed)
    return all(torch.equal(a, b) for a, b in zip(_model_params(policy), _model_params(resumed)))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_checkpoint_saved_before_the_first_step_resumes(tiny_hf, tmp_path, dtype):
    results = run_distributed(_save_before_the_first_step, 2, tiny_hf, str(tmp_path / "run"), dtype, tp=2, pp=1,
                              timeout_s=300)
    assert results == [True, True]


# name in the engine -> how to read it from the policy's main weights (direct mappings, TP1)
_DIRECT = {
    "model.norm.weight": lambda m: m.decoder.final_layernorm.weight,
    "model.layers.1.mlp.down_proj.weight": lambda m: m.decoder.layers[1].mlp.linear_fc2.weight,
    "model.embed_tokens.weight": lambda m: m.embedding.word_embeddings.weight,
}


def _sync_into_engine(rank, world, hf_dir, url):
    from megatron_grpo.config import OptimizerConfig
    from megatron_grpo.generation import RolloutClient
    from megatron_grpo.sync.driver import WeightSync
    from megatron_grpo.sync.servers import ServerDelivery

    policy = _policy(hf_dir, OptimizerConfig(name="adam", lr=1e-4, clip_grad=0.0))
    policy_step(policy)
    client = RolloutClient([url], request_timeout_s=120)
    cfg = experiment(engine=EngineConfig(request_timeout_s=120), sync=SyncConfig(transport="distributed"))
    syncer = WeightSync(cfg, policy.hf_config, ServerDelivery(cfg, [url], policy.hf_config, client=client))
    stats = syncer.sync(policy.modules, 1)  # verified: the engine's checksums match what was sent
    syncer.close()
    (module,) = policy.modules
    vocab = policy.hf_config.vocab_size
    out = {"verified": stats.verified}
    for name, get in _DIRECT.items():
        param = get(module)
        served = torch.tensor(client.call("get_weights_by_name", {"name": name, "truncate_size": 1 << 20}),
                              dtype=torch.float32)
        main = param.main_param.detach()[:vocab] if "embed" in name else param.main_param.detach()
        bf16 = param.detach().float()[: main.shape[0]]
        out[name] = (torch.equal(served, main), torch.equal(served, bf16))
    client.close()
    return out


@pytest.mark.slow
def test_fp32_engine_receives_the_main_weights(tiny_hf, tmp_path):
    from megatron_grpo.generation.manager import RolloutServerManager

    cfg = experiment(engine=EngineConfig(dtype="float32", launch_timeout_s=180))
    with RolloutServerManager(cfg, model_dir=tiny_hf, run_dir=tmp_path) as manager:
        (r,) = run_distributed(_sync_into_engine, 1, tiny_hf, manager.urls[0], tp=1, pp=1, timeout_s=300)
    assert r.pop("verified")
    for name, (equals_main, equals_bf16) in r.items():
        assert equals_main, name  # exactly the fp32 main weights (the cast to fp32 is exact)
        assert not equals_bf16, name  # not the bf16 parameters widened
