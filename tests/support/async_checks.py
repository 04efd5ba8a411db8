"""The async-mode checks shared by tests/test_async_e2e.py, test_async_rollouts.py and
test_async_inprocess.py: the demo run in async mode (``async_cmd``, ``run_train``) and its group
log (``async_groups``), the staleness bound over its metrics and group log (``check_bound``);
HF directories of three weight versions (``make_weight_versions``: conftest.py's
``weight_versions`` fixture) and each token's version and log-prob checked against the version
that drew it (``check_token_versions``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from megatron_grpo.inference.generation import Sequence
from tools.tiny import DEMO_ARCH
from tests.support.demo_run import ENV, ROOT, train_cmd
from tests.support.models_fixtures import make_hf_model

B, N = 8, 8  # prompts per step, responses per prompt


def async_cmd(demo, run_dir, steps, k, *extra, b=B, n=N):
    """The demo run's command in async mode with staleness bound ``k``, ``b`` prompts per step and
    ``n`` responses each, token-level TIS on."""
    return train_cmd(demo, run_dir, steps, "rollout.mode=async", f"rollout.max_staleness={k}",
                     f"rollout.prompts_per_step={b}", f"rollout.num_generations={n}",
                     f"parallel.global_batch_size={b * n // 4}", f"parallel.micro_batch_size={min(8, b * n // 4)}",
                     "logging.plot=false", "eval.every_n_steps=0",
                     "algorithm.off_policy_correction={tis_ratio_type: token}", *extra)


def run_train(command, timeout=600):
    """Run ``command`` (a train command) from the repository root; it must succeed."""
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def async_groups(run_dir) -> list[dict]:
    """The run's group log (``rollouts/async_groups.jsonl``), one dict per group."""
    path = run_dir / "rollouts" / "async_groups.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_bound(rows: list[dict], log: list[dict], k: int, b: int = B) -> None:
    """Every trained token within k versions of the trained step's, by the metrics and by the
    group log; each step trains B whole groups (N responses each: the trainer asserts the
    batch size) with distinct ids."""
    for r in rows:
        version = r["step"] - 1  # the weights step r["step"] trained hold
        assert 0 <= r["rollout/token_lag_min"] <= r["rollout/token_lag_max"] <= k, r
        assert r["rollout/policy_lag"] == r["rollout/token_lag_max"] == version - r["rollout/weight_version"]
        trained = [g for g in log if g["step"] == r["step"] and g["fate"] == "trained"]
        assert len(trained) == b and len({g["gid"] for g in trained}) == b
        assert all(version - g["start_version"] <= k for g in trained), trained
        assert len(r["rollout/prompt_indices"].split(",")) == b


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20]]
"""The prompts of the token-version tests."""


def make_weight_versions(root: Path) -> list[Path]:
    """Three HF directories of one architecture with different weights: versions 0, 1, 2. The
    demo models' size (``DEMO_ARCH``), so that the real-SGLang test of tests/test_async_rollouts.py
    is served by the session's shared server of that architecture (tests/support/sglang_shared.py)
    rather than a launch of its own."""
    return [make_hf_model(root / f"v{v}", "qwen2", tied=False, seed=10 + v, **DEMO_ARCH) for v in range(3)]


def _reference(hf_dir, seq: Sequence, upto: int) -> list[float]:
    """float64 log-probs of ``seq.output_ids[:upto]`` under the HF model of ``hf_dir``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([seq.prompt_ids + seq.output_ids[:upto]])).logits[0].double()
    logprobs = torch.log_softmax(logits, dim=-1)
    n = len(seq.prompt_ids)
    return [logprobs[n - 1 + i, t].item() for i, t in enumerate(seq.output_ids[:upto])]


def check_token_versions(samples, versions, new_tokens: int, tolerance: float) -> None:
    """Each of ``samples`` (sequences with ``prompt_ids``, ``output_ids``, ``output_logprobs``
    and ``output_versions``) drew ``new_tokens`` tokens under versions "0", "1" and "2" in that
    order (an update landed mid-flight twice), and each token's log-prob is the float64
    reference of the version that drew it within ``tolerance``; and the reference tells the
    versions apart (the first version-1 token scored by version 0 is off by more than 1e-3)."""
    worst = 0.0
    for s in samples:
        assert len(s.output_versions) == len(s.output_ids) == len(s.output_logprobs) == new_tokens
        assert all(s.output_versions.count(v) for v in ("0", "1", "2")), s.output_versions
        assert s.output_versions == sorted(s.output_versions)  # monotone: no token went back
        for v in range(3):
            first = s.output_versions.index(str(v))
            last = len(s.output_versions) - s.output_versions[::-1].index(str(v))
            ref = _reference(versions[v], s, last)[first:]
            worst = max(worst, max(abs(a - b) for a, b in zip(s.output_logprobs[first:last], ref)))
    assert worst <= tolerance, worst
    s = samples[0]
    first = s.output_versions.index("1")
    assert abs(_reference(versions[0], s, first + 1)[first] - s.output_logprobs[first]) > 1e-3
