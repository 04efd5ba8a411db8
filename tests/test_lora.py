"""LoRA on megatron-core's parallel linears (models/lora.py, docs/lora.md).

* Bad ``model.lora`` configs are refused at load in one line; layouts LoRA cannot train here
  (mixture-of-experts experts, TransformerEngine's fused norm, sequence parallelism, dropout
  at tp > 1) are refused by the pre-flight before a rank starts.
* One LoRA GRPO step (SGD, so any gradient difference shows in the update) at TP2, PP2 and
  TP2xPP2 gives TP1's loss, grad norm, updated adapters and merged weights; DDP and the
  optimizer hold the adapters only.
* The adapters' gradients equal peft's for the same loss (the backward, checked independently).
* The exported peft adapter, loaded onto the HF model by the ``peft`` library, gives the
  Megatron LoRA model's logits (fp32, <= 1e-5) at TP2 and PP2, where the base alone is far off.
"""

import zlib

import pytest
import yaml
import torch

from megatron_grpo.config.base import ConfigError, build_section
from megatron_grpo.config.model import LoraConfig
from megatron_grpo.models.lora import LoraSpec, lora_problem, resolve_targets
from tests.support.distributed import run_distributed
from tools.tiny import tiny_config

RANK, ALPHA = 4, 8.0


@pytest.mark.parametrize("raw,key,words", [
    ({"rank": 0}, "model.lora.rank", ">= 1"),
    ({"alpha": 0}, "model.lora.alpha", "> 0"),
    ({"alpha": -2.0}, "model.lora.alpha", "> 0"),
    ({"dropout": 1.0}, "model.lora.dropout", "[0, 1)"),
    ({"target_modules": ["q_proj"]}, "model.lora.target_modules", "linear_qkv"),
    ({"target_modules": []}, "model.lora.target_modules", "at least one"),
    ({"target_modules": ["linear_qkv", "linear_qkv"]}, "model.lora.target_modules", "twice"),
    ({"ranks": 8}, "model.lora", "ranks"),
])
def test_bad_lora_config_is_one_line(raw, key, words):
    with pytest.raises(ConfigError) as e:
        build_section(LoraConfig, raw, "model.lora")
    line = e.value.one_line()
    assert "\n" not in line and key in line and words in line, line


@pytest.mark.parametrize("written, kept", [("all-linear", ["all-linear"]), ("linear_qkv", ["linear_qkv"]),
                                            (["all-linear"], ["all-linear"])])
def test_target_modules_may_be_one_name_as_peft_takes_it(written, kept, tmp_path):
    """Issue 64: ``target_modules: all-linear`` (PEFT's string form) was refused with "expected a
    list"; one name alone is that name's list, from a file and from the command line."""
    from megatron_grpo.config import load_config
    from tests.support.configs import BASE

    assert build_section(LoraConfig, {"target_modules": written}, "model.lora").target_modules == kept
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({**BASE, "model": {**BASE["model"], "lora": {"target_modules": written}}}))
    assert load_config(path).model.lora.target_modules == kept
    if isinstance(written, str):
        assert load_config(tmp_path / "c.yaml", [f"model.lora.target_modules={written}"]).model.lora.target_modules \
            == kept


def test_targets_resolve_in_megatron_order():
    assert resolve_targets(["all-linear"]) == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert resolve_targets(["linear_fc2", "linear_qkv"]) == ("linear_qkv", "linear_fc2")
    spec = LoraSpec(rank=8, alpha=16, dropout=0.0, targets=resolve_targets(["linear_qkv", "linear_fc1"]))
    assert spec.scale == 2.0
    assert spec.hf_target_modules() == ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]


def test_layouts_lora_cannot_train_are_refused():
    dense = tiny_config("qwen2")
    spec = LoraSpec(rank=4, alpha=8, dropout=0.0, targets=resolve_targets(["all-linear"]))
    ok = dict(tp=2, attention_backend="sdpa", sequence_parallel=False)
    assert lora_problem(spec, dense, **ok) is None
    moe = tiny_config("qwen3_moe")
    key, message = lora_problem(spec, moe, **ok)
    assert key == "model.lora.target_modules" and "linear_fc1, linear_fc2" in message and "experts" in message
    attention_only = LoraSpec(rank=4, alpha=8, dropout=0.0, targets=("linear_qkv", "linear_proj"))
    assert lora_problem(attention_only, moe, **ok) is None  # the attention of an MoE model is adapted
    assert lora_problem(spec, dense, **{**ok, "attention_backend": "te"})[0] == "model.lora"
    assert lora_problem(spec, dense, **{**ok, "sequence_parallel": True})[0] == "model.lora"
    dropout = LoraSpec(rank=4, alpha=8, dropout=0.1, targets=spec.targets)
    assert lora_problem(dropout, dense, **ok)[0] == "model.lora.dropout"
    assert lora_problem(dropout, dense, **{**ok, "tp": 1}) is None


