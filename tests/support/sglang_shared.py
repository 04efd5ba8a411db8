"""The session's real SGLang servers, shared by the tests that need a server to talk to rather
than a launch to watch (the ``sglang`` fixture in tests/conftest.py).

One SGLang launch costs 30-90 s on 2 CPU cores, more than most tests that use it. So the
session launches one server per model architecture on first use (the demo models' Qwen2,
``DEMO_ARCH``, serves the multi-turn, external-server and tool-demo tests) and stops them all
when it ends. tests/test_rollout_client.py launches its own tiny Llama server: on a shared one
reset from disk, its tensor-update test failed when run alone (it passed only after the
module's earlier tests), so it keeps a fresh launch per module. ``SGLangServers.serve(model_dir)``
resets the server of ``model_dir``'s architecture before each use, so tests stay
order-independent:

1. a weight-update session an earlier test left open is closed, and generation resumed;
2. ``model_dir``'s weights are loaded from disk under weight version "default" (the version a
   fresh launch reports) and the cache is flushed;
3. the server's log-probs of a fixed probe sequence must equal transformers' forward of
   ``model_dir`` within ``PROBE_TOLERANCE``, both as a prompt (prefill) and as sampled
   continuations (``DECODE_PROBE``: tokens drawn one at a time through the KV cache, scored by
   transformers teacher-forced), so a server whose decoding was left broken by an earlier test
   is caught even though its prefill is right;
4. a server that fails 1-3 is stopped and launched afresh once (with a warning naming what
   failed, so CI's summary shows it), and the test fails only if the fresh one fails too.

What a reset cannot undo, a test that uses the shared server must not do: kill it, change its
launch arguments, or leave a distributed weight-update group that still expects a peer. Tests
whose point is the launch itself (servers the trainer starts, a server death, the dtype a
launch resolves) launch their own.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import time
import warnings
from pathlib import Path

import psutil
import torch

from megatron_grpo.generation import RolloutClient, RolloutError
from megatron_grpo.wire.samples import SamplingParams
from megatron_grpo.generation.manager import RolloutServerManager
from tools.tiny import build_tokenizer
from megatron_grpo.config import EngineConfig, SGLangConfig
from tests.support.configs import experiment

SGLANG_MEMORY = {"mem_fraction_static": 0.5, "extra_args": ["--max-total-tokens", "65536"]}
"""How every test's SGLang server sizes its memory. SGLang on CPU sizes its KV pool from the
machine's free memory: what is free after loading the weights, less (1 - fraction) x what was
free before. At 0.1 the weights and whatever the other test worker allocates meanwhile had to
fit in a tenth of the free memory, and a launch beside a SmolLM2 run failed ("Loaded weights
leave no GPU memory for the KV cache under --mem-fraction-static=0.1"); half leaves room for
the other worker, and the pool is capped at 65,536 tokens (a few hundred MB for the tiny
models; the suite's largest batches hold a few thousand)."""
SGLANG_OVERRIDES = ["engine.sglang.mem_fraction_static=0.5",
                    "engine.sglang.extra_args=[--max-total-tokens, '65536']"]
"""``SGLANG_MEMORY`` as config overrides of a `megatron-grpo train` command line."""

API_KEY = f"shared-sglang-{secrets.token_hex(16)}"
"""The key every shared server enforces (given to SGLang in a 0600 file, as for any launch).
Random per session: the runs that use a shared server get it as an override on their command
line, which must not match another session's key (tests/test_rollout_client.py looks for its
key on every command line of the machine)."""

PROBE_TEXT = "<|user|> what is 12 + 30 ? <|assistant|> compute 12 + 30 <eos> <|user|> result 42 <|assistant|> 42 <eos>"
DECODE_PROBE = 8, 6
"""Sampled continuations of the probe's prompt (everything up to its first ``<|assistant|>``)
checked after each reset: (how many, new tokens each), temperature 1, a fixed seed."""
PROBE_TOLERANCE = 1e-4
"""Largest |served - transformers| log-prob on the probe after a reset (fp32 on both sides;
SGLang's CPU build agrees to ~1e-5, tests/test_rollout_client.py)."""

_CONFIG_NOISE = ("_name_or_path", "transformers_version")  # keys that say nothing of the architecture


def architecture(model_dir: str | Path) -> str:
    """A key naming what a server must be launched with to serve ``model_dir`` by loading its
    weights from disk: its config.json (less the noise) and its tokenizer files."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    h = hashlib.sha256(json.dumps({k: v for k, v in config.items() if k not in _CONFIG_NOISE},
                                  sort_keys=True).encode())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = model_dir / name
        h.update(path.read_bytes() if path.is_file() else b"-")
    return f"{config['model_type']}-{h.hexdigest()[:12]}"


def probe_ids() -> list[int]:
    return build_tokenizer()(PROBE_TEXT, add_special_tokens=False)["input_ids"]


def reference_probe_logprobs(model_dir: str | Path, ids: list[int], model=None) -> torch.Tensor:
    """transformers' fp32 log-probs of ``ids[1:]`` given their prefixes (the probe's reading)."""
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def decode_probe_diff(client: RolloutClient, model_dir: str | Path, model) -> float:
    """Largest |served - transformers| log-prob over ``DECODE_PROBE``'s sampled continuations of
    the probe's prompt from ``client``'s server: each drawn token's log-prob as the server reports
    it (decoded through its KV cache) against transformers' teacher-forced forward of the prompt
    and the draw (``model``: ``model_dir`` loaded in fp32)."""
    ids = probe_ids()
    prompt = ids[:ids.index(build_tokenizer().convert_tokens_to_ids("<|assistant|>")) + 1]
    n, new_tokens = DECODE_PROBE
    samples = client.generate([prompt], n, SamplingParams(temperature=1.0, max_new_tokens=new_tokens,
                                                          ignore_eos=True), sampling_seed=1234)
    worst = 0.0
    for sample in samples:
        assert len(sample.output_ids) == new_tokens, (sample.finish_reason, sample.output_ids)
        ref = reference_probe_logprobs(model_dir, prompt + sample.output_ids, model)[len(prompt) - 1:]
        served = torch.tensor(sample.output_logprobs, dtype=torch.float64)
        worst = max(worst, (served - ref).abs().max().item())
    return worst


class _Server:
    """One launched SGLang server (its manager and a client with the shared key)."""

    def __init__(self, model_dir: Path, run_dir: Path):
        cfg = experiment(engine=EngineConfig(kind="sglang", api_key=API_KEY, dtype="float32", launch_timeout_s=600,
                                             request_timeout_s=120, sglang=SGLangConfig(**SGLANG_MEMORY)))
        self.manager = RolloutServerManager(cfg, model_dir=str(model_dir), run_dir=run_dir)
        (self.url,) = self.manager.start()
        self.client = RolloutClient([self.url], api_key=API_KEY, request_timeout_s=120, max_retries=2)

    def reset(self, model_dir: str | Path) -> None:
        from transformers import AutoModelForCausalLM

        client, url = self.client, self.url
        assert self.manager.alive(), f"the shared SGLang server at {url} died (see {self.manager.log_path})"
        try:  # a test that failed inside a begin/end bracket leaves the session open
            client.call("end_weight_update", {}, url=url, retry=False)
        except RolloutError as e:
            if "no weight-update session is open" not in str(e):
                raise
        client.continue_generation(url)
        client.run(client.aio.update_weights_from_disk(url, str(model_dir), weight_version="default"))
        client.flush_cache(url)
        assert client.weight_version(url) == "default"
        ids = probe_ids()
        served = torch.tensor(client.prompt_logprobs(url, ids), dtype=torch.float64)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()  # once per reset
        diff = (served - reference_probe_logprobs(model_dir, ids, model)).abs().max().item()
        assert diff <= PROBE_TOLERANCE, (f"the shared SGLang server at {url} does not serve {model_dir} after its "
                                         f"reset: probe log-probs differ by {diff:.2e} > {PROBE_TOLERANCE}")
        decoded = decode_probe_diff(client, model_dir, model)
        assert decoded <= PROBE_TOLERANCE, (f"the shared SGLang server at {url} decodes {model_dir} wrongly after "
                                            f"its reset: sampled tokens' log-probs differ from transformers' by "
                                            f"{decoded:.2e} > {PROBE_TOLERANCE}")

    def stop(self) -> None:
        self.client.close()
        pgids = self.manager.pids  # each launched server leads its own process group
        self.manager.stop()
        left = _processes_in_groups(pgids)
        assert not left, f"shared SGLang processes outlived the session: {left}"


def _processes_in_groups(pgids: list[int], grace_s: float = 10.0) -> list[int]:
    """Pids still in the process groups ``pgids`` after ``grace_s`` (the kernel reaps killed
    ones asynchronously)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) in pgids and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p.pid)
            except (psutil.Error, ProcessLookupError):
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


