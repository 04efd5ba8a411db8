"""``rollout.mode: async``: the engine side (per-token weight versions and behaviour log-probs
across weight updates that land mid-sequence) and the scheduler's pure rules (the staleness
bound, admission, group selection), plus the configuration errors.

The reference for the engine test is independent of the engine: each weight version is an HF
model directory loaded fresh by transformers, and every token is scored by a full forward
(no cache, no padding) of the model whose weights drew it, in float64.
The trainer runs are in tests/test_async_e2e.py.
"""

import json
import threading
import time
from types import SimpleNamespace

import pytest
import yaml

from megatron_grpo.config import ConfigError, EngineConfig, RolloutConfig, load_config
from megatron_grpo.data import PromptSampler, load_prompt_dataset
from megatron_grpo.models.tokenizer import load_tokenizer
from megatron_grpo.preflight.rules import check_engine
from megatron_grpo.generation.client import RolloutClient, versions_from_spans
from megatron_grpo.generation.manager import RolloutServerManager
from megatron_grpo.inference.engine import EmbeddedEngine
from megatron_grpo.inference.generation import Sequence
from megatron_grpo.inference.sampling import resolve_sampling_params
from megatron_grpo.rollout.async_source import (AsyncRolloutSchedule, Group, admission_limit, is_stale, resume_note,
                                                settled_state, start_version, take_groups, token_lags)
from megatron_grpo.rollout.generate import GenerationContext
from megatron_grpo.trainer.components import build_rollout_side
from tests.support.demo_run import NUDGE, ROOT, demo_overrides
from tests.support.async_checks import PROMPTS, check_bound, check_token_versions
from tests.support.models_fixtures import hf_tensors
from tests.support.configs import experiment

LONG = {"temperature": 1.0, "max_new_tokens": 160, "ignore_eos": True}


def _update(engine: EmbeddedEngine, hf_dir, version: str) -> None:
    """What a weight sync does to the engine in async mode: retract, load, version, continue."""
    engine.pause("retract")
    with engine.exclusive():
        engine.load_weights(hf_tensors(hf_dir).items())
    engine.weight_version = version
    engine.resume()


def test_tokens_carry_the_version_and_log_prob_of_the_weights_that_drew_them(weight_versions):
    engine = EmbeddedEngine(weight_versions[0], dtype="float32", max_batch_size=8, seed=0)
    try:
        engine.weight_version = "0"
        done = threading.Semaphore(0)
        seqs = [Sequence(rid=str(i), prompt_ids=p, params=resolve_sampling_params({**LONG, "sampling_seed": 7 + i}),
                         return_logprob=True, on_finish=lambda s: done.release()) for i, p in enumerate(PROMPTS)]
        engine.submit(seqs)
        for version in ("1", "2"):  # two updates, each while every sequence is mid-flight
            deadline = time.monotonic() + 60
            target = 20 if version == "1" else 60
            while min(len(s.output_ids) for s in seqs) < target:
                assert time.monotonic() < deadline, "generation too slow"
                time.sleep(0.001)
            _update(engine, weight_versions[int(version)], version)
        for _ in seqs:
            assert done.acquire(timeout=120), "generation did not finish"
    finally:
        engine.shutdown()
    check_token_versions(seqs, weight_versions, 160, 1e-5)


# ---- the scheduler's rules (pure) -------------------------------------------------------------


def _group(gid: int, token_versions: list[list[str]]) -> Group:
    samples = [SimpleNamespace(output_versions=v) for v in token_versions]
    return Group(gid=gid, draw=0, prompt=None, round=SimpleNamespace(samples=samples))


def test_start_version_and_token_lags_read_every_model_token():
    samples = [SimpleNamespace(output_versions=["3", "4", None]), SimpleNamespace(output_versions=["5"]),
               SimpleNamespace(output_versions=None)]
    assert start_version(samples) == 3
    assert token_lags(samples, 5) == [2, 1, 0]
    assert start_version([SimpleNamespace(output_versions=[])]) is None


