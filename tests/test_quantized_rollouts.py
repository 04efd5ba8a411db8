"""Quantized rollouts (``engine.quantization``): the numerics, the engine, the sync, the probe.

* ``ops/quantize.py`` against hand computations: per-channel and per-token scales, e4m3/e5m2
  round trips within half a unit in the last place, saturation at 448, int8 weight-only;
* the embedded engine's fp8 log-probs equal an independent reference: transformers' own model
  with fake quantization applied by this file's code (not the package's);
* a sync into a quantized engine: its checksums and ``/get_weights_by_name`` are those of what
  was sent, and the quantized copy it generates from is rebuilt from them;
* the trainer's probe (``probe_log_probs`` through ``models.fake_quant``) at TP2 equals the fp8
  engine's prompt log-probs to the fp32 tolerance, while the unquantized probe is far off;
* the mismatch each setting creates on the tiny model (printed), larger than unquantized;
* the pre-flight: SGLang's fp8 refused without CUDA, formats per engine, launch commands.

The short real run with ``engine.quantization=fp8`` is ``test_quantized_demo_run``.
"""

import math

import pytest
import torch

from megatron_grpo.ops.quantize import (QuantScheme, dequantize, fake_quantize, quantize, quantize_weight,
                                        quantized_linear, scales_from, row_absmax)
from megatron_grpo.inference.engine import EmbeddedEngine
from megatron_grpo.inference.quantize import QuantizedLinear
from tests.support.distributed import run_distributed
from tools.tiny import save_tiny_model
from megatron_grpo.wire.checksum import tensor_checksum
from tests.support.engine_runs import run

FP8 = QuantScheme("fp8")
E5M2 = QuantScheme("fp8", "e5m2")
INT8 = QuantScheme("int8")
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]
PROBE = [3, 17, 9, 44, 12, 5, 30, 8, 21, 14, 6, 27, 11, 40, 19, 7]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


# ---- the functions, by hand -------------------------------------------------------------


def test_fp8_weight_scales_and_values_by_hand():
    w = torch.tensor([[3.0, -1.5, 0.1], [0.0, 0.0, 0.0], [-896.0, 1.0, 2.0]])
    q = quantize_weight(w, FP8)
    # one scale per output channel: max |row| / 448 (an all-zero row gets a tiny positive one)
    assert torch.allclose(q.scale[:, 0], torch.tensor([3.0 / 448, 1e-12, 2.0]))
    assert q.q.dtype == torch.float8_e4m3fn and q.scale.shape == (3, 1)
    # row 0: 3 -> 448 and -1.5 -> -224 exactly; 0.1 * 448 / 3 = 14.93 rounds to 15 (spacing 1 in [8, 16))
    assert q.q[0].float().tolist() == [448.0, -224.0, 15.0]
    assert torch.allclose(dequantize(*q, torch.float32)[0], torch.tensor([3.0, -1.5, 15 * 3.0 / 448]))
    assert q.q[1].float().tolist() == [0.0, 0.0, 0.0]
    # row 2: scale 2; 1/2 = 0.5 and 2/2 = 1 are exact in e4m3
    assert dequantize(*q, torch.float32)[2].tolist() == [-896.0, 1.0, 2.0]


def test_fp8_saturates_at_448_and_e5m2_at_57344():
    x = torch.tensor([[1000.0, -1000.0, 448.0, 460.0]])
    assert quantize(x, torch.ones(1, 1), FP8).float().tolist() == [[448.0, -448.0, 448.0, 448.0]]
    assert FP8.qmax == 448.0 and E5M2.qmax == 57344.0 and INT8.qmax == 127.0
    big = torch.tensor([[1e6]])
    assert quantize(big, torch.ones(1, 1), E5M2).float().item() == 57344.0
    assert not torch.isnan(quantize(big, torch.ones(1, 1), FP8).float()).any()  # no NaN from overflow


@pytest.mark.parametrize("scheme, mantissa_bits", [(FP8, 3), (E5M2, 2)])
def test_fp8_round_trip_within_half_an_ulp(scheme, mantissa_bits):
    """Per-token activations: every value whose scaled magnitude is a normal float8 comes back
    within 2^-(m+1) relative (round to nearest); subnormals within half the subnormal spacing."""
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-3, 3, 64).unsqueeze(1)  # rows of very different sizes
    scale = scales_from(row_absmax(x), scheme)
    assert torch.allclose(scale[:, 0], x.abs().amax(1) / scheme.qmax)
    tiny = torch.finfo(torch.float8_e4m3fn if mantissa_bits == 3 else torch.float8_e5m2).tiny
    x[:, :16] = torch.randn(64, 16).clamp(-1, 1) * tiny * scale  # subnormal once scaled (the max is elsewhere)
    back = fake_quantize(x, scheme)
    scaled = x.abs() / scale
    normal = scaled >= tiny
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0 ** -(mantissa_bits + 1) * (1 + 1e-6)
    sub_spacing = tiny * 2.0 ** -mantissa_bits
    assert ((back - x).abs() / scale)[~normal].max() <= sub_spacing / 2 * (1 + 1e-6)
    # the largest value of each row is represented exactly (it maps to qmax)
    idx = x.abs().argmax(1)
    assert torch.allclose(back.gather(1, idx[:, None]), x.gather(1, idx[:, None]), rtol=1e-6)