class SGLangServers:
    """The session's shared SGLang servers, one per architecture, launched on first use."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._servers: dict[str, _Server] = {}

    def serve(self, model_dir: str | Path) -> str:
        """The URL of a server reset to serve ``model_dir`` (see the module docstring)."""
        arch = architecture(model_dir)
        server = self._servers.get(arch)
        if server is None:
            # launched from a copy of the first model asked for: the server reads its config and
            # tokenizer at start, and the test that asked may remove its own directory
            launch_dir = self.root / arch / "model"
            shutil.copytree(model_dir, launch_dir)
            server = self._servers[arch] = _Server(launch_dir, self.root / arch / "run")
        try:
            server.reset(model_dir)
        except (AssertionError, RolloutError) as e:
            # What an earlier test left behind could not be undone: a fresh launch, said loudly.
            warnings.warn(f"shared SGLang server for {arch} relaunched: its reset failed: {' '.join(str(e).split())[:400]}")
            self._servers.pop(arch)
            server.stop()
            server = self._servers[arch] = _Server(self.root / arch / "model", self.root / arch / f"run-{time.time_ns()}")
            server.reset(model_dir)
        return server.url

    @staticmethod
    def train_overrides(url: str, engine: str = "sglang") -> list[str]:
        """`megatron-grpo train` overrides that make a run use the shared server at ``url`` (as
        an engine of kind ``engine``)."""
        return [f"engine.kind={engine}", f"engine.urls=[{url}]", f"engine.api_key={API_KEY}"]

    def close(self) -> None:
        servers, self._servers = list(self._servers.values()), {}
        errors = []
        for server in servers:
            try:
                server.stop()
            except AssertionError as e:
                errors.append(str(e))
        assert not errors, "; ".join(errors)
