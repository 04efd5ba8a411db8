"""The shared-prefix forward against padded and packed rows, in one run: the update step's and
the log-prob pass's seconds on GRPO groups of the main job's shapes.

    python -m tools.bench.bench_shared_prefix [--model smollm2|demo] [--world 2] [--groups 4]
                                        [--group-size 8] [--prompt-tokens 46]
                                        [--response-tokens 20] [--steps 4]

A GRPO group's rows all start with one prompt; row-per-sequence training runs it once per
row. With ``parallel.share_prefix`` (and ``pack_sequences``) each micro-batch runs a group's
prompt once and every row's response attends to that copy (``models.packing``). Three modes,
each in fresh ranks (``spawn_ranks(fresh=True)``) that build the trainer's policy
(megatron chunks, DDP, megatron-core Adam) and run ``--steps`` forward-only log-prob passes
and ``--steps`` optimizer steps on one batch (split over the data-parallel ranks), timed after
a warm-up step:

* ``padded``: one micro-batch of each rank's rows padded to the longest (the main job before);
* ``packed``: the rows concatenated without padding (``pack_sequences``);
* ``shared``: packed, each group's prompt once (``share_prefix``).

The batch: ``--groups`` prompts of ``--prompt-tokens`` (+-2) random ids, each answered
``--group-size`` times with 1..``--response-tokens`` ids (the SmolLM2 task's shapes by
default: a 46-token chat prompt, responses ~9 tokens on average, the longest ~20). Printed per
mode: median seconds of each pass, the first step's loss (the same in all three: the step is
exact, ``tests/test_trainer_step_equivalence.py``), token slots run per rank, and the ratio to
``padded``. Try ``--prompt-tokens 512`` for a long shared context (few-shot, agent system prompt).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from tools.bench.bench_scored_logits import add_shape_arguments, bench_policy, time_passes
from tools.bench.common import bench_model_dir, spawn_ranks

MODES = {"padded": (False, False), "packed": (True, False), "shared": (True, True)}
"""mode -> (pack_sequences, share_prefix)."""


def grouped_batch(vocab: int, groups: int, group_size: int, prompt: int, response: int, seed: int = 0):
    """``groups`` x ``group_size`` rows, group-major: each group's prompt of ``prompt`` (+-2)
    random ids, each row's response 1..``response`` ids (one row per group at ``response``),
    random rollout log-probs and advantages."""
    from megatron_grpo.rollout.batch import build_train_batch

    gen = torch.Generator().manual_seed(seed)
    prompts, outputs = [], []
    for _ in range(groups):
        ids = torch.randint(0, vocab, (prompt + int(torch.randint(-2, 3, (1,), generator=gen)),), generator=gen)
        for k in range(group_size):
            n = response if k == 0 else int(torch.randint(1, response + 1, (1,), generator=gen))
            prompts.append(ids.tolist())
            outputs.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
    logps = [(-torch.rand(len(o), generator=gen) * 3).tolist() for o in outputs]
    return build_train_batch(prompts, outputs, logps, torch.randn(len(outputs), generator=gen), pad_id=0)


def _bench(rank, world, hf_dir, mode, steps, groups, group_size, prompt, response):
    from megatron.core import parallel_state as ps

    from megatron_grpo.rollout.batch import dp_shard
    from megatron_grpo.trainer.microbatch import MicroBatching

    policy, spec = bench_policy(hf_dir)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    full = grouped_batch(spec.vocab_size, groups, group_size, prompt, response)
    local = dp_shard(full, dp_rank, dp, full.num_sequences)
    pack, share = MODES[mode]
    # one micro-batch per rank in every mode: the budget holds all of a rank's rows
    batching = MicroBatching(local.num_sequences, int(local.tokens.numel()) if pack else None, pack, share)
    res = time_passes(policy, full, local, batching, spec, steps)
    return {**res, "slots": res.pop("metrics")["num_padded_tokens"] / dp}  # pooled over dp: per rank


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(p)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        hf_dir = bench_model_dir(args.model, Path(work))
        results = {}
        for mode in MODES:
            (res, *_) = spawn_ranks(_bench, args.world, hf_dir, mode, args.steps, args.groups, args.group_size,
                                        args.prompt_tokens, args.response_tokens, tp=1, pp=1, timeout_s=3600,
                                        fresh=True)
            results[mode] = res
            print(f"{mode:>7}: log-prob pass {res['logprob_s']:.2f} s, update {res['update_s']:.2f} s, "
                  f"loss {res['first_loss']:.6f}, token slots per rank {res['slots']:.0f}", flush=True)
    base = results["padded"]
    for mode in ("packed", "shared"):
        r = results[mode]
        print(f"{mode} / padded: log-prob pass {r['logprob_s'] / base['logprob_s']:.2f}x, "
              f"update {r['update_s'] / base['update_s']:.2f}x, token slots {r['slots'] / base['slots']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
