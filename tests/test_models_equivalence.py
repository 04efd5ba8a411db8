"""Megatron models built from HF configs compute the HF logits, and their weights go back to
HF bitwise, at TP1, TP2, PP2 and TP2xPP2 (gloo ranks); checkpoints reshard across layouts.

Reference: the HF transformers model's fp32 logits (max |Δ| <= 1e-5). Coverage: every
arch x tied/untied at TP1 (in-process); each multi-rank layout runs two (arch, tied) cases
so that every arch meets at least two layouts and each layout sees tied and untied:

    TP2:     qwen2 untied, llama tied
    PP2:     qwen3 tied,   llama untied
    TP2xPP2: qwen2 tied,   qwen3 untied  + checkpoint TP1 -> TP2xPP2 and TP2xPP2 -> TP1
"""

import json
from pathlib import Path

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.models_fixtures import hf_reference_logits, hf_tensors, make_hf_model
from tests.support.models_reference import TOL, build_and_load, build_from_checkpoint, probe

CASES = [(m, t) for m in ("llama", "qwen2", "qwen3") for t in (False, True)]
LAYOUTS = {  # name -> (world, tp, pp, cases)
    "tp2": (2, 2, 1, [("qwen2", False), ("llama", True)]),
    "pp2": (2, 1, 2, [("qwen3", True), ("llama", False)]),
}


def case_id(case):
    return f"{case[0]}-{'tied' if case[1] else 'untied'}"


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """(model_type, tied) -> (hf_dir, reference logits [B, S, V])."""
    root = tmp_path_factory.mktemp("hf_models")
    out = {}
    for seed, (model_type, tied) in enumerate(CASES):
        path = make_hf_model(root / case_id((model_type, tied)), model_type, tied, seed=seed)
        out[(model_type, tied)] = (str(path), hf_reference_logits(path))
    return out




# ---- work done on every rank --------------------------------------------------------------
def _layout_worker(rank, world_size, cases, ckpt_in=None, ckpt_out=None):
    results = {}
    for (model_type, tied), hf_dir in cases:
        cfg, chunks = build_and_load(hf_dir)
        results[(model_type, tied)] = probe(cfg, chunks, hf_dir)
        if ckpt_out and (model_type, tied) == ckpt_out[0]:
            from megatron_grpo.models import save_megatron_checkpoint

            save_megatron_checkpoint(chunks, ckpt_out[1], extra_state={"step": 7})
    if ckpt_in:
        key, hf_dir, ckpt_dir = ckpt_in
        cfg, chunks, extra = build_from_checkpoint(hf_dir, ckpt_dir)
        results["from_ckpt"] = (*probe(cfg, chunks, hf_dir), extra)
    return results


# ---- assertions --------------------------------------------------------------------------
def assert_matches_hf(per_rank_results, key, hf_models):
    """Exactly one rank holds the logits; they match HF; the union of exported names over the
    PP stages is the HF state dict, every tensor bitwise."""
    hf_dir, ref = hf_models[key]
    logits = [r[key][0] for r in per_rank_results if r[key][0] is not None]
    assert len(logits) == 1
    assert logits[0].shape == ref.shape
    delta = (logits[0] - ref).abs().max().item()
    assert delta <= TOL, f"{key}: max |Δlogits| = {delta}"
    exported = [n for r in per_rank_results for n in r[key][1]["exported"]]
    not_bitwise = {n for r in per_rank_results for n in r[key][1]["not_bitwise"]}
    assert not not_bitwise, f"{key}: not bitwise after the round trip: {sorted(not_bitwise)}"
    assert sorted(set(exported)) == sorted(hf_tensors(hf_dir))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tp1_logits_and_round_trip(case, hf_models, single_rank):
    hf_dir, _ = hf_models[case]
    cfg, chunks = build_and_load(hf_dir)
    assert_matches_hf([{case: probe(cfg, chunks, hf_dir)}], case, hf_models)


