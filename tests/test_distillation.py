"""On-policy distillation (``distillation:``, losses/distill.py, the trainer's teacher).

* The loss: the advantage form equals the policy loss of the hand-built per-token advantage
  A + coef (lt - lo); the loss form equals the policy loss plus coef x the seq-mean-token-mean of
  the KL estimate, computed row by row; a teacher identical to the student gives a distillation
  advantage of exactly zero (and, without the task reward, a zero loss and gradient).
* The teacher in the trainer (megatron-core on gloo, TP2 / PP2 / DP2): its log-probs equal
  transformers' full-vocabulary log-softmax of the teacher's logits divided by the SAMPLING
  temperature (the convention the student is scored at; at temperature 1 they would differ),
  for a teacher deeper than the student; after an update no gradient reached it (no ``.grad``,
  not in the optimizer, its weights bit-identical); a teacher equal to the student scores the
  student's old log-probs bit for bit.
* The config and the pre-flight: the refusals, and a teacher whose tokenizer or chat template is
  not the student's refused in one line naming both folders.
* The run (`megatron-grpo train` on the demo): pure distillation from an identical teacher (its
  reverse KL exactly 0 at the first step, the teacher check logged, the teacher's time split
  out); a LoRA student in bf16 on asynchronous rollouts with packed rows; and a teacher check
  past its tolerance ending the run with one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.config import AlgorithmConfig
from megatron_grpo.config.base import ConfigError, ConfigValueError
from megatron_grpo.config.distillation import DistillationConfig
from megatron_grpo.losses import compute_policy_loss
from megatron_grpo.losses.kl import KL_ESTIMATORS
from megatron_grpo.trainer.teacher import compare
from tests.support.cp_cases import BATCHES
from tests.support.demo_run import ENV, ROOT, demo_overrides, read_metrics
from tests.support.distributed import run_distributed

TEMPERATURE = 0.7


def _inputs(seed: int = 0, rows: int = 4, width: int = 9):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(rows, width, generator=g, dtype=torch.float64) * 3).requires_grad_()
    lo = lp.detach() + 0.05 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    lt = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(rows, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, width, generator=g) > 0.3).double()
    mask[0] = 0  # a row with nothing to train
    return lp, lo, lt, adv, mask


ALGO = AlgorithmConfig(eps_clip_high=0.28)


def _loss(lp, lo, adv, mask, teacher=None, distill=None, algo=ALGO):
    return compute_policy_loss(lp, lo, adv, mask, algo, teacher_log_probs=teacher, distillation=distill,
                               num_tokens=int(mask.sum()), num_sequences=mask.shape[0])


def _grad(loss, lp):
    (g,) = torch.autograd.grad(loss, lp)
    return g


# ---- the loss ----------------------------------------------------------------------------------
@pytest.mark.parametrize("task_reward", [True, False])
def test_advantage_form_is_the_policy_loss_of_the_per_token_advantage(task_reward):
    lp, lo, lt, adv, mask = _inputs()
    cfg = DistillationConfig(teacher="t", coef=0.5, task_reward=task_reward)
    loss, metrics = _loss(lp, lo, adv, mask, lt, cfg)
    per_token = (adv[:, None] if task_reward else torch.zeros_like(lt)) + 0.5 * (lt - lo)
    expected, _ = _loss(lp, lo, per_token * mask, mask)
    assert torch.equal(loss, expected)
    assert torch.equal(_grad(loss, lp), _grad(_loss(lp, lo, per_token * mask, mask)[0], lp))
    valid = mask > 0
    assert metrics["distill/reverse_kl"] == pytest.approx(float((lo - lt)[valid].mean()), abs=1e-12)
    assert metrics["distill/advantage"] == pytest.approx(float((0.5 * (lt - lo))[valid].mean()), abs=1e-12)
    assert metrics["distill/logprob_gap_abs"] == pytest.approx(float((lo - lt)[valid].abs().mean()), abs=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_loss_form_adds_the_kl_to_the_teacher_row_by_row(estimator):
    lp, lo, lt, adv, mask = _inputs(seed=1)
    cfg = DistillationConfig(teacher="t", form="loss", coef=0.3, kl_estimator=estimator)
    loss, _ = _loss(lp, lo, adv, mask, lt, cfg)
    plain, _ = _loss(lp, lo, adv, mask)
    kl = KL_ESTIMATORS.get(estimator)(lp, lt)
    rows = [(kl[i] * mask[i]).sum() / mask[i].sum().clamp(min=1) for i in range(mask.shape[0])]
    expected = plain + 0.3 * torch.stack(rows).sum() / mask.shape[0]
    assert torch.allclose(loss, expected, rtol=0, atol=1e-12)
    assert torch.allclose(_grad(loss, lp), _grad(expected, lp), rtol=0, atol=1e-12)


def test_identical_teacher_gives_exactly_zero_distillation_advantage():
    lp, _, _, adv, mask = _inputs(seed=2)
    lo = lp.detach().clone()
    with_task, metrics = _loss(lp, lo, adv, mask, lo.clone(), DistillationConfig(teacher="t"))
    plain, _ = _loss(lp, lo, adv, mask)
    assert metrics["distill/advantage"] == 0.0 and metrics["distill/reverse_kl"] == 0.0
    assert torch.equal(with_task, plain) and torch.equal(_grad(with_task, lp), _grad(plain, lp))
    pure, _ = _loss(lp, lo, adv, mask, lo.clone(), DistillationConfig(teacher="t", task_reward=False))
    assert float(pure.detach()) == 0.0 and torch.count_nonzero(_grad(pure, lp)) == 0


def test_teacher_log_probs_and_config_go_together():
    lp, lo, lt, adv, mask = _inputs()
    with pytest.raises(ValueError, match="go together"):
        _loss(lp, lo, adv, mask, lt, None)
    with pytest.raises(ValueError, match="go together"):
        _loss(lp, lo, adv, mask, None, DistillationConfig(teacher="t"))


def test_teacher_check_compares_response_tokens_only():
    ours = torch.zeros(2, 4)
    ref = torch.tensor([[0.0, 0.5, 9.0, 0.0], [0.0, 0.0, 0.0, float("nan")]])
    mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 0]])
    found = compare(ours, ref, mask)
    assert (found.mean_abs_diff, found.max_abs_diff, found.tokens) == (pytest.approx(0.5 / 3), 0.5, 3)
    assert compare(ours, ref, torch.ones(2, 4)).max_abs_diff == float("inf")  # NaN is a failure


# ---- the config --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, key", [
    ({"teacher": "t", "coef": 0.0}, "coef"),
    ({"teacher": "t", "verify_every": -1}, "verify_every"),
    ({"teacher": "t", "verify_tolerance": 0.0}, "verify_tolerance"),
    ({"teacher_megatron_ckpt": "ckpt"}, "teacher_megatron_ckpt"),
])
def test_config_refusals(kwargs, key):
    with pytest.raises(ConfigValueError) as e:
        DistillationConfig(**kwargs)
    assert e.value.key == key


def test_pure_distillation_refuses_dynamic_sampling():
    from tests.support.configs import BASE, experiment  # noqa: F401
    from megatron_grpo.config.experiment import apply_overrides
    from megatron_grpo.preflight.load import build_experiment

    raw = apply_overrides(BASE, ["distillation.teacher=t", "distillation.task_reward=false",
                                 "rollout.dynamic_sampling.enabled=true"])
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling.enabled"):
        build_experiment(raw)
    assert build_experiment(apply_overrides(BASE, ["distillation.teacher=t"])).distillation.enabled


# ---- the teacher in the trainer ----------------------------------------------------------------
@pytest.fixture(scope="module")
def student_dir(tmp_path_factory):
    from tools.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("student"), "qwen2", seed=1))


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Deeper and wider than the student, other weights; the same tokenizer."""
    from tools.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("teacher"), "qwen2", seed=7, num_layers=4, hidden_size=96,
                               intermediate_size=192, num_heads=4, num_kv_heads=2))