def test_int8_weight_only_by_hand():
    w = torch.tensor([[127.0, -63.4, 0.6], [2.54, 1.0, -0.01]])
    q = quantize_weight(w, INT8)
    assert q.q.dtype == torch.int8
    assert q.q.tolist() == [[127, -63, 1], [127, 50, 0]]  # 1.0 / (2.54/127) = 50.0, -0.01/0.02 = -0.5 -> -0 (even)
    back = dequantize(*q, torch.float32)
    assert ((back - w).abs() <= q.scale / 2 + 1e-7).all()
    # activations are not quantized: the layer is x @ dequantized(W)^T
    x = torch.randn(3, 3)
    assert torch.allclose(quantized_linear(x, q, None, INT8), x @ back.T)


def test_quantized_linear_is_per_token_fake_quant():
    torch.manual_seed(1)
    w, b, x = torch.randn(16, 32), torch.randn(16), torch.randn(2, 5, 32)
    q = quantize_weight(w, FP8)
    expected = fake_quantize(x, FP8) @ dequantize(*q, torch.float32).T + b
    assert torch.equal(quantized_linear(x, q, b, FP8), expected)
    # each token's scale is its own: scaling one token leaves the others' outputs unchanged
    x2 = x.clone()
    x2[0, 0] *= 1000
    assert torch.equal(quantized_linear(x2, q, b, FP8)[0, 1:], expected[0, 1:])


# ---- the engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2", seed=3)


@pytest.fixture(scope="module")
def fp8_engine(model_dir):
    eng = EmbeddedEngine(model_dir, dtype="float32", max_batch_size=16, seed=0, quantization=FP8)
    yield eng
    eng.shutdown()


def _own_fake_quant(x: torch.Tensor, fp8_dtype, per_row_absmax=None) -> torch.Tensor:
    """This file's own per-row fp8 quantize-dequantize (independent of ops/quantize.py)."""
    fmax = torch.finfo(fp8_dtype).max
    amax = x.abs().amax(-1, keepdim=True).float() if per_row_absmax is None else per_row_absmax
    scale = torch.clamp(amax, min=1e-12 * fmax) / fmax
    return (torch.clamp(x.float() / scale, -fmax, fmax).to(fp8_dtype).float() * scale).to(x.dtype)


