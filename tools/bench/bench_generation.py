"""Benchmark: continuous batching vs fixed-batch waves vs ``transformers`` ``generate``.

    python -m tools.bench.bench_generation             # 16 prompts x 4, batch 16, 5 repeats
    python -m tools.bench.bench_generation --quick     # 4 prompts x 4, 1 repeat: a smoke run

One process, one CPU thread, the same model object and the same requests for every runner:

* models: the CPU demo's (``tools/make_demo_model.py``: qwen2, hidden 128, 2 layers; built
  into ``--demo-dir`` if missing) and a larger tiny qwen2 (hidden 256, 4 layers, MLP 1024)
  where per-token compute matters more;
* requests: ``--prompts`` random prompts of 8-24 tokens, ``--n`` samples each, temperature 1,
  seeded per sample, ``ignore_eos`` with a long-tailed per-sample ``max_new_tokens``
  (``8 + Exp(mean 24)``, capped at 128): every runner produces exactly these lengths;
* ``wave``: the fixed-batch scheduling this engine had before continuous batching (a copy
  of its decode loop, kept HERE only as the baseline): the next ``--batch`` queued sequences
  run as one batch until the last of them finishes; finished rows are dropped from the
  cache once they are a quarter of the batch;
* ``continuous``: ``scheduler.run_continuous`` (the engine's path): rows are admitted when a
  quarter of the batch is free, the ``n`` samples of a prompt share one prefill;
  ``continuous, admit each row`` admits as soon as one row is free (``min_admit=1``): more
  merges, to show what a merge costs;
* ``static``: ``static_decode.StaticDecoder`` (``engine.embedded.decode: static``, CPU: no
  graphs): ``--batch`` rows of a preallocated cache, draws on the device, the host reading the
  tokens (and admitting into free rows) every ``--stop-check-every`` tokens; its tokens are checked equal to
  ``continuous``'s (seeded) in the warm-up round. On a CPU it measures the host work the static
  path removes and the padding rows it decodes; its point is the GPU (``tools/bench/bench_gpu.py``);
* ``hf generate``: ``model.generate(do_sample=True, temperature=1, top_k=0)`` on the same
  waves of ``--batch`` sequences (left-padded); it has no per-row length limit, so each
  wave runs to its longest limit (``min_new_tokens`` = ``max_new_tokens``: EOS ignored) and
  only the requested tokens are counted as useful.

Tokens/s = requested response tokens / wall time. The runners are interleaved round robin
``--repeats`` times after one warm-up round, and the median is reported (the machine is
shared). The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from megatron_grpo.inference.batch import RunningBatch
from megatron_grpo.inference.generation import Sequence, finish_reason_for, left_pad
from megatron_grpo.inference.sampling import draw_uniforms, resolve_sampling_params, sample_next
from megatron_grpo.inference.scheduler import StepControl, run_continuous
from megatron_grpo.inference.static_decode import StaticDecoder

from tools.tiny import save_tiny_model

PAD_ID = 0


def requests(num_prompts: int, n: int, vocab_size: int, seed: int) -> list[tuple[list[int], int, int]]:
    """(prompt ids, max_new_tokens, sampling seed) per sample; the n samples of a prompt adjacent."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for p in range(num_prompts):
        length = int(torch.randint(8, 25, (1,), generator=gen))
        prompt = torch.randint(10, vocab_size, (length,), generator=gen).tolist()
        for i in range(n):
            extra = float(torch.empty(1).exponential_(1 / 24, generator=gen))
            out.append((prompt, min(128, 8 + int(extra)), p * n + i))
    return out


def make_seqs(reqs) -> list[Sequence]:
    seqs = []
    for prompt, max_new, seed in reqs:
        params = resolve_sampling_params({"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True,
                                          "sampling_seed": seed})
        seqs.append(Sequence(rid=str(seed), prompt_ids=prompt, params=params,
                             generator=torch.Generator().manual_seed(seed)))
    return seqs


@torch.inference_mode()
def wave_baseline(model, seqs: list[Sequence]) -> None:
    """The pre-continuous-batching decode loop of one wave (prefill all, decode until the last
    finishes, drop finished rows once they are a quarter of the batch); prompt log-probs,
    routing and pause control left out (unused here)."""
    from transformers import DynamicCache

    ids, mask, positions = left_pad([s.prompt_ids for s in seqs], PAD_ID)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    batch = RunningBatch(seqs=list(seqs), cache=cache, mask_BT=mask, next_pos_B=mask.sum(1),
                         last_logits_BV=out.logits[:, -1])
    gen = torch.Generator().manual_seed(0)
    while True:
        rows = batch.seqs
        uniforms = draw_uniforms([s.generator for s in rows], gen)
        tokens, logprobs = sample_next(batch.last_logits_BV, torch.tensor([s.params.temperature for s in rows]),
                                       torch.tensor([s.params.top_k for s in rows]),
                                       torch.tensor([s.params.top_p for s in rows]),
                                       torch.tensor([s.params.min_p for s in rows]), uniforms)
        for s, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
            if not s.finished:
                s.output_ids.append(token)
                s.output_logprobs.append(logprob)
                reason = finish_reason_for(s, token, frozenset(), 1 << 20)
                if reason is not None:
                    s.finish(reason, "v")
        if batch.num_live == 0:
            return
        if (len(rows) - batch.num_live) * 4 >= len(rows):
            keep = [i for i, s in enumerate(rows) if not s.finished]
            batch.select(keep)  # the old loop's batch_select_indices, without compaction
            tokens = tokens[keep]
        batch.mask_BT = torch.cat([batch.mask_BT, torch.ones_like(batch.mask_BT[:, :1])], dim=1)
        out = model(input_ids=tokens[:, None], attention_mask=batch.mask_BT, position_ids=batch.next_pos_B[:, None],
                    past_key_values=batch.cache, use_cache=True)
        batch.next_pos_B = batch.next_pos_B + 1
        batch.last_logits_BV = out.logits[:, -1]


