"""Benchmark for a GPU loan: the figures docs/gpu.md waits for, in priority order, resumable.

    python tools/bench_gpu.py --out OUT [--parts logprobs,train_qwen2.5-0.5b] [--force] [--work DIR]
    python tools/bench_gpu.py --smoke --out OUT      # CPU, tiny shapes, every part's code path

On one CUDA device (docs/gpu.md#benchmark-for-a-gpu-loan; ``bash launch/gpu_bench.sh OUT``
installs the carried wheels first). Each part writes ``OUT/<part>.json`` when it finishes;
a re-run skips a part whose file exists (``--force`` re-runs it), so a loan cut short loses
one part at most. Every part is sized to take well under 10 minutes (on an H200: 0.5-3 minutes
each, docs/gpu.md#figures). Every line printed starts with the GPU's name. The
parts, most wanted first:

1. ``logprobs``: ``tools/bench_logprobs.py``'s methods (every arm its ``run`` reports: our
   vocab-parallel log-prob + entropy op, megatron's ``vocab_parallel_cross_entropy``, CE +
   a separate entropy, ...) at V = 151936, 4096 tokens, bf16 logits, forward + backward;
2. ``train_qwen2.5-0.5b``, ``train_qwen2.5-1.5b``: the trainer's own step
   (``trainer.components.build_policy``, ``megatron_step.compute_log_probs`` and
   ``train_mini_batch``) on a model of that shape (``tools/make_sized_model.py``, random
   weights), TP1, one process, bf16, on a synthetic rollout batch: 64 rows (``Sizes``) of a
   256-token prompt and a long-tailed response (``256 + Exp(mean 384)`` tokens, at most 1792),
   each arm of ``TRAIN_ARMS`` (config overrides) in turn: tokens/s and MFU of the update
   (``models/flops.py``), the old-log-prob pass (forward only), the peak memory, and beside
   them a big bf16 matmul's measured TFLOP/s;
3. ``rollout``: the embedded engine's generation (``rollout/embedded``, in this process) at
   ``ROLLOUT_CONCURRENCY`` concurrent sequences (prompts of 128 tokens, ``8`` samples each,
   responses ``64 + Exp(mean 192)`` tokens, at most 512, EOS ignored so every runner makes
   the same tokens), against transformers' ``generate`` on the same model object and batch
   (which runs each batch to its longest response; only requested tokens count), and the
   static decode path (``engine.embedded.decode: static``: CUDA graphs, stops read every 8
   tokens) on the same requests in a fresh engine, timed on its second run (the first captures
   its graphs), with the count of sequences that drew exactly the eager engine's tokens;
4. ``weight_sync``: ``tools/bench_weight_sync.py``'s worker syncing the 0.5B model into a
   launched embedded engine on the same GPU over the ``tensor`` transport (CUDA IPC): GB/s,
   and the fraction of a device-to-device copy of the same bytes. Colocated mode
   (``engine.colocate``) is SGLang's only and is not measured here;
5. ``trl``: ``tools/bench_vs_trl.py --device cuda --workload reasoning`` as a subprocess, its
   output recorded.

``--smoke``: CPU, tiny shapes (a 2-layer model of each shape with a 2048-token vocabulary,
a few short sequences), seconds per part: every part's code path, except ``weight_sync`` (the
CUDA IPC transport) and ``trl`` (a GPU workload), which print one line each and write no
file. Without CUDA and without ``--smoke`` it prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatron_grpo.models.flops import ModelShape, forward_flops, mfu, peak_bf16_flops, train_flops  # noqa: E402

# megatron-core, transformers, the engine and the other benchmarks are imported inside the parts
# that use them: --help and the no-CUDA answer come back without loading them, and a part's
# spawned rank imports only what it runs.

EXIT_NO_GPU = 2
TRAIN_MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b")
PARTS = ("logprobs", *(f"train_{m}" for m in TRAIN_MODELS), "rollout", "weight_sync", "trl")
CUDA_ONLY = {"weight_sync": "the CUDA IPC tensor transport", "trl": "tools/bench_vs_trl.py --device cuda"}

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


@dataclass(frozen=True)
class Sizes:
    """How big each part runs (``FULL`` on a GPU, ``SMOKE`` on CPU)."""

    logprob_vocab: int = 151936
    logprob_tokens: int = 4096
    logprob_repeats: int = 10
    model_overrides: dict = field(default_factory=dict)
    """config.json fields changed in every sized model (tools/make_sized_model.py --set)."""
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
    dtype: str = "bfloat16"


FULL = Sizes()
SMOKE = replace(
    FULL, logprob_vocab=2048, logprob_tokens=64, logprob_repeats=1,
    model_overrides={"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2048},
    train_sequences=4, prompt_len=8, response_min=4, response_mean_extra=8.0, response_max=24, train_steps=1,
    train_arms=("budget 8k", "budget 8k, packed"), matmul_n=256, rollout_concurrency=(4,), rollout_prompt_len=8,
    rollout_samples_per_prompt=2, rollout_new_min=4, rollout_new_mean_extra=4.0, rollout_new_max=12,
    dtype="float32")


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
    """``work/models/<shape>`` built by tools/make_sized_model.py, reused while it was built with
    the same overrides and dtype (a smoke run's shrunk model is never taken for the real one)."""
    from tools.make_sized_model import build

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


# ---- part 1: the log-prob op -------------------------------------------------------------


def part_logprobs(sizes: Sizes, work: Path) -> dict:
    from tools.bench_logprobs import run

    cfg = dict(tokens=sizes.logprob_tokens, dtype="bfloat16", temperature=1.0, repeats=sizes.logprob_repeats,
               logit_std=3.0, chunk_size=None)
    rows = run([sizes.logprob_vocab], [1], cfg, timeout_s=540)
    for r in rows:
        say(f"logprobs: V={r['vocab']} tokens={r['tokens']} {r['method']}: {r['ms']:.2f} ms "
            f"({r['time_ratio']:.2f}x megatron CE), extra peak {r['peak_mb']:.0f} MB ({r['peak_shards']:.2f}x logits)")
    return {"config": cfg, "rows": rows}


# ---- part 2: the training step -----------------------------------------------------------


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
    from tests.support.distributed import run_distributed

    model_dir = sized_model(work, shape, sizes)
    arms = {name: TRAIN_ARMS[name] for name in sizes.train_arms}
    (res,) = run_distributed(_train_worker, 1, str(model_dir), sizes, arms, tp=1, pp=1, timeout_s=540)
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


# ---- part 3: rollout throughput ----------------------------------------------------------


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
    from tools.bench_generation import make_seqs

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
    from megatron_grpo.engine.engine import EmbeddedEngine

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


def part_rollout(sizes: Sizes, work: Path) -> dict:
    from megatron_grpo.engine.engine import EmbeddedEngine
    from tools.bench_generation import run_hf

    model_dir = sized_model(work, TRAIN_MODELS[0], sizes)
    out = {"model": TRAIN_MODELS[0], "dtype": sizes.dtype, "rows": []}
    for concurrency in sizes.rollout_concurrency:
        engine = EmbeddedEngine(model_dir, dtype=sizes.dtype, max_batch_size=concurrency, batch_window_s=0.0)
        try:
            vocab = engine.model.config.vocab_size
            engine_generate(engine, rollout_requests(min(8, concurrency), sizes, vocab, seed=1))  # warm-up
            reqs = rollout_requests(concurrency, sizes, vocab)
            useful = sum(r[1] for r in reqs)
            engine_s = _timed(lambda: engine_generate(engine, reqs))
            eager_tokens = engine_generate(engine, reqs)
            with engine.exclusive():  # the scheduler idles while generate borrows the model
                hf_s = _timed(lambda: run_hf(engine.model, reqs, concurrency))
        finally:
            engine.shutdown()
        engine = None  # the last reference: its memory goes back before the static engine loads
        _free_gpu_memory()
        static_s, same = _static_rollout(model_dir, sizes, concurrency, reqs, eager_tokens)
        row = {"concurrency": concurrency, "response_tokens": useful, "longest": max(r[1] for r in reqs),
               "engine_s": engine_s, "engine_tokens_per_s": useful / engine_s,
               "hf_generate_s": hf_s, "hf_generate_tokens_per_s": useful / hf_s,
               "static_stop_check_every": STATIC_STOP_CHECK_EVERY, "static_s": static_s,
               "static_tokens_per_s": useful / static_s, "static_vs_hf_generate": hf_s / static_s,
               "static_vs_engine": engine_s / static_s, "static_sequences_equal_to_engine": same}
        out["rows"].append(row)
        say(f"rollout {TRAIN_MODELS[0]} x{concurrency}: embedded engine {row['engine_tokens_per_s']:.0f} tokens/s, "
            f"hf generate {row['hf_generate_tokens_per_s']:.0f} tokens/s ({hf_s / engine_s:.2f}x), "
            f"static decode (k={STATIC_STOP_CHECK_EVERY}) {row['static_tokens_per_s']:.0f} tokens/s "
            f"({hf_s / static_s:.2f}x generate, {engine_s / static_s:.2f}x the engine; {same}/{len(reqs)} "
            f"sequences equal to the engine's), {useful} response tokens, longest {row['longest']}")
    return out


# ---- part 4: weight sync -----------------------------------------------------------------


def device_copy_seconds(num_bytes: int, repeats: int) -> float:
    """Best time of a device-to-device copy of ``num_bytes`` (one buffer; a memcpy on CPU)."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device="cuda" if torch.cuda.is_available() else "cpu")
    dst = torch.empty_like(src)
    return min(_timed(lambda: dst.copy_(src)) for _ in range(repeats + 1))


def part_weight_sync(sizes: Sizes, work: Path) -> dict:
    from megatron_grpo.config import EngineConfig, SyncConfig
    from megatron_grpo.generation.manager import RolloutServerManager
    from tests.support.configs import experiment
    from tests.support.distributed import run_distributed
    from tools.bench_weight_sync import _bench_worker

    model_dir = sized_model(work, TRAIN_MODELS[0], sizes)
    cfg = experiment(engine=EngineConfig(kind="embedded", dtype=sizes.dtype, launch_timeout_s=300),
                     sync=SyncConfig(transport="tensor"))
    with RolloutServerManager(cfg, model_dir=str(model_dir), run_dir=work / "weight_sync", ranks_on_node=1) as manager:
        (res,) = run_distributed(_bench_worker, 1, manager.urls[0], str(model_dir), str(work / "weight_sync/sync"),
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


# ---- part 5: TRL side by side ------------------------------------------------------------


def part_trl(sizes: Sizes, work: Path) -> dict:
    # TRL runs in this interpreter (on a lent GPU its wheels travel with megatron-core's, into
    # the PYTHONPATH launch/gpu_bench.sh sets): the CUDA torch of the machine, not the CPU-only
    # .venv-trl that tools/setup_trl_venv.sh builds.
    if importlib.util.find_spec("trl") is None:
        raise RuntimeError("trl is not importable in this interpreter: carry its wheels (docs/gpu.md)")
    cmd = [sys.executable, "tools/bench_vs_trl.py", "--device", "cuda", "--workload", "reasoning",
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


def run_part(part: str, sizes: Sizes, work: Path):
    if part == "logprobs":
        return part_logprobs(sizes, work)
    if part.startswith("train_"):
        return part_train(part[len("train_"):], sizes, work)
    return {"rollout": part_rollout, "weight_sync": part_weight_sync, "trl": part_trl}[part](sizes, work)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="one <part>.json per finished part is written here")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in order: {', '.join(PARTS)}")
    parser.add_argument("--force", action="store_true", help="re-run parts whose file exists")
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench_gpu_work"),
                        help="sized models and engine logs, kept for re-runs")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: every part's code path in seconds")
    args = parser.parse_args(argv)
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
    for part in parts:
        target = out / f"{part}.json"
        if target.is_file() and not args.force:
            say(f"{part}: done before ({target}), skipped (--force re-runs it)")
            continue
        if not cuda and part in CUDA_ONLY:
            say(f"{part}: skipped, needs CUDA ({CUDA_ONLY[part]})")
            continue
        t0 = time.monotonic()
        try:
            figures = run_part(part, sizes, work)
        except Exception as e:  # noqa: BLE001 - the next parts still run; each failure is one line
            failed.append(part)
            say(f"FAIL: {part}: {' '.join(f'{type(e).__name__}: {e}'.split())[:800]}")
            continue
        record = {"part": part, "device": device_name(), "torch": torch.__version__, "smoke": args.smoke,
                  "seconds": time.monotonic() - t0, "sizes": asdict(sizes), **figures}
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
        tmp.replace(target)
        say(f"{part}: {record['seconds']:.0f} s, wrote {target}")
        if figures.get("failed_arms"):  # the others' figures are kept; --force runs the part again
            failed.append(part)
    say("PASS" if not failed else f"FAIL: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
