"""tools/bench_vs_trl.py: the mapping of our config to TRL's GRPOConfig, the departures it lists
(pinned to docs/benchmarks.md), its flags, and, slow and only where the TRL venv of
tools/setup_trl_venv.sh exists (CI does not build it), a reasoning-workload run of both sides."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_grpo.config import load_config
from tests.demo_run import ENV, ROOT

_SPEC = importlib.util.spec_from_file_location("bench_vs_trl", ROOT / "tools" / "bench_vs_trl.py")
bench = importlib.util.module_from_spec(_SPEC)
sys.modules["bench_vs_trl"] = bench  # its dataclass looks its module up there
_SPEC.loader.exec_module(bench)

REASONING = ROOT / "yaml_configs" / "reasoning_cpu.yaml"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
GRPO_KEYS = {
    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "num_generations",
    "max_completion_length", "temperature", "top_k", "top_p", "learning_rate", "lr_scheduler_type",
    "warmup_steps", "max_steps", "max_grad_norm", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "beta", "epsilon", "epsilon_high", "loss_type", "scale_rewards", "mask_truncated_completions", "entropy_coef",
    "num_iterations", "seed", "use_cpu", "bf16", "gradient_checkpointing", "logging_steps", "save_strategy",
    "report_to", "disable_tqdm", "dataloader_num_workers",
}
"""What the mapping sets: a new key is a new decision about TRL's side, to be made on purpose."""


def reasoning_cfg(*overrides: str):
    return load_config(REASONING, ["model.hf_dir=unused", *overrides])


def test_reasoning_config_maps_to_trl_with_its_hyper_parameters():
    args = bench.trl_grpo_args(reasoning_cfg("trainer.seed=7"), batches=20, device="cpu")
    assert set(args) == GRPO_KEYS
    # 16 prompts x 8 = 128 per rollout batch, 2 optimizer steps of 64, micro-batches of 8
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"],
            args["steps_per_generation"], args["num_generations"]) == (8, 8, 16, 8)
    assert args["max_steps"] == 40  # optimizer steps: 20 batches x 2
    assert (args["max_completion_length"], args["temperature"], args["top_k"], args["top_p"]) == (192, 1.0, 0, 1.0)
    assert (args["learning_rate"], args["lr_scheduler_type"], args["warmup_steps"]) == (2e-4, "constant_with_warmup", 10)
    assert "lr_scheduler_kwargs" not in args  # constant: min_lr == lr
    assert (args["epsilon"], args["epsilon_high"], args["loss_type"], args["scale_rewards"]) == (0.2, 0.28, "dapo", "group")
    assert (args["beta"], args["entropy_coef"], args["num_iterations"], args["max_grad_norm"]) == (0.0, 0.0, 1, 1.0)
    assert (args["seed"], args["use_cpu"], args["bf16"], args["gradient_checkpointing"]) == (7, True, False, False)
    assert json.loads(json.dumps(args)) == args  # handed to the worker as JSON


def test_mapping_follows_the_config():
    args = bench.trl_grpo_args(reasoning_cfg("optimizer.lr_decay_style=cosine", "optimizer.min_lr=1.0e-5",
                                             "model.dtype=bfloat16", "parallel.micro_batch_size=16",
                                             "algorithm.entropy_coef=0.01"), batches=3, device="cuda")
    assert args["lr_scheduler_type"] == "cosine_with_min_lr" and args["lr_scheduler_kwargs"] == {"min_lr": 1e-5}
    assert (args["bf16"], args["use_cpu"], args["entropy_coef"]) == (True, False, 0.01)
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"], args["steps_per_generation"]) \
        == (16, 4, 8)


@pytest.mark.parametrize("override, key", [
    ("algorithm.kl_loss_coef=0.01", "algorithm.kl_loss_coef"),
    ("algorithm.policy_loss_type=gspo", "algorithm.policy_loss_type"),
    ("algorithm.loss_reduction=seq_mean_token_mean", "algorithm.loss_reduction"),
    ("rollout.top_p=0.9", "rollout.top_p"),
    ("optimizer.lr_decay_style=linear", "optimizer.min_lr"),
    ("rollout.min_p=0.1", "rollout.min_p"),
    ("algorithm.entropy_coef_end=0.0", "algorithm.entropy_coef_end"),
])
def test_unmappable_settings_are_refused_in_one_line(override, key):
    with pytest.raises(ValueError) as e:
        bench.trl_grpo_args(reasoning_cfg(override), batches=2, device="cpu")
    assert str(e.value).startswith(f"{key}:") and "\n" not in str(e.value)


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_every_departure_is_listed_in_the_docs():
    docs = _flat((ROOT / "docs" / "benchmarks.md").read_text())
    cpu = bench.reasoning_departures(reasoning_cfg(), "cpu")
    assert len(cpu) >= 9
    cuda = bench.reasoning_departures(reasoning_cfg("model.dtype=bfloat16"), "cuda")
    assert set(cpu) < set(cuda) and len(cuda) == len(cpu) + 2  # + the GPU's and bf16's
    for line in cuda:
        assert _flat(line) in docs, line