def test_tp1_llama3_rope_scaling_matches_hf(tmp_path, single_rank):
    # rope_theta 1e6 with head_dim 16: most frequencies have wavelengths above 8192/low_freq
    # and get scaled, so a wrong scaling would move the logits far above 1e-5.
    rope = {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    path = make_hf_model(tmp_path / "llama3", "llama", False, seed=5)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = rope
    (path / "config.json").write_text(json.dumps(config))
    ref = hf_reference_logits(path)
    cfg, chunks = build_and_load(path)
    logits, _ = probe(cfg, chunks, path)
    assert (logits - ref).abs().max().item() <= TOL
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
    (path / "config.json").write_text(json.dumps(config))
    assert (hf_reference_logits(path) - ref).abs().max().item() > 100 * TOL  # scaling matters


def test_tp1_checkpoint_round_trip_keeps_extra_state(hf_models, single_rank, tmp_path):
    from megatron_grpo.models import save_megatron_checkpoint

    key = ("qwen3", False)
    hf_dir, _ = hf_models[key]
    cfg, chunks = build_and_load(hf_dir)
    ckpt = tmp_path / "ckpt"
    save_megatron_checkpoint(chunks, ckpt, extra_state={"step": 3, "lr": 0.5})
    # CPU: megatron's writer reported through a forked manager, not a spawned one that
    # re-imports torch (runtime/cpu_shim.py)
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert filesystem_async._results_queue._manager._process.__class__.__name__ == "ForkProcess"
    assert (ckpt / "hf" / "config.json").read_bytes() == (Path(hf_dir) / "config.json").read_bytes()
    assert (ckpt / "hf" / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".ckpt*"))  # temp dir renamed away
    cfg2, chunks2, extra = build_from_checkpoint(hf_dir, ckpt)
    assert extra == {"step": 3, "lr": 0.5}
    assert_matches_hf([{key: probe(cfg2, chunks2, hf_dir)}], key, hf_models)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_multi_rank_logits_and_round_trip(layout, hf_models):
    world, tp, pp, cases = LAYOUTS[layout]
    args = [(case, hf_models[case][0]) for case in cases]
    results = run_distributed(_layout_worker, world, args, tp=tp, pp=pp, timeout_s=400)
    for case in cases:
        assert_matches_hf(results, case, hf_models)


@pytest.mark.slow
def test_tp2xpp2_and_checkpoints_reshard_to_and_from_tp1(hf_models, single_rank, tmp_path):
    from megatron_grpo.models import save_megatron_checkpoint

    # TP1 -> TP2xPP2: saved with an unpadded vocabulary (255 rows) at TP1, loaded into 256-row
    # TP2 shards; the embeddings' padding differs between the two layouts.
    in_key, out_key = ("qwen3", False), ("qwen2", True)
    cfg, chunks = build_and_load(hf_models[in_key][0], make_vocab_size_divisible_by=1)
    assert chunks[0].embedding.word_embeddings.weight.shape[0] == 255
    save_megatron_checkpoint(chunks, tmp_path / "tp1")
    ckpt_in = (in_key, hf_models[in_key][0], str(tmp_path / "tp1"))
    ckpt_out = (out_key, str(tmp_path / "tp2pp2"))
    cases = [(c, hf_models[c][0]) for c in (out_key, in_key)]
    results = run_distributed(_layout_worker, 4, cases, ckpt_in, ckpt_out, tp=2, pp=2, timeout_s=300)
    for case in (out_key, in_key):
        assert_matches_hf(results, case, hf_models)
    assert_matches_hf([{in_key: r["from_ckpt"][:2]} for r in results], in_key, hf_models)

    # TP2xPP2 -> TP1 (tied embeddings: the last stage's output-layer copy is not saved twice)
    cfg, chunks, extra = build_from_checkpoint(hf_models[out_key][0], tmp_path / "tp2pp2",
                                               make_vocab_size_divisible_by=1)
    assert extra == {"step": 7}
    assert_matches_hf([{out_key: probe(cfg, chunks, hf_models[out_key][0])}], out_key, hf_models)


def test_checkpoint_with_optimizer_state_exports_to_hf(hf_models, single_rank, tmp_path, capsys):
    """The trainer's layout: model + megatron optimizer state in one sharded state dict. The
    export (and the model loader) ignore the optimizer entries."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_grpo.models import model_sharded_state_dict, save_megatron_checkpoint
    from megatron_grpo.models.convert_cli import run_command

    key = ("llama", True)
    hf_dir, _ = hf_models[key]
    cfg, chunks = build_and_load(hf_dir)
    ddp = [DistributedDataParallel(config=c.config, ddp_config=DistributedDataParallelConfig(), module=c)
           for c in chunks]
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), ddp)
    state = model_sharded_state_dict(chunks)
    state["optimizer"] = optimizer.sharded_state_dict(state)
    save_megatron_checkpoint(chunks, tmp_path / "ckpt", extra_state={"step": 1}, sharded_state_dict=state)

    assert run_command("convert-megatron-to-hf", ["--ckpt-dir", str(tmp_path / "ckpt"),
                                                  "--output-dir", str(tmp_path / "hf")]) == 0
    assert "self-check OK" in capsys.readouterr().out
    got, want = hf_tensors(tmp_path / "hf"), hf_tensors(hf_dir)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