def _distill_step(rank, world, student, teacher, form="advantage"):
    """The trainer's teacher pass and one SGD update with the distillation term on BATCHES["long"]
    (this DP rank's rows). Returns the teacher's log-probs (last stage), the teacher's
    parameters' state after the update, the policy's old log-probs and the step's metrics."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.config import ModelConfig, OptimizerConfig
    from megatron_grpo.config.model import ParallelConfig
    from megatron_grpo.rollout.batch import dp_shard
    from megatron_grpo.trainer.components import build_policy
    from megatron_grpo.trainer.teacher import build_teacher
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs, train_mini_batch
    from megatron_grpo.trainer.microbatch import MicroBatching

    distill = DistillationConfig(teacher=teacher, form=form, task_reward=False)
    cfg = SimpleNamespace(model=ModelConfig(hf_dir=student, dtype="float32"),
                          optimizer=OptimizerConfig(name="sgd", lr=1.0, clip_grad=0.0),
                          parallel=ParallelConfig(tp=ps.get_tensor_model_parallel_world_size(),
                                                  pp=ps.get_pipeline_model_parallel_world_size()),
                          distillation=distill)
    spec = ScoringSpec(temperature=TEMPERATURE, vocab_size=0)  # build_teacher gives it the teacher's vocabulary
    policy, frozen = build_policy(cfg), build_teacher(cfg, spec)
    before = [p.detach().clone() for c in frozen.chunks for p in c.parameters()]
    spec = ScoringSpec(temperature=TEMPERATURE, vocab_size=policy.hf_config.vocab_size)
    full = BATCHES["long"]()
    dp = ps.get_data_parallel_world_size()
    local = dp_shard(full, ps.get_data_parallel_rank(), dp, full.num_sequences)
    batching = MicroBatching(2, None, False, False)
    local.old_log_probs = compute_log_probs(policy.chunks, local, batching, spec)
    local.teacher_log_probs = compute_log_probs(frozen.chunks, local, batching, frozen.spec)
    metrics, applied, _ = train_mini_batch(policy.chunks, policy.optimizer, local, AlgorithmConfig(), spec, batching,
                                           int(full.loss_mask.sum()), full.num_sequences, dp,
                                           ps.get_data_parallel_group(), distillation=distill)
    params = [p for c in frozen.chunks for p in c.parameters()]
    optimized = {id(p) for group in policy.optimizer.param_groups for p in group["params"]}
    return {"teacher_lp": local.teacher_log_probs, "old_lp": local.old_log_probs, "metrics": metrics,
            "applied": applied, "rows": local.tokens, "mask": local.loss_mask,
            "teacher_grads": [p.grad for p in params] + [getattr(p, "main_grad", None) for p in params],
            "teacher_requires_grad": any(p.requires_grad for p in params),
            "teacher_in_optimizer": any(id(p) in optimized for p in params),
            "teacher_moved": max(float((p.detach() - b).abs().max()) for p, b in zip(params, before))}


def _transformers_log_probs(hf_dir, tokens, temperature):
    from transformers import AutoModelForCausalLM

    from megatron_grpo.trainer.teacher import reference_log_probs

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    return reference_log_probs(model, tokens, temperature)


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}, {"tp": 1, "pp": 1}], ids=["tp2", "pp2", "dp2"])
def test_teacher_scores_at_the_sampling_temperature_and_gets_no_gradient(student_dir, teacher_dir, layout):
    results = run_distributed(_distill_step, 2, student_dir, teacher_dir, **layout, timeout_s=300)
    scored = [r for r in results if r["teacher_lp"] is not None]
    assert scored, "no rank scored"
    for r in scored:
        mask = r["mask"] > 0
        expected = _transformers_log_probs(teacher_dir, r["rows"], TEMPERATURE)
        assert (r["teacher_lp"].double() - expected)[mask].abs().max() <= 1e-5
        at_one = _transformers_log_probs(teacher_dir, r["rows"], 1.0)
        assert (r["teacher_lp"].double() - at_one)[mask].abs().max() > 1e-2  # the temperature matters here
    for r in results:
        assert r["applied"]
        assert all(g is None for g in r["teacher_grads"]), "a gradient reached the teacher"
        assert not r["teacher_requires_grad"] and not r["teacher_in_optimizer"]
        assert r["teacher_moved"] == 0.0
    reporter = next(r["metrics"] for r in results if r["metrics"] is not None)
    assert reporter["distill/reverse_kl"] != 0.0 and reporter["distill/task_advantage_abs"] == 0.0


def test_a_teacher_equal_to_the_student_scores_its_old_log_probs_bit_for_bit(student_dir):
    results = run_distributed(_distill_step, 2, student_dir, student_dir, "loss", tp=2, timeout_s=300)
    for r in results:
        if r["teacher_lp"] is not None:
            assert torch.equal(r["teacher_lp"], r["old_lp"])
    reporter = next(r["metrics"] for r in results if r["metrics"] is not None)
    assert reporter["distill/reverse_kl"] == 0.0 and reporter["distill/logprob_gap_abs"] == 0.0


# ---- the pre-flight ----------------------------------------------------------------------------
def _set_chat_template(folder, template: str) -> None:
    """Give the tokenizer in ``folder`` another chat template (transformers saves it beside the
    tokenizer as chat_template.jinja, older ones inside tokenizer_config.json)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        jinja.write_text(template)
        return
    path = folder / "tokenizer_config.json"
    raw = json.loads(path.read_text())
    raw["chat_template"] = template
    path.write_text(json.dumps(raw))


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(student_dir, tmp_path):
    import shutil

    from megatron_grpo.models.tokenizer import load_tokenizer
    from megatron_grpo.preflight.run import check_teacher
    from tests.support.configs import experiment
    from megatron_grpo.config import ModelConfig

    other_template = tmp_path / "template"
    shutil.copytree(student_dir, other_template)
    _set_chat_template(other_template, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    other_vocab = tmp_path / "vocab"
    shutil.copytree(student_dir, other_vocab)
    tok_path = other_vocab / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10], list(vocab)[11]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, another vocabulary
    tok_path.write_text(json.dumps(tok))

    student = load_tokenizer(student_dir)
    for teacher, why in ((other_template, "chat templates differ"), (other_vocab, "vocabularies differ")):
        cfg = experiment(model=ModelConfig(hf_dir=student_dir), distillation=DistillationConfig(teacher=str(teacher)))
        with pytest.raises(ConfigError) as e:
            check_teacher(cfg, student)
        line = e.value.one_line()
        assert "distillation.teacher" in line and str(teacher) in line and student_dir in line and why in line, line
    cfg = experiment(model=ModelConfig(hf_dir=student_dir), distillation=DistillationConfig(teacher=student_dir))
    check_teacher(cfg, student)  # the student's own folder passes


