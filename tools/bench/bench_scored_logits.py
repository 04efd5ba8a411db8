"""The output layer on the scored positions only, against every position, in one run: the
update step's and the log-prob pass's seconds on the main job's shapes.

    python -m tools.bench.bench_scored_logits [--model smollm2|demo] [--world 2] [--rows 32]
                                        [--prompt-tokens 46] [--response-tokens 20] [--steps 4]

A GRPO micro-batch scores only its responses, but a forward computes the vocabulary-sized
logits (and their log-softmax, and its backward) at every position; the trainer now runs the
output layer from the micro-batch's first scored position on (``models.forward``,
``trainer.megatron_step.first_scored``). This measures what that saves: each mode runs in
fresh ranks (``spawn_ranks(fresh=True)``) that build the trainer's policy (megatron chunks,
DDP, megatron-core Adam) and run ``--steps`` forward-only log-prob passes and ``--steps``
optimizer steps on one batch of ``--rows`` sequences (split over the data-parallel ranks, one
micro-batch each, as the main job's config), timed after a warm-up step; ``all positions``
is the same code with ``first_scored`` giving 0. The defaults are the SmolLM2 task's shapes
(a 46-token chat prompt, the longest response of a batch ~20 tokens; the main job's metrics:
1771 real tokens in 32 sequences, responses 8.8 tokens on average). Printed per mode: median
seconds of each, the loss (the same in both: the step is exact,
``tests/test_trainer_step_equivalence.py``), and the ratio scored/all.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tools.bench.common import bench_model_dir, spawn_ranks


def _batch(vocab: int, rows: int, prompt: int, response: int, seed: int = 0):
    """``rows`` sequences of ``prompt`` prompt tokens (+-2, as sums of numbers of 1-2 digits
    vary) and 1..``response`` response tokens, random ids, log-probs and advantages."""
    from megatron_grpo.rollout.batch import build_train_batch

    gen = torch.Generator().manual_seed(seed)
    lengths = [(prompt + int(torch.randint(-2, 3, (1,), generator=gen)),
                int(torch.randint(1, response + 1, (1,), generator=gen))) for _ in range(rows)]
    lengths[0] = (lengths[0][0], response)  # the batch's longest response, as padded
    prompts = [torch.randint(0, vocab, (p,), generator=gen).tolist() for p, _ in lengths]
    outputs = [torch.randint(0, vocab, (r,), generator=gen).tolist() for _, r in lengths]
    logps = [(-torch.rand(r, generator=gen) * 3).tolist() for _, r in lengths]
    return build_train_batch(prompts, outputs, logps, torch.randn(rows, generator=gen), pad_id=0)


def bench_policy(hf_dir: str):
    """(the trainer's fp32 policy of ``hf_dir`` on this rank: megatron chunks, DDP, megatron-core
    Adam at lr 1e-6; its ScoringSpec at the main job's temperature 0.7), seeded alike in every
    mode of a bench."""
    from megatron_grpo.config import ModelConfig, OptimizerConfig
    from megatron_grpo.trainer.megatron_step import ScoringSpec
    from tools.bench.common import policy_of

    torch.manual_seed(0)
    policy = policy_of(ModelConfig(hf_dir=hf_dir, dtype="float32"),
                               OptimizerConfig(name="adam", lr=1e-6, clip_grad=1.0))
    return policy, ScoringSpec(temperature=0.7, vocab_size=policy.hf_config.vocab_size)


def add_shape_arguments(p: argparse.ArgumentParser) -> None:
    """The options both pass benches share: the model, the data-parallel ranks, the task's
    prompt and response lengths and the timed steps."""
    p.add_argument("--model", choices=["smollm2", "demo"], default="smollm2")
    p.add_argument("--world", type=int, default=2, help="data-parallel ranks (the main job's DP2)")
    p.add_argument("--prompt-tokens", type=int, default=46)
    p.add_argument("--response-tokens", type=int, default=20)
    p.add_argument("--steps", type=int, default=4)


def _bench(rank, world, hf_dir, all_positions, steps, rows, prompt, response):
    from megatron.core import parallel_state as ps

    from megatron_grpo.rollout.batch import dp_shard
    from megatron_grpo.trainer import megatron_step

    if all_positions:
        megatron_step.first_scored = lambda mask: 0
    policy, spec = bench_policy(hf_dir)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    full = _batch(spec.vocab_size, rows, prompt, response)
    local = dp_shard(full, dp_rank, dp, rows)
    return {**time_passes(policy, full, local, local.num_sequences, spec, steps), "seq_length": full.seq_length}


def time_passes(policy, full, local, batching, spec, steps: int) -> dict:
    """``steps`` forward-only log-prob passes and optimizer steps of ``policy`` on this rank's
    rows ``local`` of the batch ``full`` (``batching``: ``trainer.microbatch.MicroBatching`` or
    a row count), each timed between barriers after a warm-up one: the median seconds of each
    (``logprob_s``, ``update_s``), the first step's loss and the last step's metrics."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_grpo.config import AlgorithmConfig
    from megatron_grpo.trainer.megatron_step import compute_log_probs, train_mini_batch

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        return time.perf_counter() - t0, out

    dp = ps.get_data_parallel_world_size()
    logprob_s, update_s, losses, metrics = [], [], [], {}
    for _ in range(steps + 1):  # the first of each: warm-up
        s, old = timed(lambda: compute_log_probs(policy.chunks, local, batching, spec))
        logprob_s.append(s)
        local.old_log_probs = old
        s, (metrics, _, _) = timed(lambda: train_mini_batch(
            policy.chunks, policy.optimizer, local, AlgorithmConfig(), spec, batching, int(full.loss_mask.sum()),
            full.num_sequences, dp, ps.get_data_parallel_group()))
        update_s.append(s)
        losses.append(metrics["loss"])
    return {"logprob_s": statistics.median(logprob_s[1:]), "update_s": statistics.median(update_s[1:]),
            "first_loss": losses[0], "metrics": metrics}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(p)
    p.add_argument("--rows", type=int, default=32)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        hf_dir = bench_model_dir(args.model, Path(work))
        results = {}
        for mode, all_positions in (("all positions", True), ("scored positions", False)):
            (res, *_) = spawn_ranks(_bench, args.world, hf_dir, all_positions, args.steps, args.rows,
                                        args.prompt_tokens, args.response_tokens, tp=1, pp=1, timeout_s=3600,
                                        fresh=True)
            results[mode] = res
            print(f"{mode:>16}: log-prob pass {res['logprob_s']:.2f} s, update {res['update_s']:.2f} s, "
                  f"loss {res['first_loss']:.6f} (sequence length {res['seq_length']})", flush=True)
    a, s = results["all positions"], results["scored positions"]
    print(f"scored / all: log-prob pass {s['logprob_s'] / a['logprob_s']:.2f}x, "
          f"update {s['update_s'] / a['update_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
