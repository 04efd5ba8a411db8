"""Random TrainBatches for tests that compare one step across layouts (TP/PP/DP, batching,
precision): the same rows on every rank and in every process, from a fixed seed."""

from __future__ import annotations

import torch

from megatron_grpo.trainer.batch import TrainBatch, build_train_batch


def random_train_batch(num_sequences: int, seed: int = 3) -> TrainBatch:
    """``num_sequences`` rows: prompts of 3-5 and responses of 1-4 token ids in [7, 200), rollout
    log-probs in (-3, 0] (off the trainer's, so the off-policy block does something) and
    standard-normal advantages; padded with id 0 to [N, T]."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(7, 200, (int(torch.randint(3, 6, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(num_sequences)]
    outputs = [torch.randint(7, 200, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(num_sequences)]
    logps = [(-torch.rand(len(o), generator=gen) * 3).tolist() for o in outputs]
    adv = torch.randn(num_sequences, generator=gen)
    return build_train_batch(prompts, outputs, logps, adv, pad_id=0)
