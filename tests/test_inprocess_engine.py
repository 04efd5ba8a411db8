"""engine.kind: inprocess, with real components: the embedded engine's generation code in this
process (no server) and the in-memory weight sync from Megatron chunks at TP2 and PP2.

References are independent of the engine: transformers' own full forward (float64
log_softmax(logits / T), the kept set's mass over the full vocabulary), the launched-engine's
generation code run directly with the same seeds, and the trainer's Megatron forward at TP2/PP2
after the sync. The end-to-end runs (learning, log-prob identity, kill -9 and resume, top-p
replay) are the embedded engine's tests parametrised over the engine kind
(tests/test_trainer_e2e.py, tests/test_kill_resume.py, tests/test_sampling_mask.py).
"""

import pytest
import torch

from megatron_grpo.inference.engine import EmbeddedEngine
from megatron_grpo.generation.inprocess import InProcessEngine, start_inprocess
from megatron_grpo.wire.samples import SamplingParams
from tests.support.distributed import run_distributed
from tools.tiny import save_tiny_model
from tests.support.engine_runs import run
from tests.support.sync_checks import NUM_HF_TENSORS, engine_vs_trainer, perturb
from megatron_grpo.config import EngineConfig, RolloutConfig, SyncConfig
from tests.support.configs import experiment

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19]]
TRUNCATED = SamplingParams(temperature=1.2, top_p=0.8, top_k=40, min_p=0.02, max_new_tokens=10,
                           sampling_mask_max_kept=1024)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2", seed=11))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = InProcessEngine(start_inprocess(EngineConfig(dtype="float32"), model_dir=model_dir), None,
                          timeout_s=120)
    yield eng
    eng.close()


def test_truncated_samples_match_hf_forward_and_the_engines_own_sequences(engine, model_dir):
    """Log-probs and kept masses equal transformers' full forward; with the same seeds the
    tokens are those the embedded engine itself draws (same code, same semantics)."""
    samples = engine.generate(PROMPTS, 3, TRUNCATED, sampling_seed=40)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, j) for i in range(3) for j in range(3)]
    model = engine.engine.model
    for s in samples:
        assert s.server == "inprocess" and s.weight_version == "default" and len(s.output_ids) >= 1
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.output_ids])).logits[0].double()
        probs = torch.softmax(logits / TRUNCATED.temperature, dim=-1)
        n = len(s.prompt_ids)
        for i, token in enumerate(s.output_ids):
            row = probs[n - 1 + i]
            assert abs(s.output_logprobs[i] - row[token].log().item()) <= 1e-5
            assert token in s.kept_ids[i] and len(s.kept_ids[i]) <= 40
            assert abs(s.log_kept_mass[i] - row[s.kept_ids[i]].sum().log().item()) <= 1e-5
    other = EmbeddedEngine(model_dir, dtype="float32", max_batch_size=4, seed=5)
    try:  # the launched engine's path: its own Sequences, a batching window, another batch size
        params = dict(TRUNCATED.to_json())
        direct = [run(other, [p], dict(params, sampling_seed=40 + 3 * i + j))[0]
                  for i, p in enumerate(PROMPTS) for j in range(3)]
    finally:
        other.shutdown()
    assert [s.output_ids for s in samples] == [d.output_ids for d in direct]
    mine = torch.tensor([lp for s in samples for lp in s.output_logprobs])
    theirs = torch.tensor([lp for d in direct for lp in d.output_logprobs])
    assert (mine - theirs).abs().max().item() <= 1e-6


def test_bad_input_is_one_rollout_error(engine):
    from megatron_grpo.wire.samples import RolloutError

    with pytest.raises(RolloutError, match="input_ids must be in"):
        engine.generate([[10**6]], 1, SamplingParams(max_new_tokens=2))


