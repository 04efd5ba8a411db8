"""Benchmark: fixed micro-batches vs token-budget micro-batches on a long-tailed length mix.

    python -m tools.bench.bench_batching            # 64 sequences, responses 8-128 tokens, 3 repeats
    python -m tools.bench.bench_batching --quick    # 16 sequences, 1 repeat: a smoke run

One trainer rank (``spawn_ranks``, gloo, one CPU thread) builds a tiny qwen2 policy and
runs what a GRPO step runs on the Megatron side: the forward-only log-prob pass
(``compute_log_probs``) and one optimizer step (``train_mini_batch``), through the real
megatron-core schedule, for each batching:

* ``fixed``: ``micro_batch_size`` rows per micro-batch, each padded to the batch's longest
  sequence (``parallel.max_tokens_per_microbatch: null``);
* ``budget = mbs x S``: the same peak micro-batch size in tokens (same activation memory),
  rows sorted and bucketed by length;
* ``budget = --budget``: a smaller budget.

Lengths: prompts 4-12 tokens; responses ``8 + Exp(mean 16)`` rounded, capped at 128 (most
are short, a few are long: the shape of real reasoning-length mixes). Reported per batching:
padding fraction (token slots run that hold no real token), micro-batches, median step time
over ``--repeats`` runs after a warm-up, and the ratio to ``fixed``. The loss of each batching
is printed too: it is the same (tests/test_trainer_step_equivalence.py pins it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch

from tools.bench.common import spawn_ranks


def long_tailed_batch(num_sequences: int, seed: int):
    """A TrainBatch with prompts of 4-12 tokens and responses of 8-128 tokens (long tail)."""
    from megatron_grpo.rollout.batch import build_train_batch

    gen = torch.Generator().manual_seed(seed)
    prompts, outputs = [], []
    for _ in range(num_sequences):
        prompts.append(torch.randint(7, 200, (int(torch.randint(4, 13, (1,), generator=gen)),), generator=gen).tolist())
        length = min(128, 8 + int(torch.empty(1).exponential_(1 / 16, generator=gen)))
        outputs.append(torch.randint(7, 200, (length,), generator=gen).tolist())
    logps = [(-torch.rand(len(o), generator=gen) * 3).tolist() for o in outputs]
    return build_train_batch(prompts, outputs, logps, torch.randn(num_sequences, generator=gen), pad_id=0)


def _worker(rank, world, hf_dir, num_sequences, micro_batch_size, budgets, repeats):
    from megatron.core import parallel_state as ps

    from megatron_grpo.config import AlgorithmConfig, ModelConfig, OptimizerConfig
    from megatron_grpo.trainer.components import build_policy
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs, train_mini_batch
    from megatron_grpo.trainer.microbatch import MicroBatching
    from megatron_grpo.trainer.microbatch import plan_micro_batches, sequence_lengths

    class Cfg:
        model = ModelConfig(hf_dir=hf_dir, dtype="float32")
        optimizer = OptimizerConfig(name="sgd", lr=1e-6, clip_grad=0.0)

        class parallel:
            use_distributed_optimizer = False
            sequence_parallel = False

    policy = build_policy(Cfg)
    spec = ScoringSpec(temperature=1.0, vocab_size=policy.hf_config.vocab_size)
    algo = AlgorithmConfig()
    batch = long_tailed_batch(num_sequences, seed=0)
    real = int(sequence_lengths(batch).sum())
    rows = []
    for budget in budgets:
        plan = plan_micro_batches(batch, micro_batch_size, budget)

        def step():
            batching = MicroBatching(micro_batch_size, budget)
            batch.old_log_probs = compute_log_probs(policy.chunks, batch, batching, spec)
            return train_mini_batch(policy.chunks, policy.optimizer, batch, algo, spec, batching,
                                    int(batch.loss_mask.sum()), batch.num_sequences, 1,
                                    ps.get_data_parallel_group())

        step()  # warm-up
        times, loss = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            metrics, _, _ = step()
            times.append(time.perf_counter() - t0)
            loss = metrics["loss"]
        rows.append(dict(budget=budget, padding=1 - real / plan.num_padded_tokens, num_mb=len(plan.rows),
                         slots=plan.num_padded_tokens, time=statistics.median(times), loss=loss))
    return dict(rows=rows, seq_length=batch.seq_length, real=real,
                lengths=sorted(sequence_lengths(batch).tolist()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--budget", type=int, default=512, help="the smaller token budget")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.sequences, args.repeats = 16, 1
    torch.set_num_threads(1)
    from tools.tiny import save_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = str(save_tiny_model(tmp, "qwen2", seed=1))
        probe = long_tailed_batch(args.sequences, seed=0)
        budgets = [None, args.micro_batch_size * probe.seq_length, args.budget]
        (out,) = spawn_ranks(_worker, 1, hf_dir, args.sequences, args.micro_batch_size, budgets,
                                 args.repeats, tp=1, pp=1, timeout_s=1800)
    lengths = out["lengths"]
    print(f"{args.sequences} sequences, prompt+response lengths {lengths[0]}-{lengths[-1]} "
          f"(median {lengths[len(lengths) // 2]}), real tokens {out['real']}, padded length S = {out['seq_length']}; "
          f"micro_batch_size {args.micro_batch_size}; log-prob pass + one optimizer step, median of {args.repeats}")
    print("| batching | micro-batches | token slots | padding fraction | step time (s) | time vs fixed | loss |")
    print("|---|---|---|---|---|---|---|")
    base = out["rows"][0]["time"]
    for r in out["rows"]:
        name = "fixed" if r["budget"] is None else f"budget {r['budget']}"
        print(f"| {name} | {r['num_mb']} | {r['slots']} | {r['padding']:.3f} | {r['time']:.3f} | "
              f"{r['time'] / base:.2f}x | {r['loss']:.6f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
