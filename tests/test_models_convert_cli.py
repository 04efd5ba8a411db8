"""The conversion tools end to end: HF -> Megatron -> HF through the real scripts (one process,
and the export under torchrun at PP2), bitwise tensors, loadable by transformers, self-check
printed; one-line errors (exit 2) and self-check failures (exit 1)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_grpo.models.layouts import GatedFC1
from tests.support.models_fixtures import PROBE_IDS, hf_reference_logits, hf_tensors, make_hf_model

ROOT = Path(__file__).resolve().parents[1]
TO_MEGATRON = "tools.convert_hf_to_megatron"  # run as modules: python -m tools.X
TO_HF = "tools.convert_megatron_to_hf"


def run_tool(*args, torchrun_nproc=None, timeout=300):
    prefix = [sys.executable]
    if torchrun_nproc:
        prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun_nproc}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(prefix + [str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def run_in_process(name, *args):
    from megatron_grpo.models.convert_cli import run_command

    return run_command(name, [str(a) for a in args])


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2", tied=False, seed=3)


@pytest.fixture(scope="module")
def llama_tied_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("hf") / "llama", "llama", tied=True, seed=4)


def assert_same_hf_dir(exported: Path, original: Path):
    got, want = hf_tensors(exported), hf_tensors(original)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert json.loads((exported / "config.json").read_text()) == json.loads((original / "config.json").read_text())
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (exported / f).read_bytes() == (original / f).read_bytes(), f
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in want.values())
    assert not list(exported.parent.glob(f".{exported.name}*"))  # temp dir renamed away


@pytest.mark.slow
def test_tools_round_trip_bitwise_and_loadable_by_transformers(qwen2_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, out = tmp_path / "ckpt", tmp_path / "hf_out"
    r = run_tool("-m", TO_MEGATRON, "--hf-dir", qwen2_dir, "--output-dir", ckpt)
    assert r.returncode == 0, r.stderr
    assert "self-check OK: max |Δlogits| = " in r.stdout and "wrote" in r.stdout
    assert json.loads((ckpt / "megatron_grpo.json").read_text())["model_type"] == "qwen2"

    shutil.copytree(qwen2_dir, tmp_path / "gone")  # the export must not need the HF dir
    r = run_tool("-m", TO_HF, "--ckpt-dir", ckpt, "--output-dir", out)
    assert r.returncode == 0, r.stderr
    assert "self-check OK" in r.stdout and "MB of torch.float32 weights" in r.stdout
    assert_same_hf_dir(out, qwen2_dir)

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(PROBE_IDS).logits, hf_reference_logits(qwen2_dir))
    assert AutoTokenizer.from_pretrained(str(out)).encode("what is 3 plus 4") == \
        AutoTokenizer.from_pretrained(str(qwen2_dir)).encode("what is 3 plus 4")


@pytest.mark.slow
def test_export_under_torchrun_at_pp2_writes_every_stage_into_one_index(llama_tied_dir, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf_out"
    assert run_in_process("convert-hf-to-megatron", "--hf-dir", llama_tied_dir, "--output-dir", ckpt,
                          "--no-self-check") == 0
    # 50 kB shards: several files per stage, renamed model-0000i-of-0000N in stage order
    r = run_tool("-m", TO_HF, "--ckpt-dir", ckpt, "--output-dir", out, "--pp", 2,
                 "--max-shard-size-gb", 50e3 / 1024**3, torchrun_nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("self-check OK") == 1  # printed by rank 0 only
    assert_same_hf_dir(out, llama_tied_dir)
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(files) > 2 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.embed_tokens.weight"] == files[0] and index["model.norm.weight"] == files[-1]
    assert "lm_head.weight" not in index  # tied: the last stage's copy is not exported


def test_self_check_fails_with_exit_1_when_the_checkpoint_is_wrong(qwen2_dir, tmp_path, monkeypatch, capsys):
    # Fault injection: a converter that swaps gate and up when writing the checkpoint.
    good = GatedFC1.to_shard
    monkeypatch.setattr(GatedFC1, "to_shard", lambda self, hf, r, tp: good(self, hf[::-1], r, tp))
    rc = run_in_process("convert-hf-to-megatron", "--hf-dir", qwen2_dir, "--output-dir", tmp_path / "c")
    assert rc == 1
    assert "self-check FAILED: max |Δlogits| = " in capsys.readouterr().out


def test_export_self_check_fails_with_exit_1_when_the_export_is_wrong(qwen2_dir, tmp_path, monkeypatch, capsys):
    assert run_in_process("convert-hf-to-megatron", "--hf-dir", qwen2_dir, "--output-dir", tmp_path / "c",
                          "--no-self-check") == 0
    good = GatedFC1.from_shards
    monkeypatch.setattr(GatedFC1, "from_shards", lambda self, shards: good(self, shards)[::-1])
    assert run_in_process("convert-megatron-to-hf", "--ckpt-dir", tmp_path / "c", "--output-dir", tmp_path / "h") == 1
    assert "self-check FAILED" in capsys.readouterr().out


def test_bfloat16_conversion_self_check_compares_like_with_like(qwen2_dir, tmp_path, capsys):
    ckpt = tmp_path / "c"
    assert run_in_process("convert-hf-to-megatron", "--hf-dir", qwen2_dir, "--output-dir", ckpt,
                          "--dtype", "bfloat16") == 0
    assert json.loads((ckpt / "megatron_grpo.json").read_text())["dtype"] == "bfloat16"
    assert run_in_process("convert-megatron-to-hf", "--ckpt-dir", ckpt, "--output-dir", tmp_path / "h") == 0
    out = capsys.readouterr().out
    assert out.count("self-check OK") == 2
    # exported at config.json's dtype (float32), holding the bf16-rounded values
    for name, t in hf_tensors(tmp_path / "h").items():
        assert t.dtype == torch.float32 and torch.equal(t, t.bfloat16().float()), name


def one_line_error(capsys, name):
    """The error line: the last line of stderr (a progress bar may precede it)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"{name}: error: "), lines
    assert not any("error" in line for line in lines[:-1]), lines
    return lines[-1]


