"""One GRPO step at any layout, for the context-parallel invariance suite
(tests/test_context_parallel.py): ``cp_step`` runs the trainer's own old-log-prob pass and
update (``trainer.megatron_step``: the real megatron-core schedule, DDP, optimizer,
vocab-parallel op and corrected loss) on one of the batches below and returns every metric,
the grad norm, the updated HF weights and the scored log-probs, so a CP2/CP4 run can be held
to the CP1 run number for number."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_grpo.rollout.batch import TrainBatch, build_train_batch
from tests.support.batches import random_multi_turn_batch, random_train_batch

GLOBAL_BATCH = 8


def long_batch(num_sequences: int = GLOBAL_BATCH, seed: int = 11) -> TrainBatch:
    """Rows long enough that every CP chunk holds prompt and response tokens: prompts of 6-20
    ids, responses of 3-24 ids (lengths that 2 x cp seldom divides); rollout log-probs in
    (-3, 0], standard-normal advantages."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(7, 200, (int(torch.randint(6, 21, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(num_sequences)]
    outputs = [torch.randint(7, 200, (int(torch.randint(3, 25, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(num_sequences)]
    logps = [(-torch.rand(len(o), generator=gen) * 3).tolist() for o in outputs]
    return build_train_batch(prompts, outputs, logps, torch.randn(num_sequences, generator=gen), pad_id=0)


def edge_batch() -> TrainBatch:
    """The corner cases of the split: a 2-token row (one prompt, one response token: shorter
    than 2 x cp, so some ranks hold padding only), a row whose response is fully masked (an
    observation alone: it scores nothing), rows of 5, 7 and 13 tokens (2 x cp divides none),
    and longer rows; advantages of both signs."""
    prompts = [[11], [12, 13, 14], [21, 22], [31, 32, 33, 34], [41] * 9, [51, 52], [61, 62, 63], [71] * 5]
    outputs = [[9], [15, 16], [23, 24, 25, 26, 27], [35, 36, 37], [42, 43, 44, 45], [53] * 11, [64, 65], [72] * 8]
    masks = [None, [0, 0], None, None, None, None, [1, 0], None]
    gen = torch.Generator().manual_seed(17)
    logps = [[0.0 if m is not None and not m[i] else -float(torch.rand(1, generator=gen)) * 3 for i in range(len(o))]
             for o, m in zip(outputs, masks)]
    adv = torch.tensor([0.5, -1.0, 1.2, -0.3, 0.8, -1.5, 0.4, 1.0])
    return build_train_batch(prompts, outputs, logps, adv, pad_id=0,
                             output_masks=[m or [1] * len(o) for o, m in zip(outputs, masks)])


BATCHES = {"random": lambda: random_train_batch(GLOBAL_BATCH), "long": long_batch, "edge": edge_batch,
           "multi_turn": lambda: random_multi_turn_batch(GLOBAL_BATCH)}


def cp_step(rank, world, hf_dir, batch="long", micro=2, budget=None, pack=False, algorithm=None, reference=False,
            cp=1, sequence_parallel=False, lr=1.0, lora=False):
    """One optimizer step (SGD at ``lr``: the update is the gradient, so any gradient difference
    shows) on ``BATCHES[batch]``'s rows of this DP rank, micro-batches of ``micro`` rows or
    ``budget`` tokens (``pack``: packed), the corrected loss of ``algorithm`` (AlgorithmConfig
    keywords) with a stand-in reference (``reference``: log-probs off the policy's, so a KL term
    has a gradient). ``cp``: the layout's context-parallel size (the ranks run under it).
    ``lora``: a rank-4 LoRA policy on every linear layer (its B starts at 0: the step trains B;
    the weights compared are the merged ones).
    Returns {metrics (last stage, else None), applied, grad_norm, weights (HF names: this
    rank's), old_lp [N/dp, T] (last stage, else None), entropy [N/dp, T] (last stage)}."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from megatron_grpo.config.model import LoraConfig, ParallelConfig
    from megatron_grpo.models import iter_hf_weights
    from megatron_grpo.rollout.batch import dp_shard
    from megatron_grpo.trainer.components import build_policy
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs, train_mini_batch
    from megatron_grpo.trainer.microbatch import MicroBatching

    parallel = ParallelConfig(tp=ps.get_tensor_model_parallel_world_size(), cp=cp,
                              sequence_parallel=sequence_parallel)
    model = ModelConfig(hf_dir=hf_dir, dtype="float32", lora=LoraConfig(rank=4, alpha=8.0) if lora else None)
    policy = build_policy(SimpleNamespace(model=model,
                                          optimizer=OptimizerConfig(name="sgd", lr=lr, clip_grad=0.0),
                                          parallel=parallel))
    algo = AlgorithmConfig(**{"eps_clip_high": 0.28, "off_policy_correction": {"tis_ratio_type": "token"},
                              **(algorithm or {})})
    spec = ScoringSpec(temperature=0.7, vocab_size=policy.hf_config.vocab_size)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    full = BATCHES[batch]()
    local = dp_shard(full, dp_rank, dp, GLOBAL_BATCH)
    if reference:
        local.ref_log_probs = local.rollout_log_probs.clone()
    batching = MicroBatching(micro, budget, pack, False)
    old_lp = compute_log_probs(policy.chunks, local, batching, spec)
    local.old_log_probs = old_lp if old_lp is not None else torch.zeros_like(local.rollout_log_probs)
    metrics, applied, grad_norm = train_mini_batch(
        policy.chunks, policy.optimizer, local, algo, spec, batching, int(full.loss_mask.sum()),
        full.num_sequences, dp, ps.get_data_parallel_group())
    weights = {k: v.clone() for k, v in iter_hf_weights(policy.modules, policy.hf_config)}
    return {"metrics": metrics, "applied": applied, "grad_norm": grad_norm, "weights": weights, "old_lp": old_lp,
            "loss_mask": local.loss_mask, "dp_rank": dp_rank}