def test_demo_defaults_and_overrides_are_unchanged():
    args = bench.parse_args([])
    assert (args.workload, args.device, args.tp, args.micro_batch_size, args.target, args.window) == \
        ("demo", "cpu", [1, 2], [64], 0.5, 10)
    shared = bench.shared_overrides("demo", ROOT / "d", batches=5, seed=3, mbs=64, sets=[])
    assert shared == [f"model.hf_dir={ROOT / 'd'}/model", f"data.train_file={ROOT / 'd'}/arithmetic.jsonl",
                      "trainer.num_steps=5", "trainer.seed=3", "parallel.micro_batch_size=64",
                      "optimizer.lr=5.0e-4", "optimizer.min_lr=5.0e-5", "algorithm.entropy_coef=0.02"]
    r = bench.parse_args(["--workload", "reasoning", "--device", "cuda"])
    assert (r.tp, r.micro_batch_size, r.target, r.window) == ([1], [None], 0.35, 20)


def test_cuda_runs_put_the_embedded_engine_on_the_tensor_transport():
    kw = dict(run_dir=ROOT / "r", tp=1, shuffled=False)
    assert "rollout.weight_sync_transport=tensor" in bench.ours_overrides([], engine="embedded", device="cuda", **kw)
    assert not any("transport" in o for o in bench.ours_overrides([], engine="inprocess", device="cuda", **kw))
    assert not any("transport" in o for o in bench.ours_overrides([], engine="embedded", device="cpu", **kw))
    assert bench.device_env("cpu", 1)["CUDA_VISIBLE_DEVICES"] == ""
    assert bench.device_env("cuda", 1).get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_bad_flag_combinations_stop_in_one_line(capsys):
    for argv in (["--device", "cuda", "--tp", "2"], ["--set", "rollout.top_p=0.9"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert capsys.readouterr().err.strip().splitlines()[-1].split(": error: ")[1].startswith("--")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_exits_non_zero_in_one_line(capsys):
    assert bench.main(["--device", "cuda", "--workload", "reasoning"]) == bench.EXIT_NO_CUDA
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device cuda" in err


@pytest.mark.slow
@pytest.mark.skipif(not TRL_PYTHON.exists(), reason="needs .venv-trl (bash tools/setup_trl_venv.sh); CI has none")
def test_reasoning_workload_both_sides_end_to_end(tmp_path):
    out = tmp_path / "bench"
    build = subprocess.run(  # a reduced workload where the bench looks for it: it then skips its own build
        [sys.executable, "tools/make_reasoning_model.py", "--out", str(out / "reasoning"), "--hidden", "32",
         "--warmup-steps", "40", "--num-train", "200", "--num-heldout", "8", "--probe", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert build.returncode == 0, build.stderr[-3000:]
    summary = tmp_path / "summary.json"
    run = subprocess.run(
        [sys.executable, "tools/bench_vs_trl.py", "--workload", "reasoning", "--batches", "3", "--seeds", "1",
         "--tp", "1", "--engines", "inprocess", "--window", "2", "--out", str(out), "--json", str(summary),
         "--set", "rollout.max_new_tokens=32", "--set", "rollout.prompts_per_step=4",
         "--set", "rollout.num_generations=4", "--set", "parallel.global_batch_size=8"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    assert "Departures between the two sides" in run.stdout
    record = json.loads(summary.read_text())
    assert (record["workload"], record["device"], record["window"]) == ("reasoning", "cpu", 2)
    assert set(record["setups"]) == {"TRL GRPOTrainer (1 process)",
                                     "megatron-grpo inprocess, TP=1, micro-batch of the config"}
    for setup in record["setups"].values():
        (seed,) = setup["per_seed"]
        assert seed["s_per_batch"] > 0 and 0 <= seed["final_reward"] <= 1
    rows = [json.loads(line) for line in (out / "reasoning_trl_seed1" / "batches.jsonl").read_text().splitlines()]
    assert rows[0]["reward_code"] == {"math_exact_match": str(ROOT / "megatron_grpo" / "rewards" / "builtin.py")}
    assert [r["batch"] for r in rows if "batch" in r] == [1, 2, 3] and "done" in rows[-1]
    grpo = json.loads((out / "reasoning_trl_seed1" / "grpo_args.json").read_text())
    assert (grpo["max_completion_length"], grpo["num_generations"], grpo["steps_per_generation"]) == (32, 4, 2)
    ours = [json.loads(line) for line in
            (out / "reasoning_ours_tp1_mbscfg_seed1_inprocess" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ours if "reward_mean" in r] == [1, 2, 3]