@pytest.mark.parametrize("k", [1, 2, 4])
def test_no_group_past_the_bound_is_taken(k):
    step = 10
    # arrival order mixes fresh groups with groups started 1 .. k+2 versions ago; one sample of
    # an otherwise fresh group started too early makes the whole group stale
    arrived = [_group(i, [[str(step - lag)] * 3, [str(step)]]) for i, lag in enumerate(range(k + 3))]
    arrived.append(_group(99, [[str(step)], [str(step - k - 1), str(step)]]))
    arrived += [_group(100 + i, [[str(step)]]) for i in range(3)]
    chosen, stale, rest = take_groups(arrived, step, k, count=k + 2)
    assert all(not is_stale(g.start_version, step, k) for g in chosen)
    assert max(step - g.start_version for g in chosen) <= k
    assert [g.gid for g in stale] == [k + 1, k + 2, 99]
    assert [g.gid for g in chosen] == list(range(k + 1)) + [100]  # arrival order, whole groups
    assert [g.gid for g in rest] == [101, 102]


def test_admission_keeps_at_most_k_plus_one_batches_and_stops_at_the_run_end():
    assert admission_limit(version=5, first_version=5, max_staleness=1, prompts_per_step=8, num_steps=100) == 16
    assert admission_limit(version=7, first_version=5, max_staleness=2, prompts_per_step=8, num_steps=100) == 40
    assert admission_limit(version=9, first_version=5, max_staleness=4, prompts_per_step=8, num_steps=10) == 40


def test_the_checkpoint_lists_every_settled_group_from_the_oldest_unsettled_draw_on():
    """A CI run's state at step 2 (B=8): draw 0 with ids 5 and 6 still unsettled, draw 1 trained
    whole (forgotten by the schedule), draw 2 half trained. Every id of draw 1 is settled, so a
    resumed run regenerates 5, 6 and draw 2's rest, and never draw 1 (it once trained it twice)."""
    state = settled_state({0: {0, 1, 2, 3, 4, 7}, 2: {1, 2}}, next_draw=3, prompts_per_step=8)
    assert state == {"draw": 0, "settled": [0, 1, 2, 3, 4, 7, *range(8, 16), 17, 18], "drawn": 3}
    assert settled_state({}, next_draw=4, prompts_per_step=8) == {"draw": 4, "settled": [], "drawn": 4}
    # trailing whole draws too (up to the last draw made), and nothing past it
    assert settled_state({1: {1}}, next_draw=4, prompts_per_step=2) == {"draw": 1, "settled": [3, 4, 5, 6, 7],
                                                                         "drawn": 4}
    note = resume_note(state, step=2, prompts_per_step=8)
    assert "16 groups from there already trained or dropped are skipped; 8 groups drawn but not yet trained" in note


def test_the_resume_note_counts_what_the_checkpoint_restores_and_names_what_it_cannot():
    # draws 2..4 made (B=8: ids 16..39), ids 17 and 19 settled: 22 groups to generate again
    note = resume_note({"draw": 2, "settled": [17, 19], "drawn": 5}, step=3, prompts_per_step=8)
    assert note.startswith("async resume at step 3: data position restored to draw 2 (group ids from 16); 2 groups "
                           "from there already trained or dropped are skipped; 22 groups drawn but not yet trained")
    assert "not reproduced: their responses, which weight version draws which token, and the arrival order" in note
    assert "; the groups drawn but not yet" in resume_note({"draw": 2, "settled": []}, 3, 8)  # an older checkpoint
    assert "no async rollout state" in resume_note(None, 3, 8)  # resumed from a sync-mode run's checkpoint


# ---- the scheduler on the launched embedded engine, without a trainer ----------------------------


