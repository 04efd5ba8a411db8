"""Mixture-of-experts models (qwen3_moe, mixtral): Megatron computes the HF logits (fp32,
max |Δ| <= 1e-5), the weights go back to HF bitwise, and checkpoints reshard across EP sizes.

Reference: the HF transformers model's logits. Layouts: TP1 in-process (both architectures,
both Qwen3-MoE routing normalisations); EP2 (both), PP2 (mixtral), TP2xEP2 (qwen3_moe, 4
ranks) on gloo ranks; a checkpoint saved at EP2 is loaded at EP1.
"""

import json
from pathlib import Path

import pytest
import torch

from megatron_grpo.models.errors import ModelError
from tests.support.distributed import run_distributed
from tests.support.models_fixtures import hf_reference_logits, hf_tensors, make_hf_model
from tests.support.models_reference import TOL, assert_matches, build_and_load, build_from_checkpoint, probe

CASES = {  # name -> (model_type, tied, extra config)
    "qwen3_moe-norm": ("qwen3_moe", False, {"norm_topk_prob": True}),
    "qwen3_moe-raw-tied": ("qwen3_moe", True, {"norm_topk_prob": False}),
    "mixtral": ("mixtral", False, {}),
}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """case name -> (hf_dir, reference logits [B, S, V])."""
    root = tmp_path_factory.mktemp("moe_models")
    out = {}
    for seed, (name, (model_type, tied, extra)) in enumerate(CASES.items()):
        path = make_hf_model(root / name, model_type, tied, seed=10 + seed, **extra)
        out[name] = (str(path), hf_reference_logits(path))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp1_logits_and_round_trip(case, moe_models, single_rank):
    hf_dir, ref = moe_models[case]
    cfg, chunks = build_and_load(hf_dir)
    assert_matches([probe(cfg, chunks, hf_dir)], hf_dir, ref)


def test_topk_normalisation_changes_the_logits(moe_models, tmp_path):
    """The two Qwen3-MoE routings differ well above the tolerance: the TP1 test above would
    catch a router mapped with the wrong normalisation."""
    hf_dir, ref = moe_models["qwen3_moe-norm"]
    flipped = tmp_path / "flipped"
    flipped.mkdir()
    for f in ("config.json", "model.safetensors"):
        (flipped / f).write_bytes((Path(hf_dir) / f).read_bytes())
    config = json.loads((flipped / "config.json").read_text())
    config["norm_topk_prob"] = False
    (flipped / "config.json").write_text(json.dumps(config))
    assert (hf_reference_logits(flipped) - ref).abs().max().item() > 100 * TOL


@pytest.mark.parametrize("key,value", [("decoder_sparse_step", 2), ("mlp_only_layers", [0])])
def test_dense_layers_mixed_in_are_rejected(key, value, moe_models):
    from megatron_grpo.models import get_architecture, load_hf_config

    cfg = load_hf_config(moe_models["qwen3_moe-norm"][0])
    setattr(cfg, key, value)
    with pytest.raises(ModelError, match=f"{key}=.*every layer MoE"):
        get_architecture("qwen3_moe").transformer_config_kwargs(cfg)


def test_expert_parallel_sizes_are_checked(moe_models):
    from megatron_grpo.models import get_architecture, load_hf_config
    from megatron_grpo.models.builder import check_moe_parallel, check_moe_training

    moe = load_hf_config(moe_models["mixtral"][0])
    runtime = dict(expert_model_parallel_size=3, tensor_model_parallel_size=1, sequence_parallel=False)
    with pytest.raises(ModelError, match=r"parallel.ep=3 must divide the model's 4 experts"):
        check_moe_parallel(moe, get_architecture("mixtral"), runtime)
    runtime.update(expert_model_parallel_size=2)
    check_moe_parallel(moe, get_architecture("mixtral"), runtime)
    with pytest.raises(ModelError, match=r"parallel.sequence_parallel must be true to train"):
        check_moe_training(moe, 2, False)
    check_moe_training(moe, 2, True)
    check_moe_training(moe, 1, False)
    dense = type("Cfg", (), {"model_type": "qwen3"})()
    with pytest.raises(ModelError, match=r"parallel.ep=2 needs a mixture-of-experts model"):
        check_moe_parallel(dense, get_architecture("qwen3"), runtime)


