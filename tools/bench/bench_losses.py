"""``python -m tools.bench.bench_losses``: time the loss and measure micro-batch additivity.

For each policy loss, plain and with every extra on (KL, entropy, token TIS, outlier and
geometric masks), on a random float32 batch (default B = 64, T = 1024, 25% padding with NaN):
median forward+backward time, and the largest |difference| between the whole-batch loss /
gradient and (a) the sum over 8 micro-batches called with the global denominators (this
package's contract), (b) the average of per-micro-batch means (what a loss normalised per
micro-batch gives under Megatron's 1/num_microbatches scaling, e.g. SkyRL PR #849's token_mean).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_grpo.config import AlgorithmConfig
from megatron_grpo.losses import compute_policy_loss

EXTRAS = {
    "kl_loss_coef": 0.01,
    "entropy_coef": 0.001,
    "off_policy_correction": {
        "tis_ratio_type": "token",
        "outlier_token_is_threshold_high": 20.0,
        "sequence_mask_metric": "geometric",
    },
}


def random_batch(B: int, T: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    old = -torch.rand(B, T, generator=g) * 4
    batch = {
        "log_probs": old + 0.1 * torch.randn(B, T, generator=g),
        "old_log_probs": old,
        "rollout_log_probs": old + 0.02 * torch.randn(B, T, generator=g),
        "ref_log_probs": old + 0.2 * torch.randn(B, T, generator=g),
        "entropy": torch.rand(B, T, generator=g) * 3,
    }
    for t in batch.values():
        t[~mask] = float("nan")
    batch["advantages"] = torch.randn(B, generator=g)
    batch["loss_mask"] = mask
    return batch


def run_parts(
    batch: dict, cfg: AlgorithmConfig, parts: int, local_means: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and d/d(log_probs) summed over ``parts`` row chunks with the global denominators;
    ``local_means``: instead average per-part means (each part its own denominators), which is
    what a per-micro-batch mean under Megatron's 1/num_microbatches scaling computes."""
    lp = batch["log_probs"].clone().requires_grad_()
    ent = batch["entropy"].clone().requires_grad_()
    n_tokens, n_seqs = int(batch["loss_mask"].sum()), batch["loss_mask"].shape[0]
    chunks = torch.arange(n_seqs).chunk(parts)
    total = 0.0
    for rows in chunks:
        part = {k: v[rows] for k, v in batch.items()}
        part["log_probs"], part["entropy"] = lp[rows], ent[rows]
        if local_means:
            total = total + compute_policy_loss(config=cfg, **part)[0] / len(chunks)
        else:
            total = total + compute_policy_loss(config=cfg, num_tokens=n_tokens, num_sequences=n_seqs, **part)[0]
    total.backward()
    return total.detach(), lp.grad


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=8)
    args = parser.parse_args(argv)
    batch = random_batch(args.batch, args.length)
    print(f"B={args.batch} T={args.length} float32, {torch.get_num_threads()} threads")
    print(
        f"| loss | extras | fwd+bwd ms (median) | whole vs {args.micro_batches} parts: |loss diff| | max rel grad diff "
        "| per-part means instead: |loss diff| | max rel grad diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for loss_type in ("ppo", "gspo", "cispo", "sapo"):
        for name, extras in (("none", {}), ("KL+entropy+TIS+masks", EXTRAS)):
            cfg = AlgorithmConfig(policy_loss_type=loss_type, **extras)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                whole, whole_grad = run_parts(batch, cfg, 1)
                times.append((time.perf_counter() - start) * 1e3)
            rel = lambda g: ((g - whole_grad).abs().max() / whole_grad.abs().max()).item()  # noqa: E731
            split, split_grad = run_parts(batch, cfg, args.micro_batches)
            naive, naive_grad = run_parts(batch, cfg, args.micro_batches, local_means=True)
            print(
                f"| {loss_type} | {name} | {statistics.median(times):.1f} | "
                f"{(whole - split).abs().item():.1e} | {rel(split_grad):.1e} | "
                f"{(whole - naive).abs().item():.1e} | {rel(naive_grad):.1e} |"
            )


if __name__ == "__main__":
    main()