class _Gate:
    """The engine as the scheduler sees it, holding back the first turns of the first prompt it
    is asked for (its group's n episodes) until ``release`` is set, after they were generated:
    a group overtaken by later ones (a slow tool call), whose later turns are drawn by newer weights."""

    def __init__(self, client):
        self.client, self.first, self.release, self.lock = client, None, threading.Event(), threading.Lock()

    def generate(self, prompts, n, sampling, **kw):
        out = self.client.generate(prompts, n, sampling, **kw)
        with self.lock:
            self.first = self.first or list(prompts[0])
            # the prompt alone: a first turn of that group (or of a later draw of the same prompt)
            held = list(prompts[0]) == self.first and not self.release.is_set()
        if held:
            assert self.release.wait(timeout=300), "never released"
        return out

    def __getattr__(self, name):
        return getattr(self.client, name)


class _Recorder:
    """The run's episode source, keeping every group's prompt and episodes (a dropped group's too)."""

    def __init__(self, source):
        self.source, self.calls = source, []

    def episodes(self, engine, prompts, *args, **kw):
        samples, episodes = self.source.episodes(engine, prompts, *args, **kw)
        self.calls.append((prompts[0], episodes))
        return samples, episodes

    def close(self):
        self.source.close()


class _Supervisor:
    """EngineSupervisor's two calls the scheduler makes, on one rank with a live engine."""

    def ensure_alive(self, step):
        pass

    def rollout(self, step, fn):
        return fn()


@pytest.mark.slow
def test_the_scheduler_drops_stale_groups_whose_episodes_span_weight_updates(demo, tmp_path):
    """AsyncRolloutSchedule on the launched embedded engine, the test doing the sync's version
    steps (retract, label, continue): the held group's episodes draw turn 1 with version 0 and
    turn 2 with version 2, so each episode's model tokens carry two versions (its observation
    tokens none), and the group, past the bound k=1, is dropped (stale_groups: drop), never
    trained; every trained group is within the bound."""
    env_file = tmp_path / "nudge.py"
    env_file.write_text(NUDGE)
    k, b, n, steps = 1, 2, 2, 4
    run_dir = tmp_path / "run"
    cfg = load_config(ROOT / "yaml_configs/demo_cpu.yaml", demo_overrides(
        demo, run_dir, steps, "rollout.mode=async", f"rollout.max_staleness={k}", "rollout.stale_groups=drop",
        f"rollout.prompts_per_step={b}", f"rollout.num_generations={n}", "episodes.kind=environment",
        f"episodes.source={env_file}:Nudge",
        "episodes.observation_role=user", "episodes.max_episode_tokens=64",
        "parallel.global_batch_size=1", "parallel.micro_batch_size=1"))
    tokenizer = load_tokenizer(cfg.model.hf_dir)
    sampler = PromptSampler(load_prompt_dataset(cfg.data, tokenizer), b, cfg.trainer.seed, cfg.data.shuffle)
    side = build_rollout_side(cfg, tokenizer, sampler)
    side.episode_source = recorder = _Recorder(side.episode_source)
    with RolloutServerManager(cfg, model_dir=cfg.model.hf_dir, run_dir=run_dir) as manager:
        client = RolloutClient.from_config(cfg.engine, manager.urls)
        (url,) = manager.urls
        gate = _Gate(client)
        ctx = GenerationContext(gate, side.sampling, side.scorer, side.tokenizer, cfg, side.episode_source)
        schedule = AsyncRolloutSchedule(cfg, _Supervisor(), ctx, sampler, start_step=0)
        rows = []
        try:
            client.update_weight_version(url, "0")
            for step in range(steps):
                if step > 0:  # the sync's version steps with sequences in flight (no new weights)
                    client.pause_generation(url, mode="retract")
                    client.update_weight_version(url, str(step))
                    client.continue_generation(url)
                if step == 2:  # the held episodes go on (turn 2 with version 2); their group arrives now
                    gate.release.set()
                    deadline = time.monotonic() + 120
                    while not any(list(prompt.prompt_ids) == gate.first for prompt, _ in recorder.calls):
                        assert time.monotonic() < deadline, "the held group did not finish"
                        time.sleep(0.01)
                result, _ = schedule.batch_for(step)
                rows.append({**result.stats, "step": step + 1})
        finally:
            gate.release.set()
            schedule.close()
            side.close()
            client.close()
    log = [json.loads(line) for line in (run_dir / "rollouts" / "async_groups.jsonl").read_text().splitlines()]
    check_bound(rows, log, k, b=b)
    # the held group (and a second row with the same prompt text, if it was drawn before the release)
    dropped = [g for g in log if g["fate"] != "trained"]
    assert dropped and all(g["fate"] == "stale_drop" and g["step"] - 1 - g["start_version"] > k for g in dropped), log
    assert any(g["start_version"] == 0 for g in dropped), log
    assert not {g["gid"] for g in dropped} & {g["gid"] for g in log if g["fate"] == "trained"}  # prompts skipped
    assert sum(r["async/groups_stale"] for r in rows) == sum(r["async/groups_dropped"] for r in rows) == len(dropped)
    assert sum(r["async/groups_regenerated"] for r in rows) == 0
    # each held episode's model tokens were drawn by two versions: turn 1 before the release
    # (version 0 for the first), turn 2 by version 2; its observation tokens carry none
    held = [e.sample for prompt, out in recorder.calls if prompt.index in {g["prompt_index"] for g in dropped}
            for e in out]
    assert len(held) == n * len(dropped)
    for s in held:
        assert len(s.output_versions) == len(s.output_ids) == len(s.output_mask)
        model = [v for v, m in zip(s.output_versions, s.output_mask) if m == 1]
        observation = [v for v, m in zip(s.output_versions, s.output_mask) if m == 0]
        assert len(set(model)) == 2 and model == sorted(model) and model[-1] == "2", s.output_versions
        assert observation and all(v is None for v in observation), s.output_versions
    assert any(s.output_versions[0] == "0" for s in held)


