"""Random TrainBatches for tests that compare one step across layouts (TP/PP/DP, batching,
precision): the same rows on every rank and in every process, from a fixed seed."""

from __future__ import annotations

import torch

from megatron_grpo.rollout.batch import TrainBatch, build_train_batch


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


def grouped_train_batch(num_groups: int = 2, group_size: int = 4, seed: int = 4) -> TrainBatch:
    """GRPO groups: ``num_groups`` prompts of 4-7 token ids, each answered ``group_size`` times
    with 1-4 ids (ids in [7, 200); every group's first two responses start with the same id,
    so they share one response token too, and its last response repeats its third whole, as
    identical samples do); rollout log-probs in (-3, 0], standard-normal advantages; rows
    group-major, padded with id 0 to [N, T]."""
    gen = torch.Generator().manual_seed(seed)
    prompts, outputs = [], []
    for _ in range(num_groups):
        prompt = torch.randint(7, 200, (int(torch.randint(4, 8, (1,), generator=gen)),), generator=gen).tolist()
        for k in range(group_size):
            out = torch.randint(7, 200, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
            if k == 1:
                out[0] = outputs[-1][0]
            if k == group_size - 1 and k >= 3:
                out = list(outputs[-1 - (k - 3)])
            prompts.append(prompt)
            outputs.append(out)
    logps = [(-torch.rand(len(o), generator=gen) * 3).tolist() for o in outputs]
    adv = torch.randn(len(outputs), generator=gen)
    return build_train_batch(prompts, outputs, logps, adv, pad_id=0)


def random_multi_turn_batch(num_sequences: int, seed: int = 5) -> TrainBatch:
    """``num_sequences`` multi-turn rows: a prompt of 3-5 ids, then 1-3 model turns of 1-3 ids
    with an observation of 1-3 ids between two turns (``output_mask`` 0: loss mask 0, rollout
    log-prob 0), ids in [7, 200); rollout log-probs in (-3, 0] on model tokens, standard-normal
    advantages; padded with id 0 to [N, T]. Row i's model-token count is ``loss_mask[i].sum()``."""
    gen = torch.Generator().manual_seed(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return torch.randint(7, 200, (int(torch.randint(lo, hi + 1, (1,), generator=gen)),), generator=gen).tolist()

    prompts, outputs, logps, masks = [], [], [], []
    for _ in range(num_sequences):
        prompts.append(ids(3, 5))
        out, lp, mask = [], [], []
        for turn in range(int(torch.randint(1, 4, (1,), generator=gen))):
            if turn:
                obs = ids(1, 3)
                out, lp, mask = out + obs, lp + [0.0] * len(obs), mask + [0] * len(obs)
            model = ids(1, 3)
            out += model
            lp += (-torch.rand(len(model), generator=gen) * 3).tolist()
            mask += [1] * len(model)
        outputs.append(out)
        logps.append(lp)
        masks.append(mask)
    adv = torch.randn(num_sequences, generator=gen)
    return build_train_batch(prompts, outputs, logps, adv, pad_id=0, output_masks=masks)