def run_waves(model, reqs, batch_size: int) -> None:
    seqs = make_seqs(reqs)
    for start in range(0, len(seqs), batch_size):
        wave_baseline(model, seqs[start:start + batch_size])
    assert [len(s.output_ids) for s in seqs] == [r[1] for r in reqs]


def run_cont(model, reqs, batch_size: int, min_admit=None, stats=None, static: Optional[StaticDecoder] = None) -> list:
    """``run_continuous`` (or ``static.run``) on the requests; returns each sample's tokens."""
    seqs = make_seqs(reqs)
    queue = list(seqs)

    def admit(k):
        taken = queue[:k]
        del queue[:k]
        if taken and stats is not None:
            stats["admissions"] = stats.get("admissions", 0) + 1
        return taken

    kwargs = dict(max_batch_size=batch_size, eos_ids=frozenset(), pad_id=PAD_ID,
                  shared_generator=torch.Generator().manual_seed(0), max_context=1 << 20,
                  control=lambda: StepControl.CONTINUE, weight_version=lambda: "v")
    if static is not None:
        static.run(model, admit, **kwargs)
    else:
        run_continuous(model, admit, min_admit=min_admit, **kwargs)
    assert [len(s.output_ids) for s in seqs] == [r[1] for r in reqs]
    return [s.output_ids for s in seqs]


@torch.inference_mode()
def run_hf(model, reqs, batch_size: int) -> None:
    for start in range(0, len(reqs), batch_size):
        chunk = reqs[start:start + batch_size]
        ids, mask, _ = left_pad([r[0] for r in chunk], PAD_ID)
        ids, mask = ids.to(model.device), mask.to(model.device)
        longest = max(r[1] for r in chunk)
        torch.manual_seed(start)
        model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                       max_new_tokens=longest, min_new_tokens=longest, pad_token_id=PAD_ID)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def build_models(demo_dir: Path, tmp: Path) -> dict[str, Path]:
    if not (demo_dir / "model" / "config.json").is_file():
        from tools.make_demo_model import main as make_demo
        make_demo(["--out", str(demo_dir)])
    larger = save_tiny_model(tmp / "qwen2_larger", "qwen2", seed=0, hidden_size=256, intermediate_size=1024,
                             num_layers=4, num_heads=8, num_kv_heads=4)
    return {"demo (h128, 2 layers)": demo_dir / "model", "larger (h256, 4 layers)": larger}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="max sequences decoded together")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-check-every", type=int, default=8, help="the static runner's k")
    parser.add_argument("--demo-dir", default="runs/demo_cpu")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.repeats = 4, 1
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, model_dir in build_models(Path(args.demo_dir), Path(tmp)).items():
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            reqs = requests(args.prompts, args.n, model.config.vocab_size, args.seed)
            useful = sum(r[1] for r in reqs)
            stats: dict = {}
            static = StaticDecoder(stop_check_every=args.stop_check_every, use_graphs=False)
            runners = {
                "wave (before)": lambda: run_waves(model, reqs, args.batch),
                "continuous": lambda: run_cont(model, reqs, args.batch, stats=stats),
                "continuous, admit each row": lambda: run_cont(model, reqs, args.batch, min_admit=1),
                f"static, k={args.stop_check_every}": lambda: run_cont(model, reqs, args.batch, static=static),
                "hf generate": lambda: run_hf(model, reqs, args.batch),
            }
            warm = {key: fn() for key, fn in runners.items()}  # warm-up round
            assert warm[f"static, k={args.stop_check_every}"] == warm["continuous"], "static != continuous tokens"
            times: dict[str, list[float]] = {k: [] for k in runners}
            for _ in range(args.repeats):
                for key, fn in runners.items():
                    times[key].append(timed(fn))
            print(f"\n{name}: {args.prompts} prompts x {args.n} samples, batch {args.batch}, "
                  f"{useful} response tokens (8-128, long-tailed), {args.repeats} repeats, median; "
                  f"continuous admissions per run: {stats['admissions'] // (args.repeats + 1)}")
            base = statistics.median(times["wave (before)"])
            hf = statistics.median(times["hf generate"])
            cont = statistics.median(times["continuous"])
            print("| runner | wall s | tokens/s | vs wave | vs continuous | vs hf generate |")
            print("|---|---:|---:|---:|---:|---:|")
            for key, ts in times.items():
                wall = statistics.median(ts)
                print(f"| {key} | {wall:.2f} | {useful / wall:.0f} | {base / wall:.2f}x | {cont / wall:.2f}x "
                      f"| {hf / wall:.2f}x |")
    print(f"\nload average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
