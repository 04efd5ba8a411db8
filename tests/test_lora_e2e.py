"""A LoRA run of the CPU demo end to end (TP2, the in-process engine), as a user runs it:
every sync verified, the trainer scoring what the engine sampled (fp32 mismatch <= 1e-5),
checkpoints holding the adapters only, a resumed run equal to an uninterrupted one (metrics
and adapters bitwise), and the export of the TP2 checkpoint at TP1 as a peft adapter folder
and as a merged model, each passing its self-check; a LoRA checkpoint converted without
--lora/--merge, and a bad ``model.lora``, end in one line."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from tests.support.demo_run import ENV, ROOT, read_metrics, train_cmd

STEPS = 4
LORA = ("engine.kind=inprocess", "model.lora.rank=4", "model.lora.alpha=8", "optimizer.lr=2e-3",
        "optimizer.lr_decay_style=constant", "optimizer.lr_warmup_steps=0",  # the same lr at 2 and 4 steps
        "checkpoint.save_every=2", "logging.plot=false")
COMPARED = ("reward_mean", "loss", "ppo_kl", "entropy", "grad_norm", "rollout_train_logprobs_abs_diff_mean")


def _train(demo, run_dir, steps, *extra):
    out = subprocess.run(train_cmd(demo, run_dir, steps, *LORA, *extra), cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return read_metrics(run_dir)


def _convert(*args):
    return subprocess.run([sys.executable, "-m", "megatron_grpo.cli", "convert-megatron-to-hf", *map(str, args)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def straight(demo, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora") / "straight"
    return run_dir, _train(demo, run_dir, STEPS)


@pytest.mark.slow
def test_lora_run_syncs_verified_and_saves_adapters_only(straight, demo):
    run_dir, rows = straight
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    _check_adapter_syncs(rows, demo)
    ckpt = run_dir / "checkpoints" / f"step_{STEPS:06d}"
    meta = json.loads((ckpt / "megatron_grpo.json").read_text())
    assert meta["lora"]["rank"] == 4 and meta["lora"]["base"]["hf_dir"] == str((demo / "model").resolve())
    keys = list(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if not k.startswith("optimizer")]
    assert model_keys and all(k.startswith("lora_adapters.") for k in model_keys), model_keys[:5]
    # the adapters and their Adam state: a fraction of the base model's bytes
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.glob("*.distcp"))
    base_bytes = (demo / "model" / "model.safetensors").stat().st_size
    assert ckpt_bytes < 0.5 * base_bytes, (ckpt_bytes, base_bytes)


def _check_adapter_syncs(rows, demo):
    """Every sync sent the adapters alone (<= 5% of the model's bytes) and passed the probe:
    the engine's log-probs (its own merge) = the trainer's LoRA forward (fp32, <= 1e-5)."""
    model_bytes = (demo / "model" / "model.safetensors").stat().st_size
    assert all(r["weight_sync_verified"] == 1 for r in rows)
    assert all(0 < r["weight_sync_bytes"] <= 0.05 * model_bytes for r in rows), [r["weight_sync_bytes"] for r in rows]
    assert max(r["weight_sync_probe_logprob_abs_diff"] for r in rows) <= 1e-5
    assert max(r["rollout_train_logprobs_abs_diff_mean"] for r in rows) <= 1e-5


@pytest.mark.slow
def test_pp2_lora_run_gathers_the_stages_adapters(demo, tmp_path):
    """At PP2 the second stage's adapters reach the engine through rank 0 (gather_object)."""
    rows = _train(demo, tmp_path / "pp2", 2, "parallel.tp=1", "parallel.pp=2", "checkpoint.save_every=0",
                  "eval.sets=[]")
    _check_adapter_syncs(rows, demo)


@pytest.mark.slow
def test_resumed_lora_run_equals_the_uninterrupted_one(straight, demo, tmp_path):
    straight_dir, straight_rows = straight
    run_dir = tmp_path / "resumed"
    _train(demo, run_dir, 2)
    rows = _train(demo, run_dir, STEPS)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for a, b in zip(rows, straight_rows):
        assert all(a[k] == b[k] for k in COMPARED), [(k, a[k], b[k]) for k in COMPARED if a[k] != b[k]]
    exported = []
    for source in (straight_dir, run_dir):
        out = tmp_path / f"peft_{source.name}"
        assert _convert("--ckpt-dir", source / "checkpoints" / f"step_{STEPS:06d}", "--output-dir", out, "--lora",
                        "--no-self-check").returncode == 0
        exported.append(load_file(out / "adapter_model.safetensors"))
    assert exported[0].keys() == exported[1].keys()
    assert all(exported[0][k].equal(exported[1][k]) for k in exported[0])


@pytest.mark.slow
def test_tp2_lora_checkpoint_exports_at_tp1(straight, tmp_path):
    ckpt = straight[0] / "checkpoints" / f"step_{STEPS:06d}"
    adapter = _convert("--ckpt-dir", ckpt, "--output-dir", tmp_path / "adapter", "--lora")
    assert adapter.returncode == 0 and "self-check OK" in adapter.stdout, adapter.stdout + adapter.stderr[-2000:]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    merged = _convert("--ckpt-dir", ckpt, "--output-dir", tmp_path / "merged", "--merge")
    assert merged.returncode == 0 and "self-check OK" in merged.stdout, merged.stdout + merged.stderr[-2000:]
    plain = _convert("--ckpt-dir", ckpt, "--output-dir", tmp_path / "plain")
    assert plain.returncode == 2
    assert plain.stderr.strip().count("\n") == 0 and "--lora" in plain.stderr and "--merge" in plain.stderr


@pytest.mark.slow
def test_bad_lora_config_stops_before_any_rank(demo, tmp_path):
    cmd = train_cmd(demo, tmp_path / "run", 1, "model.lora.target_modules=[q_proj]")
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "model.lora.target_modules" in out.stderr, out.stderr


def _unwritable_outputs(tmp_path):
    """Output folders that cannot be written: under a regular file (which stops root too), and
    under a read-only folder where the tests do not run as root (root writes there anyway)."""
    (tmp_path / "a_file").write_text("")
    outs = [tmp_path / "a_file" / "adapter"]
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        outs.append(locked / "adapter")
    return outs


@pytest.mark.slow
def test_damaged_or_unwritable_lora_exports_are_one_line(straight, tmp_path):
    """Issue 64: ``--merge`` of a LoRA checkpoint whose adapter shard was cut ended in an
    ``EOFError`` traceback from torch's checkpoint reader, and ``--lora`` into a read-only
    folder in an ``OSError`` one on its temp file. Each is now one line naming the file, exit 2,
    and nothing written."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(straight[0] / "checkpoints" / f"step_{STEPS:06d}", ckpt)
    shard = sorted(ckpt.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cut = _convert("--ckpt-dir", ckpt, "--output-dir", tmp_path / "merged", "--merge", "--no-self-check")
    assert cut.returncode == 2 and cut.stderr.count("\n") == 1, cut.stderr[-3000:]
    assert f"{shard.name} has {shard.stat().st_size} bytes, the manifest says" in cut.stderr, cut.stderr
    assert not (tmp_path / "merged").exists()

    good = straight[0] / "checkpoints" / f"step_{STEPS:06d}"
    for out in _unwritable_outputs(tmp_path):
        refused = _convert("--ckpt-dir", good, "--output-dir", out, "--lora", "--no-self-check")
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr[-3000:]
        assert refused.stderr.startswith(f"convert-megatron-to-hf: error: --output-dir {out}: cannot write there ("), \
            refused.stderr


@pytest.mark.slow
def test_resuming_a_lora_checkpoint_without_model_lora_names_lora(straight, demo, tmp_path):
    """Issue 64: resuming a LoRA run with ``model.lora`` unset ended in "could not load checkpoint
    ...: ValueError: Cannot merge two lists with different lengths". The line now says the
    checkpoint holds adapters, the config none, and the way out."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight[0], run_dir)
    no_lora = [o for o in LORA if not o.startswith("model.lora")]
    out = subprocess.run(train_cmd(demo, run_dir, STEPS + 1, *no_lora), cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert (f"it holds LoRA adapters (rank 4, targets linear_qkv" in last and "and the config sets no model.lora: "
            f"set model.lora as in the run's {run_dir / 'config.yaml'} to resume it" in last), out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