# ---- configuration --------------------------------------------------------------------------


def _load(tmp_path, episodes=None, **rollout):
    path = tmp_path / "c.yaml"
    raw = {"model": {"hf_dir": "m"}, "data": {"train_file": "d.jsonl"}, "trainer": {"run_dir": "r"},
           "rollout": rollout, "episodes": episodes or {}}
    path.write_text(yaml.safe_dump(raw))
    return load_config(str(path))


def test_bad_async_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="max_staleness: must be >= 1, got 0"):
        _load(tmp_path, mode="async", max_staleness=0)
    with pytest.raises(ConfigError, match="async cannot be combined with dynamic_sampling.enabled"):
        _load(tmp_path, mode="async", dynamic_sampling={"enabled": True})
    fn = tmp_path / "fn.py"
    fn.write_text("async def fn(engine, prompts, sampling):\n    return []\n")
    with pytest.raises(ConfigError, match="async cannot be combined with episodes.kind function"):
        _load(tmp_path, mode="async", episodes={"kind": "function", "source": f"{fn}:fn"})
    with pytest.raises(ConfigError, match="stale_groups"):
        _load(tmp_path, mode="async", stale_groups="keep")


def test_async_is_accepted_on_the_engines_that_report_token_versions(tmp_path):
    # the in-process engine and the rule's refusal: tests/test_async_inprocess.py
    check_engine(experiment(rollout=RolloutConfig(mode="async"), engine=EngineConfig(kind="embedded")))
    check_engine(experiment(rollout=RolloutConfig(mode="async"),
                            engine=EngineConfig(kind="sglang", urls=["http://127.0.0.1:1"])))


@pytest.mark.parametrize("spans, n, expected", [
    ([{"version": "0", "start": 0, "end": 3}], 3, ["0"] * 3),
    ([{"version": "0", "start": 0, "end": 2}, {"version": "1", "start": 2, "end": 5}], 5, ["0", "0", "1", "1", "1"]),
    ([{"version": "4", "start": 0, "end": 0}], 0, []),
])
def test_sglang_weight_version_spans_become_per_token_versions(spans, n, expected):
    assert versions_from_spans(spans, n) == expected


