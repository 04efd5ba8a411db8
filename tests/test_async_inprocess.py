"""``rollout.mode: async`` on the in-process engine (``engine.kind: inprocess``).

The engine side: the in-memory sync (``sync/in_memory.py``) retracts the sequences in flight,
copies the new weights, sets the version and resumes, so sequences that span two syncs carry,
token by token, the version and the log-prob of the weights that drew them. Checked through the
real ``InProcessEngine.generate`` (called from a worker thread, as the async scheduler does)
and the real in-memory ``WeightSync``, against a float64 transformers forward of each version's
weights (``check_token_versions``, tests/support/async_checks.py, as tests/test_async_rollouts.py
checks the embedded engine). Then a real trainer run: the staleness bound, whole groups and lag
``k`` reached, as tests/test_async_e2e.py checks the embedded engine.
"""

import threading
import time

import pytest

from megatron_grpo.preflight.rules import check_engine
from megatron_grpo.inference.engine import EmbeddedEngine
from megatron_grpo.generation.inprocess import InProcessEngine
from megatron_grpo.wire.samples import SamplingParams
from megatron_grpo.sync.driver import WeightSync
from megatron_grpo.sync.in_memory import InMemoryDelivery
from tests.support.async_checks import PROMPTS, async_cmd, async_groups, check_bound, check_token_versions, run_train
from tests.support.demo_run import read_metrics
from tests.support.models_fixtures import hf_tensors
from megatron_grpo.config import EngineConfig, RolloutConfig
from tests.support.configs import experiment

NEW_TOKENS = 160


def _tokens_so_far(engine: EmbeddedEngine) -> list[int]:
    """Output tokens of each sequence the engine's running batch holds (its scheduler's list)."""
    return [len(s.output_ids) for s in list(engine._taken)]


def test_inprocess_sync_retracts_and_tokens_carry_their_version_and_log_prob(weight_versions):
    engine = EmbeddedEngine(weight_versions[0], dtype="float32", max_batch_size=8, batch_window_s=0.0, seed=0)
    engine.weight_version = "0"
    cfg = experiment(rollout=RolloutConfig(mode="async"), engine=EngineConfig(kind="inprocess"))
    receiver = WeightSync(cfg, None, InMemoryDelivery(cfg, engine),
                          iter_weights=lambda chunks, hf_config: iter(chunks))
    inprocess = InProcessEngine(engine, receiver, timeout_s=300)
    out: dict = {}

    def generate():  # a worker thread of the async scheduler
        try:
            out["samples"] = inprocess.generate(PROMPTS, 1, SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS,
                                                                           ignore_eos=True), sampling_seed=7)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            out["error"] = e

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        for step, target in ((1, 20), (2, 60)):  # two syncs, each while every sequence is mid-flight
            deadline = time.monotonic() + 60
            while True:
                so_far = _tokens_so_far(engine)
                if len(so_far) == len(PROMPTS) and min(so_far) >= target:
                    break
                assert time.monotonic() < deadline and "error" not in out, ("generation too slow", out)
                time.sleep(0.001)
            stats = receiver.sync(list(hf_tensors(weight_versions[step]).items()), step)
            assert stats.verified and engine.weight_version == str(step) and engine.paused is None
        worker.join(timeout=120)
        assert not worker.is_alive() and "error" not in out, out
    finally:
        inprocess.close()
    check_token_versions(out["samples"], weight_versions, NEW_TOKENS, 1e-5)  # both syncs landed mid-flight


def test_the_preflight_accepts_async_on_every_engine_that_reports_versions(monkeypatch):
    for engine in ("inprocess", "embedded"):
        check_engine(experiment(rollout=RolloutConfig(mode="async"), engine=EngineConfig(kind=engine)))
    from megatron_grpo.config import ConfigError
    from megatron_grpo.generation.adapters.inprocess import InProcessAdapter

    monkeypatch.setattr(InProcessAdapter, "reports_token_versions", False)  # an engine without them
    with pytest.raises(ConfigError, match="rollout.mode.*async needs per-token weight versions.*'inprocess'"):
        check_engine(experiment(rollout=RolloutConfig(mode="async"), engine=EngineConfig(kind="inprocess")))


@pytest.mark.slow
def test_async_training_on_the_inprocess_engine_keeps_the_bound(demo, tmp_path):
    k, steps, b, n = 2, 4, 4, 4
    run_dir = tmp_path / "run"
    run_train(async_cmd(demo, run_dir, steps, k, "engine.kind=inprocess", b=b, n=n))
    rows, log = read_metrics(run_dir), async_groups(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    check_bound(rows, log, k, b=b)
    # really asynchronous: the engine ran ahead of the trainer up to the bound
    assert rows[0]["rollout/policy_lag"] == 0 and max(r["rollout/policy_lag"] for r in rows) == k