# ---- the run -----------------------------------------------------------------------------------
def _train(demo, run_dir, steps, *extra):
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "train", "--config", "yaml_configs/demo_cpu.yaml",
           *demo_overrides(demo, run_dir, steps, "engine.kind=inprocess", "eval.sets=[]", "checkpoint.save_every=0",
                           "logging.plot=false", *extra)]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def test_pure_distillation_run_from_an_identical_teacher(demo, tmp_path):
    """``algorithm.num_iterations=2``: the old-log-prob pass runs, so the teacher (the same
    folder) and pi_old are the same forward of the same weights: a reverse KL of exactly 0 at
    step 1, which the student's first update then moves off 0 (the demo's entropy bonus)."""
    out = _train(demo, tmp_path / "run", 2, f"distillation.teacher={demo / 'model'}", "distillation.task_reward=false",
                 "algorithm.num_iterations=2")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["distill/reverse_kl"] == 0.0 and rows[0]["distill/advantage"] == 0.0
    assert rows[1]["distill/reverse_kl"] != 0.0
    for r in rows:
        assert r["distill/teacher_check_abs_diff"] <= 1e-5 and r["time/teacher_s"] > 0
        assert r["distill/task_advantage_abs"] == 0.0


def test_a_teacher_check_past_its_tolerance_ends_the_run_in_one_line(demo, tmp_path):
    out = _train(demo, tmp_path / "run", 2, f"distillation.teacher={demo / 'model'}",
                 "distillation.verify_tolerance=1e-30")
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if "distillation.verify_tolerance" in line]
    assert lines and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "disagree with transformers" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "run")


def test_distillation_composes_with_a_lora_student_bf16_async_and_packing(demo, tmp_path):
    """The teacher (the demo model, bf16 like the student) beside a LoRA policy trained in bf16
    on asynchronous rollouts with packed rows: the run trains, the teacher's check passes at the
    bf16 tolerance at every step, and the teacher's term moves the adapters."""
    out = _train(demo, tmp_path / "run", 2, f"distillation.teacher={demo / 'model'}", "distillation.task_reward=false",
                 "distillation.verify_tolerance=5e-2", "model.dtype=bfloat16", "sync.verify_logprob_tolerance=5e-2", "model.lora.rank=4",
                 "model.lora.alpha=8", "optimizer.lr=2e-3", "rollout.mode=async", "parallel.pack_sequences=true",
                 "parallel.max_tokens_per_microbatch=512")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["distill/teacher_check_abs_diff"] <= 5e-2 and r["grad_norm"] > 0, r
    assert rows[-1]["distill/logprob_gap_abs"] > 0