@pytest.mark.parametrize("spans, n", [
    ([{"version": "0", "start": 0, "end": 2}], 3),  # a token without a version
    ([{"version": "0", "start": 0, "end": 2}, {"version": "1", "start": 3, "end": 4}], 4),  # a gap
    ([{"version": "0", "start": 0, "end": 3}, {"version": "1", "start": 2, "end": 4}], 4),  # an overlap
])
def test_sglang_spans_that_do_not_tile_the_output_are_refused(spans, n):
    with pytest.raises(ValueError, match="weight_versions"):
        versions_from_spans(spans, n)


# ---- the real SGLang: the same check through its HTTP API --------------------------------------


def _stream(url: str, prompt: list[int], seed: int, progress: list[int], results: list, i: int) -> None:
    """One streamed /generate (the stream shows how far the sequence is); its last chunk."""
    import httpx

    from tests.support.sglang_shared import API_KEY

    body = {"input_ids": prompt, "sampling_params": {**LONG, "sampling_seed": seed}, "return_logprob": True,
            "logprob_start_len": -1, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as answer:
            answer.raise_for_status()
            for line in answer.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    results[i] = json.loads(line[len("data: "):])
                    progress[i] = results[i]["meta_info"]["completion_tokens"]
    except Exception as e:  # noqa: BLE001 - the test reports it
        results[i] = e


def _retract_when(client, url: str, progress: list[int], target: int, threads, results) -> None:
    """Pause SGLang (retract) once every sequence has drawn ``target`` tokens and none has
    finished. The streams show the scheduler's progress late (under load the scheduler can
    finish a sequence before its first chunks arrive), so the count is read while paused, after
    the streams have drained, and generation continues in short bursts until it is reached."""
    deadline = time.monotonic() + 300
    while True:
        client.pause_generation(url, mode="retract")
        seen, still = list(progress), time.monotonic()
        while time.monotonic() - still < 0.5:  # drained: nothing new for half a second
            time.sleep(0.05)
            if progress != seen:
                seen, still = list(progress), time.monotonic()
        assert max(progress) < LONG["max_new_tokens"] and all(t.is_alive() for t in threads), (
            progress, [r if isinstance(r, Exception) else r and r["meta_info"]["finish_reason"] for r in results])
        if min(progress) >= target:
            return
        assert time.monotonic() < deadline, progress
        client.continue_generation(url)
        time.sleep(0.02)


@pytest.mark.slow
def test_sglang_tokens_carry_the_version_and_log_prob_of_the_weights_that_drew_them(weight_versions, sglang_servers):
    """What the weight sync does to SGLang in async mode (retract, load, label, continue), twice
    while every sequence is mid-flight: SGLang's weight_versions spans give each token the
    version whose weights drew it, and its log-prob is that version's (HF reference)."""
    from megatron_grpo.generation import RolloutClient
    from megatron_grpo.generation.client import parse_generate_item
    from tests.support.sglang_shared import API_KEY

    url = sglang_servers.serve(weight_versions[0])
    client = RolloutClient([url], api_key=API_KEY, request_timeout_s=120, max_retries=2)
    try:
        client.update_weight_version(url, "0")
        progress, results = [0] * len(PROMPTS), [None] * len(PROMPTS)
        threads = [threading.Thread(target=_stream, args=(url, p, 7 + i, progress, results, i), daemon=True)
                   for i, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        for version, target in (("1", 20), ("2", 60)):
            _retract_when(client, url, progress, target, threads, results)
            client.flush_cache(url)
            client.run(client.aio.update_weights_from_disk(url, str(weight_versions[int(version)])))
            client.update_weight_version(url, version)
            client.continue_generation(url)
        for t in threads:
            t.join(timeout=300)
            assert not t.is_alive(), "generation did not finish"
    finally:
        client.close()
    samples = [parse_generate_item(item, prompt, i, 0, url) for i, (prompt, item) in enumerate(zip(PROMPTS, results))]
    check_token_versions(samples, weight_versions, 160, 1e-4)
