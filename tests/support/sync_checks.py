"""Weight sync checked end to end (tests/test_sync_weights.py, test_vpp.py, test_moe_trainer.py,
test_inprocess_engine.py): on every rank, Megatron chunks perturbed like an optimizer step
(``perturb``), synced into an engine, then the engine's log-probs of its own samples compared
with the trainer's recomputation (``engine_vs_trainer``); ``sync_worker`` runs that for each
transport over HTTP (and a bucket corrupted on the wire), ``check_sync`` asserts on its results."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_grpo.wire.samples import SamplingParams
from megatron_grpo.config import EngineConfig, SyncConfig
from tests.support.configs import experiment

PROMPT = [5, 6, 7, 8, 9, 10]
TEMPERATURE = 0.8
NUM_HF_TENSORS = 1 + 2 * 12 + 1 + 1  # qwen2: embed, 2 layers x (2 norms, q/k/v w+b, o, gate, up, down), norm, lm_head


@torch.no_grad()
def perturb(chunks, step: int) -> None:
    """Deterministic noise like an optimizer update: identical on replicas of a parameter
    (DP ranks, TP ranks for replicated ones, and the first and last PP stages' copies of a
    tied embedding, which megatron keeps equal by all-reducing their gradients), distinct
    per TP shard."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if getattr(param, "shared_embedding", False):
                name = "shared_embedding"
            shard = tp_rank if getattr(param, "tensor_model_parallel", False) else 0
            seed = (sum(map(ord, name)) * 1009 + step * 7919 + shard * 104729) % (2**31)
            g = torch.Generator().manual_seed(seed)
            param.add_(0.02 * torch.randn(param.shape, generator=g, dtype=param.dtype))


def engine_vs_trainer(engine, chunks, hf_config, step: int) -> tuple[float | None, set]:
    """Collective: rank 0's ``engine`` (a client or a RolloutEngine; None elsewhere) samples
    4 responses to PROMPT; every rank scores them with the trainer's forward. Returns (mean
    |engine - trainer| log-prob over the samples or None, the weight versions served)."""
    samples = None
    if engine is not None:
        samples = engine.generate([PROMPT], 4, SamplingParams(temperature=TEMPERATURE, max_new_tokens=8),
                                  sampling_seed=step)
    holder = [samples]
    dist.broadcast_object_list(holder, src=0)
    deltas = []
    for s in holder[0]:
        ref = trainer_logprobs(chunks, hf_config, s.prompt_ids, s.output_ids)
        if ref is not None:
            deltas.append((torch.tensor(s.output_logprobs, dtype=torch.float64) - ref).abs())
    return (torch.cat(deltas).mean().item() if deltas else None), {s.weight_version for s in holder[0]}


def trainer_logprobs(chunks, hf_config, prompt, output) -> torch.Tensor | None:
    """log_softmax(logits / T) of ``output`` after ``prompt`` (last PP stage; None elsewhere)."""
    from megatron_grpo.models import forward_logits, gather_vocab

    ids = torch.tensor([prompt + output])
    logits = forward_logits(chunks, ids)
    if logits is None:
        return None
    logits = gather_vocab(logits, hf_config.vocab_size)[0].double()
    lp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
    return torch.stack([lp[len(prompt) - 1 + i, t] for i, t in enumerate(output)])


def sync_worker(rank, world_size, url, work_dir, model_dir, transports, corrupt):
    from megatron_grpo.models import build_model, load_hf_config, load_hf_weights
    from megatron_grpo.generation import RolloutClient
    from megatron_grpo.sync.driver import WeightSync, WeightSyncError
    from megatron_grpo.sync.servers import ServerDelivery

    hf_config = load_hf_config(model_dir)
    chunks = build_model(hf_config, dtype=torch.float32, init_weights=False)
    load_hf_weights(chunks, model_dir, hf_config)
    client = RolloutClient([url], request_timeout_s=120)
    out = {"deltas": {}, "versions": {}, "stats": {}}

    def probe(step):
        return engine_vs_trainer(client if rank == 0 else None, chunks, hf_config, step)

    for i, transport in enumerate(transports):
        step = 100 * (world_size + len(transports)) + i + 1  # distinct per call
        perturb(chunks, step)
        if i == 0:  # the probe can tell: before the sync the engine serves other weights
            out["stale_delta"] = probe(step)[0]
        cfg = experiment(engine=EngineConfig(request_timeout_s=120),
                         sync=SyncConfig(transport=transport, bucket_mb=1))
        syncer = WeightSync(cfg, hf_config, ServerDelivery(cfg, [url], hf_config, work_dir=work_dir, client=client))
        stats = syncer.sync(chunks, step)
        syncer.close()
        delta, versions = probe(step)
        out["deltas"][transport] = delta
        out["versions"][transport] = (versions, str(step))
        out["stats"][transport] = (stats.role, stats.num_tensors, stats.verified)
    if corrupt:
        perturb(chunks, 999)
        cfg = experiment(sync=SyncConfig(transport="distributed", bucket_mb=1))
        syncer = WeightSync(cfg, hf_config, ServerDelivery(cfg, [url], hf_config, client=client))
        if syncer.sender and syncer.roles.stage == 0:
            send = syncer.delivery.transport.send

            def corrupted_send(bucket, _done=[], **kwargs):
                if not _done:  # flip one byte in the middle of the first bucket, on the wire
                    pack = bucket.pack

                    def bad_pack(out=None):
                        flat = pack(out)
                        flat[flat.numel() // 2] ^= 0x5A
                        return flat

                    bucket.pack = bad_pack
                    _done.append(True)
                send(bucket, **kwargs)

            syncer.delivery.transport.send = corrupted_send
        try:
            syncer.sync(chunks, 999)
            out["corrupt"] = "not detected"
        except WeightSyncError as e:
            out["corrupt"] = str(e)
        syncer.close()
        # A failed sync leaves the engine paused (it must not sample from bad weights); the
        # next clean sync recovers it.
        syncer = WeightSync(cfg, hf_config, ServerDelivery(cfg, [url], hf_config, client=client))
        syncer.sync(chunks, 1000)
        syncer.close()
        out["recovered"] = probe(1000)
    client.close()
    return out


def check_sync(results, transports, world_size):
    """``sync_worker``'s results: after each transport's sync every rank that scored the probe saw
    the engine match the trainer (mean |Δ| <= 1e-5) and serve the synced version; before the
    first sync it did not (the check is sensitive). Returns the ranks' sync roles, sorted."""
    for transport in transports:
        deltas = [r["deltas"][transport] for r in results if r["deltas"][transport] is not None]
        assert deltas, "no rank scored the probe"
        assert max(deltas) <= 1e-5, (transport, deltas)
        for r in results:
            served, step = r["versions"][transport]
            assert served == {step}, (transport, served, step)
    stale = [r["stale_delta"] for r in results if r["stale_delta"] is not None]
    assert min(stale) > 1e-3, stale  # the check is sensitive: unsynced weights fail it
    roles = sorted(r["stats"][transports[0]][0] for r in results)
    return roles