def _worker(rank, world_size, model_dir, corrupt):
    from megatron_grpo.models import build_model, load_hf_config, load_hf_weights
    from megatron_grpo.sync.driver import WeightSync, WeightSyncError
    from megatron_grpo.sync.in_memory import InMemoryDelivery

    hf_config = load_hf_config(model_dir)
    chunks = build_model(hf_config, dtype=torch.float32, init_weights=False)
    load_hf_weights(chunks, model_dir, hf_config)
    cfg = experiment(engine=EngineConfig(dtype="float32", kind="inprocess"))
    inner = start_inprocess(cfg.engine, model_dir=model_dir) if rank == 0 else None
    engine = InProcessEngine(inner, WeightSync(cfg, hf_config, InMemoryDelivery(cfg, inner)), timeout_s=120)
    out = {}

    def probe(step):
        return engine_vs_trainer(engine if rank == 0 else None, chunks, hf_config, step)

    try:
        perturb(chunks, 7)
        out["stale"] = probe(7)[0]
        stats = engine.receive_weights(chunks, 7)
        out["stats"] = (stats.role, stats.num_tensors, stats.verified)
        out["synced"] = probe(7)
        if corrupt:
            perturb(chunks, 8)
            if rank == 0:  # fault injection: one tensor lands changed after its checksum was taken
                load = inner.load_weights

                def bad_load(named, **kwargs):
                    return load(((n, t + 1e-3 if n == "model.layers.1.mlp.up_proj.weight" else t)
                                 for n, t in named), **kwargs)

                inner.load_weights = bad_load
            try:
                engine.receive_weights(chunks, 8)
                out["corrupt"] = "not detected"
            except WeightSyncError as e:
                out["corrupt"] = str(e)
    finally:
        engine.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,corrupt", [(2, 1, True), (1, 2, False)], ids=["tp2", "pp2"])
def test_in_memory_sync_serves_the_trainers_weights(model_dir, tp, pp, corrupt):
    """After an optimizer-like update, the engine's log-probs of its own samples equal the
    trainer's Megatron forward (fp32); before the sync they do not. At TP2 a tensor changed after
    its checksum is named by the same sync's verification, on every rank."""
    results = run_distributed(_worker, 2, model_dir, corrupt, tp=tp, pp=pp, timeout_s=300)
    assert min(r["stale"] for r in results if r["stale"] is not None) > 1e-3
    deltas = [r["synced"][0] for r in results if r["synced"][0] is not None]
    assert deltas and max(deltas) <= 1e-5, deltas
    assert all(r["synced"][1] == {"7"} for r in results)
    assert results[0]["stats"] == ("coordinator+sender", NUM_HF_TENSORS, True)
    assert results[1]["stats"][0] == ("peer" if tp == 2 else "sender")
    if corrupt:
        for r in results:
            assert "model.layers.1.mlp.up_proj.weight differs between the trainer and the in-process engine" \
                in r["corrupt"], r["corrupt"]


def test_preflight_refuses_servers_for_the_in_process_engine():
    from megatron_grpo.config import ConfigError
    from megatron_grpo.preflight.rules import check_engine

    with pytest.raises(ConfigError, match="engine.urls.*runs inside the trainer"):
        check_engine(experiment(engine=EngineConfig(kind="inprocess", urls=["http://127.0.0.1:30000"])))
    with pytest.raises(ConfigError, match="engine.num_servers.*must be 1"):
        check_engine(experiment(engine=EngineConfig(kind="inprocess", num_servers=2)))
    with pytest.raises(ConfigError, match="engine.colocate"):
        check_engine(experiment(engine=EngineConfig(kind="inprocess", colocate=True),
                                sync=SyncConfig(transport="tensor")))
    # what it serves
    check_engine(experiment(rollout=RolloutConfig(top_p=0.8),
                            engine=EngineConfig(kind="inprocess", quantization="int8")))


def test_int8_rollouts_keep_their_own_quantized_copy(model_dir):
    """engine.quantization: the in-process engine serves the decoder's projections from its own
    int8 copy: the same draws and log-probs as the embedded engine's quantized path (which
    tests/test_quantized_rollouts.py checks against a fake-quantized reference)."""
    from megatron_grpo.ops.quantize import scheme_of

    cfg = EngineConfig(dtype="float32", quantization="int8")
    engine = InProcessEngine(start_inprocess(cfg, model_dir=model_dir), None, timeout_s=120)
    other = EmbeddedEngine(model_dir, dtype="float32", quantization=scheme_of("int8"))
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=6)
        samples = engine.generate(PROMPTS, 2, params, sampling_seed=3)
        direct = [run(other, [p], dict(params.to_json(), sampling_seed=3 + 2 * i + j))[0]
                  for i, p in enumerate(PROMPTS) for j in range(2)]
    finally:
        engine.close()
        other.shutdown()
    assert [s.output_ids for s in samples] == [d.output_ids for d in direct]
    mine = torch.tensor([lp for s in samples for lp in s.output_logprobs])
    assert (mine - torch.tensor([lp for d in direct for lp in d.output_logprobs])).abs().max().item() <= 1e-6
    assert engine.engine is None  # closed: its scheduler thread joined
