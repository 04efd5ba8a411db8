"""tools/bench/bench_vs_trl.py: the mapping of our config to TRL's GRPOConfig, the departures it lists
(pinned to docs/benchmarks.md), its flags, the held-out arithmetic of --workload smollm2 on
hand-made records, and, slow and only where the TRL venv of tools/bench/setup_trl_venv.sh exists (CI
does not build it), a reasoning-workload run of both sides."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch

from megatron_grpo.config import load_config
from megatron_grpo.data import PromptDataset, PromptSampler
from tests.support.demo_run import ENV, ROOT

import tools.bench.bench_vs_trl as bench

REASONING = ROOT / "yaml_configs" / "reasoning_cpu.yaml"
SMOLLM2 = ROOT / "yaml_configs" / "smollm2_135m_chain_sum_cpu.yaml"
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
    assert "sync.transport=tensor" in bench.ours_overrides([], engine="embedded", device="cuda", **kw)
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


def smollm2_cfg(*overrides: str, rows: int | None = None):
    shared = bench.shared_overrides("smollm2", ROOT / "d", batches=40, seed=3, mbs=None, sets=list(overrides),
                                    heldout_rows=rows)
    return load_config(SMOLLM2, shared)


def test_truncated_completions_of_trl_are_those_cut_at_the_cap():
    assert bench.truncated_of([[5, 6, 7], [5, 6, 2], [5, 2], [], [1, 2, 3, 4]], 3, {2}) == [True, False, False,
                                                                                          False, True]


def test_smollm2_config_maps_to_trl_with_its_hyper_parameters():
    args = bench.trl_grpo_args(smollm2_cfg(), batches=40, device="cpu")
    assert set(args) == GRPO_KEYS
    # 4 prompts x 8 = 32 per rollout batch = one optimizer step of 32 (DP2 x 16 on ours; 2 x 16 on TRL's)
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"],
            args["steps_per_generation"], args["num_generations"], args["max_steps"]) == (16, 2, 2, 8, 40)
    assert (args["max_completion_length"], args["temperature"], args["top_k"], args["top_p"]) == (32, 0.7, 0, 1.0)
    assert (args["learning_rate"], args["lr_scheduler_type"], args["warmup_steps"]) == (1e-5, "constant_with_warmup", 0)
    assert (args["epsilon"], args["epsilon_high"], args["loss_type"], args["scale_rewards"]) == (0.2, 0.28, "dapo", "group")
    assert (args["beta"], args["entropy_coef"], args["num_iterations"], args["max_grad_norm"]) == (0.0, 0.0, 1, 1.0)
    assert (args["seed"], args["use_cpu"], args["bf16"], args["gradient_checkpointing"]) == (3, True, False, False)


def test_trl_takes_the_prompts_in_our_samplers_order(tmp_path):
    """--workload smollm2: TRL's dataset is written in the order our trainer's sampler hands the
    prompts out (its shuffle off), so TRL's rollout batch k holds our step k's prompts; past an
    epoch the sampler reshuffles, and so does the order."""
    cfg = smollm2_cfg()
    prompts = [f"p{i}" for i in range(10)]  # only their number matters to the order
    order = bench.our_order(cfg, prompts, batches=5)  # 20 prompts: two epochs of 10
    sampler = PromptSampler(PromptDataset(prompts, "x"), cfg.rollout.prompts_per_step, cfg.trainer.seed,
                            cfg.data.shuffle)
    assert order == [i for _ in range(5) for i in sampler.next_indices()]
    assert sorted(order[:10]) == sorted(order[10:]) == list(range(10)) and order[:10] != order[10:]
    assert order[:10] != list(range(10))  # shuffled, by the config's seed
    assert "--our-prompt-order" in bench.trl_command(tmp_path / "log", workload="smollm2", seed=1, batches=2,
                                                     data_dir=tmp_path, device="cpu", mbs=None, sets=[],
                                                     heldout_rows=None)


def test_smollm2_both_sides_evaluate_the_same_greedy_set():
    cfg = smollm2_cfg(rows=4)
    (greedy,) = cfg.eval.sets  # the config's sampled set is dropped: TRL's side has no sampler to match it
    assert (greedy.name, greedy.path, greedy.n, greedy.temperature, greedy.max_samples) == \
        (bench.HELDOUT_SET, str(ROOT / "d" / "heldout.jsonl"), 1, 0.0, 4)
    assert (cfg.eval.at_start, cfg.eval.at_end, cfg.eval.every_n_steps) == (True, True, 10)
    assert [s for s in range(41) if cfg.eval.due(s, 40)] == [0, 10, 20, 30, 40]  # 0: due(0) is every_n's; at_start
    assert smollm2_cfg("eval.every_n_steps=5").eval.every_n_steps == 5  # --set comes last
    assert smollm2_cfg().eval.sets[0].max_samples is None
    ours = bench.ours_overrides(["x=1"], run_dir=ROOT / "r", tp=1, shuffled=False, engine="inprocess",
                                device="cpu", dp=2, evaluate=True)
    assert "parallel.world_size=2" in ours and "eval.sets=[]" not in ours and ours[0] == "x=1"
    assert "eval.sets=[]" in bench.ours_overrides([], run_dir=ROOT / "r", tp=2, shuffled=False, engine="embedded",
                                                  device="cpu")
    assert bench.shared_overrides("reasoning", ROOT / "d", batches=2, seed=1, mbs=None, sets=[]) == \
        bench.shared_overrides("reasoning", ROOT / "d", batches=2, seed=1, mbs=None, sets=[], heldout_rows=4)


def _launch_args(script: str, tool: str) -> list[str]:
    """The arguments ``script`` gives ``tool`` (continuation lines joined, shell quoting undone)."""
    text = (ROOT / script).read_text().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if tool in line and not line.lstrip().startswith("#")]
    words = shlex.split(line)
    return words[words.index(tool) + 1:]


def test_smollm2_builds_what_the_launch_script_builds():
    wl = bench.WORKLOADS["smollm2"]
    fetch, data = wl.build
    assert fetch == ("tools.fetch_smollm2", "--out", "{out}/model")
    launched = _launch_args("launch/smollm2_cpu.sh", "tools.make_reasoning_gym_data")
    assert launched[launched.index("--out"):] == ["--out", "runs/smollm2/chain_sum_2term"]
    assert list(data) == ["tools.make_reasoning_gym_data", *launched[:launched.index("--out")], "--out", "{out}"]
    yaml_sets = load_config(SMOLLM2, ["model.hf_dir=unused"]).eval.sets
    assert any(s.name == bench.HELDOUT_SET and s.temperature == 0 and s.path.endswith(wl.heldout_file)
               for s in yaml_sets)


def test_smollm2_defaults_and_refusals(capsys):
    a = bench.parse_args(["--workload", "smollm2"])
    assert (a.batches, a.engines, a.tp, a.micro_batch_size, a.target, a.window, a.heldout_rows) == \
        (40, ["inprocess"], [1], [None], 0.5, 10, None)
    d = bench.parse_args([])
    assert (d.batches, d.engines) == (150, ["embedded"])
    for argv in (["--workload", "smollm2", "--stop-after", "5"], ["--workload", "reasoning", "--heldout-rows", "4"],
                 ["--workload", "smollm2", "--device", "cuda"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert capsys.readouterr().err.strip().splitlines()[-1].split(": error: ")[1].startswith("--")


def test_ours_batches_and_skip_trl(capsys, tmp_path, monkeypatch):
    a = bench.parse_args(["--workload", "smollm2", "--ours-batches", "80", "--skip-trl"])
    assert (a.batches, a.ours_batches, a.skip_trl) == (40, 80, True)
    assert bench.parse_args(["--workload", "smollm2", "--batches", "30"]).ours_batches == 30
    assert bench.length_departures(bench.parse_args(["--workload", "smollm2"])) == []
    (length,) = bench.length_departures(a)
    assert "ours trains 80 rollout batches, TRL 40" in length and "first 40 batches" in length
    assert _flat(length.split(":")[0] + ":") in _flat((ROOT / "docs" / "benchmarks.md").read_text())
    for argv in (["--ours-batches", "80"], ["--workload", "reasoning", "--skip-trl"],
                 ["--workload", "smollm2", "--ours-batches", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert capsys.readouterr().err.strip().splitlines()[-1].split(": error: ")[1].startswith("--")
    # another length runs in its own directory; the default length keeps the old names (--reuse)
    runs = []
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: runs.append(cmd))
    monkeypatch.setattr(bench, "run_records", lambda run_dir: [{"step": s, "reward_mean": 0.5, "train_elapsed_s": s}
                                                             for s in range(1, 81)])
    for batches in (40, 80, 30):
        *_, run_dir = bench.run_ours(1, None, 3, batches, tmp_path, tmp_path, engine="inprocess", workload="smollm2",
                                     trl_batches=40 if batches != 30 else 30)
        assert run_dir.name == "smollm2_ours_tp1_mbscfg_seed3_inprocess" + ("_b80" if batches == 80 else "")
    assert "trainer.num_steps=40" in runs[0] and "trainer.num_steps=80" in runs[1] and "trainer.num_steps=30" in runs[2]
    bench.print_curves(bench.parse_args(["--workload", "smollm2", "--seeds", "3", "--skip-trl"]),
                       {"ours": [{"curve": _curve((0, 0, 0.17), (80, 900.4, 0.5)), "rescored": 0.495}]})
    assert "seed 3: step 0: 0.170 (0 s), step 80: 0.500 (900 s); re-scored 0.495" in capsys.readouterr().out


def test_smollm2_departures_are_listed_in_the_docs():
    docs = _flat((ROOT / "docs" / "benchmarks.md").read_text())
    cpu = bench.smollm2_departures(smollm2_cfg(), "cpu")
    # one optimizer step a rollout batch and no warm-up: no normaliser, order or warm-up departure
    assert not {bench.TOKEN_MEAN, bench.MINI_BATCH_ORDER, bench.WARM_UP} & set(cpu)
    assert any(d.startswith("Held-out evaluation:") for d in cpu) and any(d.startswith("Training clock:") for d in cpu)
    more = bench.smollm2_departures(smollm2_cfg("rollout.prompts_per_step=8", "optimizer.lr_warmup_steps=2"), "cpu")
    assert set(more) - set(cpu) == {bench.TOKEN_MEAN, bench.MINI_BATCH_ORDER, bench.WARM_UP}
    for line in cpu:
        assert _flat(line) in docs, line


def _curve(*points):
    return [{"step": s, "train_s": t, "accuracy": a} for s, t, a in points]


def test_heldout_curves_are_read_from_both_logs():
    metrics = [{"step": 0, "eval/greedy/pass@1": 0.25, "elapsed_s": 30.0},  # the start: before the training clock
               {"step": 1, "reward_mean": 0.5, "train_elapsed_s": 9.0},
               {"step": 2, "reward_mean": 0.5, "train_elapsed_s": 18.0, "eval/greedy/pass@1": 0.3,
                "eval/sampled/pass@1": 0.1}]
    assert bench.ours_heldout_curve(metrics) == _curve((0, 0.0, 0.25), (2, 18.0, 0.3))
    lines = [{"reward_code": {}}, {"eval_step": 0, "set": "greedy", "accuracy": 0.245, "train_s": 0.0},
             {"batch": 1, "reward_mean": 0.4, "wall_s": 20.0},
             {"eval_step": 1, "set": "greedy", "accuracy": 0.3, "num_prompts": 200, "train_s": 21.5}, {"done": True}]
    assert bench.trl_heldout_curve(lines) == _curve((0, 0.0, 0.245), (1, 21.5, 0.3))


def test_heldout_record_and_medians():
    ours = _curve((0, 0, 0.25), (10, 50, 0.30), (20, 100, 0.41), (40, 200, 0.50))
    trl = _curve((0, 0, 0.245), (20, 200, 0.35), (40, 400, 0.40))
    r = bench.heldout_record(ours, trl, ours_rescored=0.49, trl_rescored=0.40)
    assert (r["trl_start"], r["trl_end"], r["trl_rescored"], r["trl_train_s"]) == (0.245, 0.40, 0.40, 400)
    assert (r["ours_start"], r["ours_end"], r["ours_rescored"], r["ours_train_s"]) == (0.25, 0.50, 0.49, 200)
    assert (r["ours_s_to_trl_final"], r["ratio"]) == (100, 0.25)  # the first of ours at or above 0.40
    assert bench.seconds_to_reach(ours, 0.30) == 50 and bench.seconds_to_reach(ours, 0.51) is None
    slow = bench.heldout_record(ours, trl, 0.49, trl_rescored=0.6)
    assert (slow["ours_s_to_trl_final"], slow["ratio"]) == (None, None)
    third = bench.heldout_record(ours, _curve((0, 0, 0.2), (40, 100, 0.3)), 0.45, trl_rescored=0.3)
    assert third["ratio"] == 0.5
    medians = bench.heldout_medians([r, third, bench.heldout_record(ours, trl, 0.5, 0.41)])
    assert (medians["trl_train_s"], medians["ours_rescored"], medians["ratio"]) == (400, 0.49, 0.25)
    assert bench.heldout_medians([r, slow])["ratio"] is None  # a seed that never got there: no median
    assert bench.heldout_medians([r, slow])["trl_end"] == 0.40


def test_heldout_summary_and_table(capsys):
    args = bench.parse_args(["--workload", "smollm2", "--seeds", "1", "2"])
    ours = _curve((0, 0, 0.25), (40, 200, 0.5))
    records = [bench.heldout_record(ours, _curve((0, 0, 0.245), (40, 400, 0.4)), 0.5, 0.4),
               bench.heldout_record(ours, _curve((0, 0, 0.245), (40, 300, 0.6)), 0.5, 0.6)]
    seed = {"s_per_batch": 5.0, "hit_batch": None, "s_to_target": None, "final_reward": 0.5}
    record = bench.summary_record(args, {bench.TRL_NAME: [seed, seed]}, {}, ["d"], {"ours": records})
    assert record["heldout"]["ours"]["per_seed"] == records
    assert record["heldout"]["ours"]["median"]["ratio"] is None and record["departures"] == ["d"]
    assert json.loads(json.dumps(record)) == record
    bench.print_heldout(args, {"ours": records})
    table = capsys.readouterr().out
    assert "| 1 | 0.245 -> 0.400 (0.400) | 400 | 0.250 -> 0.500 (0.500) | 200 | 200 s = 0.50x TRL's |" in table
    assert "| 2 | 0.245 -> 0.600 (0.600) | 300 | 0.250 -> 0.500 (0.500) | 200 | never |" in table
    assert "| median | 0.245 -> 0.500 (0.500) | 350 | 0.250 -> 0.500 (0.500) | 200 | never |" in table
    flat = bench.heldout_record(ours, _curve((0, 0, 0.245), (40, 300, 0.2)), 0.5, 0.2)
    assert flat["ratio"] == 0 and "| at the start: TRL ended no higher than ours began |" in bench.heldout_row("3", flat)


@pytest.mark.slow
@pytest.mark.skipif(not TRL_PYTHON.exists(), reason="needs .venv-trl (bash tools/bench/setup_trl_venv.sh); CI has none")
def test_reasoning_workload_both_sides_end_to_end(tmp_path):
    out = tmp_path / "bench"
    build = subprocess.run(  # a reduced workload where the bench looks for it: it then skips its own build
        [sys.executable, "-m", "tools.make_reasoning_model", "--out", str(out / "reasoning"), "--hidden", "32",
         "--warmup-steps", "40", "--num-train", "200", "--num-heldout", "8", "--probe", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert build.returncode == 0, build.stderr[-3000:]
    summary = tmp_path / "summary.json"
    run = subprocess.run(
        [sys.executable, "-m", "tools.bench.bench_vs_trl", "--workload", "reasoning", "--batches", "3", "--seeds", "1",
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


def test_the_trl_workers_clock_leaves_off_evaluations_after_its_start_only(monkeypatch):
    """The TRL worker's training clock (``bench_vs_trl.TrainClock``): the starting weights' evaluation
    runs before training starts and is not subtracted (it was, and the first smollm2 run logged
    batches at -175 s); an evaluation during training is."""
    now = [100.0]
    monkeypatch.setattr(bench.time, "monotonic", lambda: now[0])
    clock = bench.TrainClock()
    assert clock() == 0.0
    clock.exclude(175.0)  # the evaluation at step 0, before on_train_begin
    now[0] = 300.0
    clock.start()
    now[0] = 310.0
    assert clock() == 10.0
    clock.exclude(4.0)  # an evaluation during training
    now[0] = 320.0
    assert clock() == 16.0