def test_expert_tensor_parallel_size_is_validated():
    from megatron_grpo.config.base import ConfigValueError
    from megatron_grpo.config.model import ParallelConfig

    ParallelConfig(tp=2, etp=1, ep=2, world_size=4, global_batch_size=2)
    with pytest.raises(ConfigValueError, match=r"etp: must be >= 1 or null"):
        ParallelConfig(etp=0)
    with pytest.raises(ConfigValueError, match=r"etp: etp\*ep = 4\*1 does not divide world_size/pp = 2/1"):
        ParallelConfig(tp=2, etp=4, world_size=2, global_batch_size=2)


# ---- multi-rank ---------------------------------------------------------------------------
def _moe_worker(rank, world_size, cases, ckpt_out=None):
    from megatron_grpo.models import save_megatron_checkpoint

    results = {}
    for name, hf_dir in cases:
        cfg, chunks = build_and_load(hf_dir)
        results[name] = probe(cfg, chunks, hf_dir)
        if ckpt_out and name == ckpt_out[0]:
            save_megatron_checkpoint(chunks, ckpt_out[1], extra_state={"step": 2})
    return results


MULTI = {  # layout -> (world, tp, pp, ep, etp, cases); etp None = tp
    "ep2": (2, 1, 1, 2, None, ["qwen3_moe-norm", "mixtral"]),
    "pp2": (2, 1, 2, 1, None, ["mixtral"]),
    "tp2xep2": (4, 2, 1, 2, None, ["qwen3_moe-raw-tied"]),
    "tp2-etp1": (2, 2, 1, 1, 1, ["qwen3_moe-norm"]),  # experts whole on each tp rank
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(MULTI))
def test_multi_rank_logits_and_round_trip(layout, moe_models, tmp_path):
    world, tp, pp, ep, etp, names = MULTI[layout]
    cases = [(n, moe_models[n][0]) for n in names]
    ckpt_out = (names[0], str(tmp_path / "ckpt")) if layout == "ep2" else None
    results = run_distributed(_moe_worker, world, cases, ckpt_out, tp=tp, pp=pp, ep=ep, etp=etp, timeout_s=400)
    for name in names:
        assert_matches([r[name] for r in results], *moe_models[name])
    if ckpt_out:
        meta = json.loads((tmp_path / "ckpt" / "megatron_grpo.json").read_text())
        assert meta["saved_ep"] == 2
        # EP2 -> EP1, in a fresh single process: every expert comes back from the 2 EP shards
        (ep1,) = run_distributed(_load_ckpt_worker, 1, moe_models[names[0]][0], ckpt_out[1],
                                 tp=1, timeout_s=200)
        logits, report, extra = ep1
        assert extra == {"step": 2}
        assert_matches([(logits, report)], *moe_models[names[0]])


def _load_ckpt_worker(rank, world_size, hf_dir, ckpt_dir):
    cfg, chunks, extra = build_from_checkpoint(hf_dir, ckpt_dir)
    return (*probe(cfg, chunks, hf_dir), extra)


def test_convert_cli_both_ways_with_self_check(moe_models, single_rank, tmp_path, capsys):
    from megatron_grpo.models.convert_cli import run_command

    hf_dir, _ = moe_models["mixtral"]
    assert run_command("convert-hf-to-megatron", ["--hf-dir", hf_dir, "--output-dir", str(tmp_path / "mg")]) == 0
    assert run_command("convert-megatron-to-hf", ["--ckpt-dir", str(tmp_path / "mg"),
                                                  "--output-dir", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.count("self-check OK") == 2
    got, want = hf_tensors(tmp_path / "hf"), hf_tensors(hf_dir)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