def _hf_reference(model_dir, fp8_dtype=None, int8=False):
    """transformers' model, its decoder projections fake-quantized by this file's code."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if fp8_dtype is None and not int8:
        return model
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            with torch.no_grad():
                if int8:
                    s = module.weight.abs().amax(1, keepdim=True) / 127
                    module.weight.copy_(torch.clamp(torch.round(module.weight / s), -127, 127) * s)
                else:
                    module.weight.copy_(_own_fake_quant(module.weight, fp8_dtype))
                    module.register_forward_pre_hook(lambda m, args: (_own_fake_quant(args[0], fp8_dtype),))
    return model


def _reference_logprobs(model, seq, temperature=1.0):
    full = torch.tensor([seq.prompt_ids + seq.output_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(full).logits[0].double() / temperature, dim=-1)
    n = len(seq.prompt_ids)
    return torch.stack([logprobs[n - 1 + i, t] for i, t in enumerate(seq.output_ids)])


def test_engine_quantizes_the_decoder_projections_only(fp8_engine):
    kinds = {name.rsplit(".", 1)[-1]: type(m) for name, m in fp8_engine.model.named_modules()}
    assert all(kinds[p] is QuantizedLinear for p in PROJECTIONS)
    assert kinds["lm_head"] is torch.nn.Linear and kinds["embed_tokens"] is torch.nn.Embedding
    # the served names are the checkpoint's, unchanged by the swap
    assert "model.layers.0.self_attn.q_proj.weight" in fp8_engine._params
    assert "model.layers.0.self_attn.q_proj.bias" in fp8_engine._params


def test_engine_fp8_logprobs_equal_fake_quantized_reference(fp8_engine, model_dir):
    params = {"temperature": 0.8, "max_new_tokens": 10}
    seqs = run(fp8_engine, PROMPTS * 2, params)
    quantized_ref, plain_ref = _hf_reference(model_dir, torch.float8_e4m3fn), _hf_reference(model_dir)
    to_ref, to_plain = [], []
    for s in seqs:
        got = torch.tensor(s.output_logprobs, dtype=torch.float64)
        to_ref.append((got - _reference_logprobs(quantized_ref, s, 0.8)).abs())
        to_plain.append((got - _reference_logprobs(plain_ref, s, 0.8)).abs())
    to_ref, to_plain = torch.cat(to_ref), torch.cat(to_plain)
    print(f"\nfp8 engine vs fake-quantized HF: max {to_ref.max():.2e}; vs unquantized HF: mean {to_plain.mean():.2e}")
    # fp32 up to the accumulation order: a rare activation that lands on the other side of a
    # rounding boundary moves one float8 step, so the bound is 1e-4, not 1e-6
    assert to_ref.max() < 1e-4
    assert to_plain.mean() > 100 * to_ref.mean()


def test_sync_into_quantized_engine_checksums_what_was_sent(fp8_engine, model_dir):
    name = "model.layers.1.mlp.down_proj.weight"
    module = fp8_engine.model.model.layers[1].mlp.down_proj
    before = module.dequantized.clone()
    torch.manual_seed(5)
    sent = {name: torch.randn_like(fp8_engine._params[name]) * 0.05,
            "model.layers.0.self_attn.q_proj.bias": torch.randn(fp8_engine._params[
                "model.layers.0.self_attn.q_proj.bias"].shape)}
    try:
        with fp8_engine.exclusive():
            assert fp8_engine.load_weights(sent.items(), compute_checksums=True) == 2
        got = fp8_engine.checksums(sorted(sent))
        assert {n: v["checksum"] for n, v in got.items()} == {n: tensor_checksum(t) for n, t in sent.items()}
        assert fp8_engine.weights_by_name(name, truncate_size=4) == sent[name][..., :4].tolist()
        # generation reads the quantized copy, rebuilt from what was sent
        assert not torch.equal(module.dequantized, before)
        assert torch.equal(module.dequantized, dequantize(*quantize_weight(sent[name], FP8), torch.float32))
    finally:  # back to the checkpoint for the other tests
        fp8_engine.load_from_disk(str(model_dir))
    assert torch.equal(module.dequantized, before)


# ---- the trainer's probe through the same quantization ----------------------------------


def _probe_worker(rank, world_size, model_dir):
    from megatron_grpo.config import ModelConfig, OptimizerConfig
    from tests.support.policy import build_test_policy
    from megatron_grpo.trainer.megatron_step import ScoringSpec, probe_log_probs

    policy = build_test_policy(ModelConfig(hf_dir=str(model_dir), dtype="float32"), OptimizerConfig(name="sgd"))
    spec = ScoringSpec(temperature=1.0, vocab_size=policy.hf_config.vocab_size)
    weights = [p.detach().clone() for c in policy.modules for p in c.parameters()]
    out = {"fp8": probe_log_probs(policy.chunks, PROBE, spec, FP8),
           "plain": probe_log_probs(policy.chunks, PROBE, spec)}
    # the context restored the trainer's weights bitwise
    assert all(torch.equal(a, p) for a, p in zip(weights, (p for c in policy.modules for p in c.parameters())))
    return out


def test_probe_through_fake_quant_equals_fp8_engine_at_tp2(fp8_engine, model_dir):
    served = run(fp8_engine, [PROBE], {"temperature": 1.0, "max_new_tokens": 1}, logprob_start_len=0)[0]
    engine_lp = torch.tensor(served.input_logprobs[1:], dtype=torch.float64)
    results = run_distributed(_probe_worker, 2, str(model_dir), tp=2, timeout_s=300)
    for r in results:
        fp8 = torch.tensor(r["fp8"], dtype=torch.float64)
        plain = torch.tensor(r["plain"], dtype=torch.float64)
        quantized_diff, plain_diff = float((fp8 - engine_lp).abs().mean()), float((plain - engine_lp).abs().mean())
        print(f"\nprobe vs fp8 engine: through fake quant {quantized_diff:.2e}, unquantized {plain_diff:.2e}")
        assert quantized_diff < 1e-5  # far inside sync.verify_logprob_tolerance (1e-3)
        assert plain_diff > 1e-3  # what the probe would report without the fake quantization


# ---- the mismatch each setting creates ------------------------------------------------


def test_mismatch_by_setting_on_tiny_model(model_dir):
    """Mean |engine - trainer (fp32, unquantized)| log-prob of sampled tokens, per setting."""
    reference = _hf_reference(model_dir)
    params = {"temperature": 1.0, "max_new_tokens": 16}
    mismatch = {}
    for label, scheme in (("none", None), ("int8", INT8), ("fp8-e4m3", FP8), ("fp8-e5m2", E5M2)):
        engine = EmbeddedEngine(model_dir, dtype="float32", max_batch_size=16, seed=0, quantization=scheme)
        try:
            seqs = run(engine, PROMPTS * 4, params)
        finally:
            engine.shutdown()
        diffs = torch.cat([(torch.tensor(s.output_logprobs, dtype=torch.float64)
                            - _reference_logprobs(reference, s)).abs() for s in seqs])
        mismatch[label] = float(diffs.mean())
    print("\nmean |rollout - train| log-prob on the tiny model: "
          + ", ".join(f"{k} {v:.2e}" for k, v in mismatch.items()))
    assert all(math.isfinite(v) for v in mismatch.values())
    assert mismatch["none"] < 1e-5
    assert mismatch["int8"] > 10 * mismatch["none"]
    assert mismatch["fp8-e4m3"] > 3 * mismatch["int8"]
    assert mismatch["fp8-e5m2"] > 1.5 * mismatch["fp8-e4m3"]


# ---- config, pre-flight, launch ---------------------------------------------------------


def test_preflight_and_launch_commands():
    from megatron_grpo.config import ConfigError, ExperimentConfig
    from megatron_grpo.config.base import build_section
    from megatron_grpo.preflight import check_engine, layout_problem
    from megatron_grpo.generation.adapters import ENGINES

    def experiment(**engine):
        return build_section(ExperimentConfig, {
            "model": {"hf_dir": "m"}, "data": {"train_file": "d.jsonl"}, "trainer": {"run_dir": "r"},
            "rollout": {"num_generations": 2, "prompts_per_step": 4}, "engine": engine})

    with pytest.raises(ConfigError, match="engine.fp8_format.*needs quantization: fp8"):
        experiment(fp8_format="e5m2")
    embedded = experiment(quantization="fp8", fp8_format="e5m2")
    check_engine(embedded)
    cmd = ENGINES["embedded"].launch_command(embedded, "/m", "127.0.0.1", 1)
    assert cmd[cmd.index("--quantization") + 1] == "fp8" and cmd[cmd.index("--fp8-format") + 1] == "e5m2"
    assert "--quantization" not in ENGINES["embedded"].launch_command(experiment(), "/m", "127.0.0.1", 1)

    with pytest.raises(ConfigError, match="engine.fp8_format.*'e5m2' is not served by engine.kind='sglang'"):
        check_engine(experiment(kind="sglang", quantization="fp8", fp8_format="e5m2"))
    with pytest.raises(ConfigError, match="engine.quantization.*'int8' is not served by engine.kind='sglang'"):
        check_engine(experiment(kind="sglang", quantization="int8"))
    sglang_cfg = experiment(kind="sglang", quantization="fp8")
    key, message = layout_problem(sglang_cfg, cuda=False, num_gpus=0, ranks_on_node=1)
    assert key == "engine.quantization" and "needs CUDA" in message
    assert layout_problem(sglang_cfg, cuda=True, num_gpus=2, ranks_on_node=1) is None


# ---- a real run ------------------------------------------------------------------------


def test_quantized_demorun(demo, tmp_path):
    """2 steps of `megatron-grpo train` on the demo (TP2, embedded engine, verified syncs) with
    engine.quantization=fp8: finite metrics, the quantization in the resolved config, and a
    mismatch far above the fp32 level an unquantized run logs (< 1e-5, tests/test_sampling_mask.py)."""
    import subprocess

    import yaml

    from tests.support.demo_run import ENV, ROOT, read_metrics, train_cmd

    run_dir = tmp_path / "run"
    proc = subprocess.run(train_cmd(demo, run_dir, 2, "engine.quantization=fp8", "eval.every_n_steps=0",
                                    "logging.plot=false"), cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["engine"]["quantization"] == "fp8"
    records = read_metrics(run_dir)
    assert len(records) == 2
    for r in records:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
        assert r["weight_sync_verified"] == 1  # checksums of what was sent, every sync
        print(f"\nstep {r['step']}: rollout_train_logprobs_abs_diff_mean {r['rollout_train_logprobs_abs_diff_mean']:.2e}, "
              f"k3_kl {r['k3_kl']:.2e}, is_ratio_std {r['is_ratio_std']:.2e}")
        assert r["rollout_train_logprobs_abs_diff_mean"] > 1e-4
        assert r["k3_kl"] > 0 and r["is_ratio_std"] > 1e-3