def test_user_errors_are_one_line_with_exit_2(qwen2_dir, tmp_path, capsys):
    h2m, m2h = "convert-hf-to-megatron", "convert-megatron-to-hf"
    assert run_in_process(h2m, "--hf-dir", tmp_path / "missing", "--output-dir", tmp_path / "o") == 2
    assert "Hugging Face model directory not found" in one_line_error(capsys, h2m)

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert run_in_process(h2m, "--hf-dir", gpt2, "--output-dir", tmp_path / "o") == 2
    assert "model_type 'gpt2' is not supported (supported: llama, mixtral, qwen2, qwen3, qwen3_moe)" in one_line_error(capsys, h2m)

    no_weights = tmp_path / "no_weights"
    shutil.copytree(qwen2_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    assert run_in_process(h2m, "--hf-dir", no_weights, "--output-dir", tmp_path / "o") == 2
    assert "no model.safetensors nor model.safetensors.index.json" in one_line_error(capsys, h2m)

    wrong_shape = tmp_path / "wrong_shape"
    shutil.copytree(qwen2_dir, wrong_shape)
    config = json.loads((wrong_shape / "config.json").read_text())
    (wrong_shape / "config.json").write_text(json.dumps(dict(config, intermediate_size=96)))
    assert run_in_process(h2m, "--hf-dir", wrong_shape, "--output-dir", tmp_path / "o") == 2
    err = one_line_error(capsys, h2m)
    assert "shape mismatch: model.layers.0.mlp.gate_proj.weight [128, 64]" in err
    assert "decoder.layers.0.mlp.linear_fc1.weight expects shard [192, 64]" in err
    assert not (tmp_path / "o").exists()

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert run_in_process(h2m, "--hf-dir", qwen2_dir, "--output-dir", busy) == 2
    assert "exists and is not empty (pass --overwrite" in one_line_error(capsys, h2m)

    # --overwrite of a directory that holds (or lies inside) the input would delete the input
    parent = tmp_path / "parent"
    shutil.copytree(qwen2_dir, parent / "model")
    assert run_in_process(h2m, "--hf-dir", parent / "model", "--output-dir", parent, "--overwrite") == 2
    assert "contains the input directory" in one_line_error(capsys, h2m)
    assert run_in_process(h2m, "--hf-dir", parent / "model", "--output-dir", parent / "model" / "out",
                          "--overwrite") == 2
    assert "is inside the input directory" in one_line_error(capsys, h2m)
    assert (parent / "model" / "model.safetensors").is_file() and not (parent / "model" / "out").exists()

    assert run_in_process(h2m, "--hf-dir", qwen2_dir, "--output-dir", tmp_path / "o", "--tp", 2) == 2
    assert "run under torchrun --nproc-per-node 2" in one_line_error(capsys, h2m)

    # a size the model cannot be split at: refused before any rank starts, naming the sizes that work
    heads = json.loads((qwen2_dir / "config.json").read_text())
    assert run_in_process(h2m, "--hf-dir", qwen2_dir, "--output-dir", tmp_path / "o", "--tp", 3) == 2
    assert (f"--tp 3 does not divide the model's num_attention_heads = {heads['num_attention_heads']} "
            f"({qwen2_dir}/config.json); tensor-parallel sizes that work: 1, 2") in one_line_error(capsys, h2m)
    assert run_in_process(h2m, "--hf-dir", qwen2_dir, "--output-dir", tmp_path / "o", "--pp", 3) == 2
    assert "--pp 3 does not divide the model's num_hidden_layers = 2" in one_line_error(capsys, h2m)
    assert not (tmp_path / "o").exists()

    assert run_in_process(m2h, "--ckpt-dir", qwen2_dir, "--output-dir", tmp_path / "o") == 2
    assert "not a megatron-core distributed checkpoint (no metadata.json)" in one_line_error(capsys, m2h)


def test_cli_registry_and_script_reach_the_same_command(tmp_path, capsys):
    from megatron_grpo.cli import main

    assert main(["convert-megatron-to-hf", "--ckpt-dir", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "checkpoint directory not found" in one_line_error(capsys, "convert-megatron-to-hf")
    r = run_tool("-m", TO_MEGATRON, "--hf-dir", tmp_path / "nope", "--output-dir", tmp_path / "o")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"convert-hf-to-megatron: error: {tmp_path / 'nope'}: Hugging Face model directory not found"]