# ---- distributed ---------------------------------------------------------------------------

def set_nonzero_b(chunks, hf_config):
    """Give every B a value that does not depend on the layout: drawn per HF module (seeded by
    its name) in HF layout, then sliced by the base weight's own layout for this TP rank. With
    B != 0, A gets a gradient too (at B = 0 it would not)."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.models.weights import chunk_params

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for chunk in chunks:
        for m, param in chunk_params(chunk, hf_config):
            adapter = getattr(param, "lora_adapter", None)
            if adapter is None:
                continue
            rows = m.layout.from_shards([param.detach()] * tp)  # only the HF shapes are used
            parts = [torch.randn(t.shape[0], RANK, generator=torch.Generator().manual_seed(zlib.crc32(n.encode())))
                     * 0.05 for n, t in zip(m.hf_names, rows)]
            with torch.no_grad():
                b = m.layout.to_shard(parts, tp_rank, tp) if adapter.kind == "column" else parts[0]
                adapter.lora_B.copy_(b)


def _lora_step(rank, world, hf_dir, recompute=False):
    from megatron.core import parallel_state as ps

    from megatron_grpo.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from megatron_grpo.models import iter_hf_weights
    from megatron_grpo.models.lora import iter_adapters
    from megatron_grpo.models.lora_export import iter_lora_weights
    from megatron_grpo.models.weights import exports_weights
    from tests.support.batches import random_train_batch
    from tests.support.policy import build_test_policy
    from megatron_grpo.rollout.batch import dp_shard
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs, train_mini_batch

    lora = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["all-linear"])
    policy = build_test_policy(ModelConfig(hf_dir=hf_dir, dtype="float32", lora=lora, recompute_activations=recompute),
                               OptimizerConfig(name="sgd", lr=1.0, clip_grad=0.0))
    set_nonzero_b(policy.modules, policy.hf_config)
    algo = AlgorithmConfig(eps_clip_high=0.28, off_policy_correction={"tis_ratio_type": "token"})
    spec = ScoringSpec(temperature=0.7, vocab_size=policy.hf_config.vocab_size)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    full = random_train_batch(8)
    local = dp_shard(full, dp_rank, dp, 8)
    old = compute_log_probs(policy.chunks, local, 2, spec)
    local.old_log_probs = old if old is not None else torch.zeros_like(local.rollout_log_probs)
    metrics, applied, grad_norm = train_mini_batch(
        policy.chunks, policy.optimizer, local, algo, spec, 2, int(full.loss_mask.sum()),
        full.num_sequences, dp, ps.get_data_parallel_group())
    adapters = dict(iter_lora_weights(policy.modules, policy.hf_config)) if exports_weights() else {}
    merged = {k: v.clone() for k, v in iter_hf_weights(policy.modules, policy.hf_config)}
    adapter_params = {id(p) for _, a in iter_adapters(policy.modules) for p in a.parameters()}
    optimized = [p for g in policy.optimizer.param_groups for p in g["params"]]
    buffers = sum(b.grad_data.numel() for c in policy.chunks for b in c.buffers)
    return {"metrics": metrics, "applied": applied, "grad_norm": grad_norm, "adapters": adapters,
            "merged": merged, "optimized_are_adapters": {id(p) for p in optimized} == adapter_params,
            "grad_buffer": buffers, "adapter_numel": sum(a.lora_A.numel() + a.lora_B.numel()
                                                         for _, a in iter_adapters(policy.modules))}


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from tools.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("hf"), "qwen2", seed=1))


@pytest.fixture(scope="module")
def reference(tiny_hf):
    (ref,) = run_distributed(_lora_step, 1, tiny_hf, tp=1, pp=1, timeout_s=300)
    return ref


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """A 4-layer model (pp2 x vpp2 needs a layer per virtual stage) and its TP1 step."""
    from tools.tiny import save_tiny_model

    hf_dir = str(save_tiny_model(tmp_path_factory.mktemp("hf4"), "llama", seed=2, num_layers=4))
    (ref,) = run_distributed(_lora_step, 1, hf_dir, tp=1, pp=1, timeout_s=300)
    return hf_dir, ref


@pytest.mark.slow
def test_only_the_adapters_are_trained(reference, tiny_hf):
    from safetensors.torch import load_file

    assert reference["applied"] and reference["optimized_are_adapters"]
    # DDP's gradient buffer holds the adapters and nothing else (the frozen base has none)
    assert reference["grad_buffer"] == reference["adapter_numel"]
    # both A and B moved (B != 0 before the step, so A had a gradient)
    assert reference["metrics"]["loss"] != 0
    base = load_file(f"{tiny_hf}/model.safetensors")
    moved = [k for k, v in reference["merged"].items() if not torch.equal(v, base[k].float())]
    assert any("q_proj" in k for k in moved) and any("down_proj" in k for k in moved)
    assert not any("norm" in k or "embed" in k for k in moved)  # frozen: bitwise unchanged


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,pp", [(2, 2, 1), (2, 1, 2), (4, 2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_lora_step_matches_tp1(tiny_hf, reference, world, tp, pp):
    _assert_same_step(run_distributed(_lora_step, world, tiny_hf, tp=tp, pp=pp, timeout_s=300), reference)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,vpp,recompute", [(1, 2, 2, False), (2, 1, None, True)], ids=["pp2xvpp2", "tp2-recompute"])
def test_lora_step_with_virtual_pipeline_and_recomputation(four_layers, tp, pp, vpp, recompute):
    """The interleaved schedule (adapters in every model chunk) and full activation
    recomputation (the forward hook re-run inside megatron's checkpoint) give TP1's step."""
    hf_dir, reference = four_layers
    results = run_distributed(_lora_step, 2, hf_dir, recompute, tp=tp, pp=pp, vpp=vpp, timeout_s=300)
    _assert_same_step(results, reference)


def _assert_same_step(results, reference):
    ref_m = reference["metrics"]
    reporters = [r for r in results if r["metrics"] is not None]
    assert reporters
    for r in reporters:
        assert r["applied"] and r["optimized_are_adapters"]
        assert abs(r["metrics"]["loss"] - ref_m["loss"]) <= 1e-5 * max(1, abs(ref_m["loss"]))
        assert abs(r["grad_norm"] - reference["grad_norm"]) <= 1e-5 * max(1, reference["grad_norm"]), (
            r["grad_norm"], reference["grad_norm"])
    adapters = {k: v for r in results for k, v in r["adapters"].items()}
    assert set(adapters) == set(reference["adapters"])
    assert max((adapters[k] - v).abs().max().item() for k, v in reference["adapters"].items()) <= 1e-6
    merged = {k: v for r in results for k, v in r["merged"].items()}
    assert set(merged) == set(reference["merged"])
    assert max((merged[k] - v).abs().max().item() for k, v in reference["merged"].items()) <= 1e-5


def _peft_equivalence(rank, world, hf_dir, out_dir):
    from transformers import AutoModelForCausalLM

    from megatron_grpo.config import ModelConfig, OptimizerConfig
    from megatron_grpo.models.lora_export import peft_logits, save_peft_adapter
    from megatron_grpo.models.self_check import megatron_logits_on_rank0, probe_input_ids
    from tests.support.policy import build_test_policy

    lora = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["all-linear"])
    policy = build_test_policy(ModelConfig(hf_dir=hf_dir, dtype="float32", lora=lora), OptimizerConfig(name="sgd"))
    set_nonzero_b(policy.modules, policy.hf_config)
    spec = policy.modules[0].lora_spec
    ids = probe_input_ids(policy.hf_config.vocab_size)
    ours = megatron_logits_on_rank0(policy.modules, policy.hf_config, ids)
    save_peft_adapter(policy.modules, policy.hf_config, out_dir, spec=spec, base_model_name_or_path=hf_dir)
    if rank != 0:
        return None
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(input_ids=ids).logits
    return {"peft": (ours - peft_logits(hf_dir, out_dir, ids)).abs().max().item(),
            "base": (ours - base).abs().max().item()}


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_peft_loads_the_exported_adapter(tiny_hf, tmp_path, tp, pp):
    import json

    out = tmp_path / "adapter"
    result = run_distributed(_peft_equivalence, 2, tiny_hf, str(out), tp=tp, pp=pp, timeout_s=300)[0]
    assert result["peft"] <= 1e-5, result
    assert result["base"] > 0.05, result  # the adapters change the logits: the comparison is not vacuous
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _gradients_vs_peft(rank, world, hf_dir, out_dir):
    """Gradients of A and B of the Megatron LoRA model and of the exported adapter loaded by
    peft, for the same loss (a fixed random projection of the logits)."""
    from megatron_grpo.config import ModelConfig, OptimizerConfig
    from megatron_grpo.models.forward import causal_logits
    from megatron_grpo.models.lora import iter_adapters
    from megatron_grpo.models.lora_export import save_peft_adapter
    from megatron_grpo.models.self_check import probe_input_ids
    from tests.support.policy import build_test_policy

    lora = LoraConfig(rank=RANK, alpha=ALPHA, target_modules=["all-linear"])
    policy = build_test_policy(ModelConfig(hf_dir=hf_dir, dtype="float32", lora=lora), OptimizerConfig(name="sgd"))
    set_nonzero_b(policy.modules, policy.hf_config)
    save_peft_adapter(policy.modules, policy.hf_config, out_dir, spec=policy.modules[0].lora_spec,
                      base_model_name_or_path=hf_dir)
    ids = probe_input_ids(policy.hf_config.vocab_size)
    (chunk,) = policy.modules
    logits = causal_logits(chunk, ids)[..., : policy.hf_config.vocab_size]  # [B, S, V], megatron's [S, B] undone
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))
    (logits.float() * weights).sum().backward()
    ours = {}
    for key, adapter in iter_adapters(policy.modules):
        # megatron's DDP moves each gradient into its fp32 buffer (main_grad)
        ours[key] = (adapter.lora_A.main_grad.clone(), adapter.lora_B.main_grad.clone())

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), out_dir,
                                      is_trainable=True)
    (model(input_ids=ids).logits.float() * weights).sum().backward()
    theirs = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return ours, theirs, policy.hf_config.num_hidden_layers


@pytest.mark.slow
def test_adapter_gradients_equal_peft(tiny_hf, tmp_path):
    """The backward, checked independently: dL/dA and dL/dB of every Megatron adapter equal
    peft's for the same loss (a fused adapter's A serves q, k and v: its gradient is the sum
    of peft's three; its B's rows are peft's q, k and v B-gradients in the fused layout)."""
    from megatron_grpo.models.architectures import get_architecture
    from megatron_grpo.models.hf_config import load_hf_config
    from megatron_grpo.models.lora import adapter_key
    from megatron_grpo.models.lora_export import peft_names

    ours, theirs, num_layers = run_distributed(_gradients_vs_peft, 1, tiny_hf, str(tmp_path / "adapter"),
                                               tp=1, pp=1, timeout_s=300)[0]
    hf_config = load_hf_config(tiny_hf)
    arch = get_architecture(hf_config.model_type)
    worst = 0.0
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        mappings = {m.megatron_name.rsplit(".", 2)[-2]: m
                    for m in arch.layer_mappings(layer, layer, hf_config, None) if m.megatron_name.endswith("weight")}
        for target in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
            m = mappings[target]
            grad_a, grad_b = ours[adapter_key(layer, target)]
            names = [peft_names(n) for n in m.hf_names]
            assert all(n.startswith(f"base_model.model.{prefix}") for n, _ in names)
            peft_a = sum(theirs[f"{a[:-len('.weight')]}.default.weight"] for a, _ in names)
            peft_b = m.layout.to_shard([theirs[f"{b[:-len('.weight')]}.default.weight"] for _, b in names], 0, 1)
            for g, ref in ((grad_a, peft_a), (grad_b, peft_b)):  # relative to the gradient's scale
                worst = max(worst, ((g - ref).abs().max() / ref.abs().max()).item())
            assert grad_a.abs().max() > 0 and grad_b.abs().max() > 0
    assert worst <= 1e-5, worst  # fp32 summation order (measured 4.7e-7)


def test_a_resume_with_the_other_kind_of_weights_names_lora(tmp_path):
    """Issue 64: a LoRA checkpoint resumed without ``model.lora`` (and the reverse) failed inside
    megatron-core without naming LoRA; ``lora_mismatch`` says which side holds what, and how out."""
    import json

    from megatron_grpo.models.checkpoint import META_FILE, lora_mismatch
    from megatron_grpo.models.lora import LoraSpec

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (run / "config.yaml").write_text("")
    spec = LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=("linear_qkv", "linear_proj"))
    saved = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["linear_qkv", "linear_proj"], "init_seed": 0}
    (ckpt / META_FILE).write_text(json.dumps({"lora": saved}))
    way_out = f"as in the run's {run / 'config.yaml'} to resume it, or checkpoint.resume: never to start over"
    assert lora_mismatch(ckpt, spec) is None
    assert lora_mismatch(ckpt, None) == ("it holds LoRA adapters (rank 4, targets linear_qkv, linear_proj) and the "
                                         f"config sets no model.lora: set model.lora {way_out}")
    assert lora_mismatch(ckpt, LoraSpec(rank=8, alpha=8.0, dropout=0.0, targets=("linear_qkv", "linear_proj"))) == (
        "its LoRA adapters have rank 4 and targets linear_qkv, linear_proj, model.lora here rank 8 and targets "
        f"linear_qkv, linear_proj: set model.lora {way_out}")
    (ckpt / META_FILE).write_text(json.dumps({"format": "megatron_grpo.model_checkpoint"}))
    assert lora_mismatch(ckpt, None) is None
    assert lora_mismatch(ckpt, spec) == ("it holds the whole model (a run without LoRA) and the config sets "
                                         f"model.lora: unset it {way_out}")
