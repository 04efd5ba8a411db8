"""Custom rollout functions (episodes.rollout_function, docs/multi_turn.md#custom-rollout-functions):
loading and its one-line errors, the check of what a function returns (one line naming the file
and the function for each way it can be wrong), Samples and Episodes through
``generate_and_score``, and token-in/token-out identity with the real embedded engine (the
documented example, docs/examples/retry_rollout.py, included)."""

import dataclasses
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_grpo.config.algorithm import AlgorithmConfig
from megatron_grpo.config.base import ConfigError
from megatron_grpo.data.prompts import Prompt, render_prompt
from megatron_grpo.rewards.scorer import ScoredBatch
from megatron_grpo.rollout.episodes.environment.loop import EpisodeRunner
from megatron_grpo.rollout.episodes.episode import Episode
from megatron_grpo.rollout.episodes.function.source import RolloutFunction, RolloutFunctionError, check_rollout_output
from megatron_grpo.wire.samples import Sample, SamplingParams
from tools.tiny import build_tokenizer
from megatron_grpo.rollout.generate import GenerationContext, generate_and_score
from megatron_grpo.config import EpisodesConfig, RolloutConfig, TrainerConfig
from tests.support.configs import experiment
from tests.support.kill_resume import running

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "retry_rollout.py"

FUNCTIONS = '''
import asyncio
from megatron_grpo.rollout.episodes.episode import Episode
from megatron_grpo.wire.samples import Sample

def passthrough(engine, prompts, n, sampling, seed):
    return engine.generate([p.prompt_ids for p in prompts], n, sampling, sampling_seed=seed)

async def async_passthrough(engine, prompts, n, sampling, seed):
    await asyncio.sleep(0)
    return passthrough(engine, prompts, n, sampling, seed)

def with_tokenizer(engine, prompts, n, sampling, seed, tokenizer):
    assert tokenizer.eos_token == "<eos>"
    return passthrough(engine, prompts, n, sampling, seed)

def always_twice(engine, prompts, n, sampling, seed, tokenizer):
    """Every response: a first turn, a fixed observation, a second turn (one batched call each)."""
    obs = tokenizer(" <|user|> please reply with only a number <|assistant|>", add_special_tokens=False)["input_ids"]
    first = engine.generate([p.prompt_ids for p in prompts], n, sampling, sampling_seed=seed)
    second = engine.generate([s.prompt_ids + s.output_ids + obs for s in first], 1, sampling,
                             sampling_seed=seed + 1)
    out = []
    for a, b in zip(first, second):
        replay = a.kept_ids is not None
        out.append(Sample(prompt_index=a.prompt_index, sample_index=a.sample_index, prompt_ids=a.prompt_ids,
                          output_ids=a.output_ids + obs + b.output_ids,
                          output_logprobs=a.output_logprobs + [0.0] * len(obs) + b.output_logprobs,
                          output_mask=[1] * len(a.output_ids) + [0] * len(obs) + [1] * len(b.output_ids),
                          finish_reason=b.finish_reason, weight_version=a.weight_version, server=b.server,
                          kept_ids=a.kept_ids + [None] * len(obs) + b.kept_ids if replay else None,
                          log_kept_mass=a.log_kept_mass + [0.0] * len(obs) + b.log_kept_mass if replay else None))
    return out

def as_episodes(engine, prompts, n, sampling, seed):
    return [Episode(sample=s, num_turns=1, env_reward=0.5 * (s.sample_index % 2),
                    error="timeout" if s.sample_index == 1 else None)
            for s in passthrough(engine, prompts, n, sampling, seed)]

def two_args(engine, prompts):
    return []

def calls_with_text(engine, prompts, n, sampling, seed):
    return engine.generate([p.text for p in prompts], n, sampling)

def calls_with_negative_ids(engine, prompts, n, sampling, seed):
    return engine.generate([[-1] for p in prompts], n, sampling)

def calls_without_n(engine, prompts, n, sampling, seed):
    return engine.generate([p.prompt_ids for p in prompts], sampling)

def calls_past_the_context(engine, prompts, n, sampling, seed):
    return engine.generate([p.prompt_ids * 200 for p in prompts], n, sampling)
'''


@pytest.fixture(scope="module")
def fn_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("fns") / "fns.py"
    path.write_text(FUNCTIONS)
    return path


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def make_prompt(tok, index, question="what is 3 plus 4", answer="7"):
    text, prompt_ids = render_prompt(question, tok, use_template=True, system_prompt=None, where="test")
    return Prompt(index=index, where="test", text=text, prompt_ids=prompt_ids, answer=answer, fields={})


class FakeEngine:
    """``generate``: per prompt, n responses of tokens 10, 11, 12 + the sample index, log-prob -0.5."""

    def __init__(self, kept: bool = False):
        self.kept = kept

    def generate(self, prompts, n, sampling, *, sampling_seed=None, return_routed_experts=False):
        out = []
        for i, p in enumerate(prompts):
            for j in range(n):
                ids = [10, 11, 12 + j]
                out.append(Sample(prompt_index=i, sample_index=j, prompt_ids=list(p), output_ids=ids,
                                  output_logprobs=[-0.5] * 3, finish_reason="stop", weight_version="2",
                                  kept_ids=[[t] for t in ids] if self.kept else None,
                                  log_kept_mass=[0.0] * 3 if self.kept else None))
        return out


def load(fn_file, name, tok=None, **kw) -> RolloutFunction:
    return RolloutFunction.load(f"{fn_file}:{name}", tok, **kw)


# ---- loading --------------------------------------------------------------------------------


def test_config_key_is_checked_at_load(fn_file, tmp_path):
    assert EpisodesConfig(kind="function", source=f"{fn_file}:passthrough").rollout_function.endswith(":passthrough")
    with pytest.raises(ValueError, match="source: rollout function file .*missing.py not found"):
        EpisodesConfig(kind="function", source=f"{tmp_path}/missing.py:fn")
    with pytest.raises(ValueError, match="source: 'pkg.module.fn' is not a file path"):
        EpisodesConfig(kind="function", source="pkg.module.fn")


def test_load_errors_are_one_line_naming_the_file(fn_file, tmp_path):
    with pytest.raises(ConfigError, match=r"episodes.rollout_function: .*fns.py:two_args must take \(engine, prompts, "
                                          r"n, sampling, seed\)"):
        load(fn_file, "two_args")
    with pytest.raises(ConfigError, match="episodes.rollout_function: .* has no attribute 'nope'"):
        load(fn_file, "nope")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    with pytest.raises(ConfigError, match=r"episodes.rollout_function: cannot load .*broken.py: ModuleNotFoundError"):
        RolloutFunction.load(f"{broken}:fn")
    with pytest.raises(ConfigError) as e:
        load(fn_file, "two_args")
    assert "\n" not in str(e.value)


def test_sync_async_and_tokenizer_functions(fn_file, tok):
    prompts = [make_prompt(tok, 0), make_prompt(tok, 1)]
    sampling = SamplingParams(max_new_tokens=3)
    for name in ("passthrough", "async_passthrough", "with_tokenizer"):
        out = load(fn_file, name, tok)(FakeEngine(), prompts, 2, sampling, 7)
        assert [(s.prompt_index, s.sample_index) for s in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_the_builtin_episode_loop_is_a_rollout_function(tok):
    runner = EpisodeRunner.build(EpisodesConfig(kind="environment", source="calculator"), tok, max_inflight=64,
                                 use_template=True)
    prompts = [make_prompt(tok, 0), make_prompt(tok, 1)]
    out = runner(FakeEngine(), prompts, 2, SamplingParams(max_new_tokens=3), 7)  # the same call
    check_rollout_output(out, prompts, 2, SamplingParams(), "the built-in loop")
    assert all(isinstance(e, Episode) and e.num_turns == 1 for e in out)


# ---- what a function returns ------------------------------------------------------------------


def _mutations():
    """(name, how to spoil a valid output, what the one-line error says)."""
    def item(k, **changes):
        return lambda out: [dataclasses.replace(s, **changes) if i == k else s for i, s in enumerate(out)]

    return [
        ("not a list", lambda out: {"samples": out}, "returned a dict; expected a list of Sample"),
        ("too few", lambda out: out[:-1], "returned 3 items; expected 4 (n=2 per prompt for 2 prompts, prompt-major)"),
        ("order", lambda out: [out[0], out[2], out[1], out[3]],
         "item 1 has prompt_index=1, sample_index=0; expected 0, 1 (prompt-major"),
        ("mixed types", lambda out: [Episode(sample=out[0], num_turns=1, env_reward=0.0)] + out[1:],
         "items of type Episode, Sample"),
        ("a dict", lambda out: [dataclasses.asdict(out[0])] + out[1:], "items of type Sample, dict"),
        ("prompt changed", item(2, prompt_ids=[1, 2, 3]), "item 2: prompt_ids differ from prompts[1].prompt_ids"),
        ("logprob count", item(1, output_logprobs=[-0.5] * 2), "item 1: 2 output_logprobs for 3 output_ids"),
        ("nan logprob", item(0, output_logprobs=[-0.5, math.nan, -0.5]),
         "item 0: output_logprobs[1]=nan; expected a finite"),
        ("positive logprob", item(3, output_logprobs=[-0.5, 0.3, -0.5]), "output_logprobs[1]=0.3 on a model token"),
        ("mask length", item(0, output_mask=[1, 0]), "item 0: 2 output_mask entries for 3 output_ids"),
        ("mask value", item(0, output_mask=[1, 2, 1]), "item 0: output_mask holds 2; expected 1"),
        ("negative id", item(0, output_ids=[10, -1, 12]), "item 0: output_ids[1]=-1; expected a token id in [0, 64)"),
        ("id past vocab", item(0, output_ids=[10, 64, 12]), "output_ids[1]=64; expected a token id in [0, 64)"),
        ("float id", item(0, output_ids=[10, 11.0, 12]), "output_ids[1]=11.0"),
        ("finish", item(0, finish_reason="eos"), "finish_reason='eos'; expected one of stop, length, abort"),
        # issue 48, second round: each escaped the check as a traceback (len(None), float(10**400))
        ("no logprobs", item(0, output_logprobs=None), "item 0: a field has the wrong type (TypeError: object of "
                                                       "type 'NoneType' has no len()); see Sample in wire/samples.py"),
        ("logprob past float", item(0, output_logprobs=[-0.5, -10**400, -0.5]), "item 0: output_logprobs[1]=-1000"),
        ("no mask list", item(0, output_mask=1), "item 0: a field has the wrong type (TypeError: object of type "
                                                 "'int' has no len())"),
    ]


class SpoilingEngine(FakeEngine):
    """FakeEngine whose answers are spoiled here, so that ``passthrough`` (in its worker
    process) returns exactly the spoiled output."""

    def __init__(self, spoil):
        super().__init__()
        self.spoil = spoil

    def generate(self, prompts, n, sampling, **kw):
        return self.spoil(super().generate(prompts, n, sampling, **kw))


@pytest.mark.parametrize("name,spoil,message", _mutations(), ids=[m[0] for m in _mutations()])
def test_a_bad_output_is_one_line_naming_the_file_and_function(fn_file, tok, name, spoil, message):
    rf = load(fn_file, "passthrough", vocab_size=64)
    with pytest.raises(RolloutFunctionError) as e:
        rf(SpoilingEngine(spoil), [make_prompt(tok, 0), make_prompt(tok, 1)], 2, SamplingParams(max_new_tokens=3), 1)
    rf.close()
    text = str(e.value)
    assert text.startswith(f"episodes.rollout_function {fn_file.resolve()}:passthrough: "), text
    assert message in text, text
    assert "\n" not in text


@pytest.mark.parametrize("name, message", [
    ("calls_with_text", "engine.generate was called with prompts that are not lists of token ids (one non-empty "
                        "list of integers >= 0 per prompt, e.g. [p.prompt_ids for p in prompts])"),
    ("calls_with_negative_ids", "engine.generate was called with prompts that are not lists of token ids"),
    ("calls_without_n", "engine.generate was called with arguments that do not fit generate(prompts, n, sampling, "
                        "*, sampling_seed=None): missing a required argument: 'sampling'"),
])
def test_a_bad_engine_call_is_one_line_naming_the_file_and_function(fn_file, tok, name, message):
    """Issue 48, second round: a function that called engine.generate with text crashed the
    engine's own code (a rank's traceback, exit 1). Its call is checked in the trainer first."""
    rf = load(fn_file, name, vocab_size=64)
    with pytest.raises(RolloutFunctionError) as e:
        rf(FakeEngine(), [make_prompt(tok, 0)], 2, SamplingParams(max_new_tokens=3), 1)
    assert str(e.value).startswith(f"episodes.rollout_function {fn_file.resolve()}:{name}: {message}"), str(e.value)
    assert rf._closed  # its worker with it


# ---- the worker process: a hung, raising or crashing function ---------------------------------------

MISBEHAVING = '''
import os, time

def hangs_after_one_call(engine, prompts, n, sampling, seed):
    engine.generate([p.prompt_ids for p in prompts], n, sampling)
    while True:  # a sync busy loop: nothing but SIGKILL ends it
        pass

def raises(engine, prompts, n, sampling, seed):
    out = engine.generate([p.prompt_ids for p in prompts], n, sampling)
    return out[0].no_such_field

def crashes(engine, prompts, n, sampling, seed):
    os._exit(3)

def pid(engine, prompts, n, sampling, seed):
    return os.getpid()

def sleeps(engine, prompts, n, sampling, seed):
    time.sleep(3600)

time.sleep(float(os.environ.get("MGRPO_TEST_LOAD_SLEEP", "0")))
'''


@pytest.fixture(scope="module")
def bad_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "bad.py"
    path.write_text(MISBEHAVING)
    return path


def test_the_function_runs_in_a_worker_process_not_the_trainers(bad_file, tok):
    rf = load(bad_file, "pid")
    with pytest.raises(RolloutFunctionError, match="returned a int"):  # its pid is not samples
        rf(FakeEngine(), [make_prompt(tok, 0)], 1, SamplingParams(), 1)
    assert rf.pid != os.getpid()
    assert not running(rf.pid)  # a failed round ends the worker


def test_a_hung_function_is_killed_within_its_deadline(bad_file, tok):
    rf = load(bad_file, "hangs_after_one_call", timeout_s=2.0)
    engine = Recording(FakeEngine())
    t0 = time.monotonic()
    with pytest.raises(RolloutFunctionError) as e:
        rf(engine, [make_prompt(tok, 0)], 2, SamplingParams(), 1)
    took = time.monotonic() - t0
    assert 2.0 <= took < 6.0, took  # the deadline counts from its last engine.generate
    assert len(engine.calls) == 1
    assert str(e.value) == (f"episodes.rollout_function {bad_file.resolve()}:hangs_after_one_call: the function ran, "
                            "without returning or calling engine.generate, longer than 2s "
                            "(episodes.timeout_s); its worker process was killed")
    assert not running(rf.pid)


def test_a_hung_function_ends_a_256_sample_step_at_its_first_deadline(bad_file, tok):
    """Issue 64, every deadline measured on a big step: the function gets the whole step (64
    prompts x 4) in one call, so its deadline is one wait, not one per sample: 10 s, then one line."""
    rf = load(bad_file, "hangs_after_one_call", timeout_s=10.0)
    engine = Recording(FakeEngine())
    t0 = time.monotonic()
    with pytest.raises(RolloutFunctionError, match=r"longer than 10s \(episodes.timeout_s\); its "
                                                   r"worker process was killed$"):
        rf(engine, [make_prompt(tok, i) for i in range(64)], 4, SamplingParams(), 1)
    assert 10.0 <= time.monotonic() - t0 < 30
    assert not running(rf.pid)


def test_a_raising_or_crashing_function_is_one_line(bad_file, tok):
    rf = load(bad_file, "raises")
    with pytest.raises(RolloutFunctionError) as e:
        rf(FakeEngine(), [make_prompt(tok, 0)], 1, SamplingParams(), 1)
    assert str(e.value) == (f"episodes.rollout_function {bad_file.resolve()}:raises: raised AttributeError: 'Sample' "
                            f"object has no attribute 'no_such_field' (at {bad_file.resolve()}:11)")
    rf = load(bad_file, "crashes")
    with pytest.raises(RolloutFunctionError, match=r"bad.py:crashes: its worker process died"):
        rf(FakeEngine(), [make_prompt(tok, 0)], 1, SamplingParams(), 1)
    assert not running(rf.pid)


def test_a_hung_worker_dies_with_a_trainer_killed_by_sigkill(bad_file, tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys\n"
        "from megatron_grpo.rollout.episodes.function.source import RolloutFunction\n"
        "from megatron_grpo.wire.samples import SamplingParams\n"
        f"rf = RolloutFunction.load({str(bad_file) + ':sleeps'!r}, timeout_s=3600)\n"
        "print(rf.pid, flush=True)\n"
        "rf(None, [], 1, SamplingParams(), 1)\n")
    trainer = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        worker = int(trainer.stdout.readline())
        time.sleep(0.5)  # the worker is in time.sleep(3600)
        assert running(worker)
    finally:
        trainer.kill()  # kill -9: no atexit, no close
        trainer.wait(timeout=30)
    deadline = time.monotonic() + 10
    while running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(worker)  # its fork server saw stdin close and exited; the parent-death signal did the rest


def test_a_file_that_hangs_while_loading_is_refused_within_its_deadline(bad_file, monkeypatch):
    from megatron_grpo.rollout.episodes.environment import worker
    worker.fork_server().close()  # a new fork server that sees the variable below
    monkeypatch.setenv("MGRPO_TEST_LOAD_SLEEP", "30")
    worker.fork_server()  # started before the clock: its own start-up has its own allowance
    t0 = time.monotonic()
    try:
        with pytest.raises(ConfigError, match=r"episodes.rollout_function: .*bad.py:pid: loading the file took "
                                              r"longer than 1s \(episodes.timeout_s\)"):
            load(bad_file, "pid", timeout_s=1.0)
        assert time.monotonic() - t0 < 10  # 1 s, plus the worker's imports on a busy machine
    finally:
        worker.fork_server().close()  # the next one starts without the variable


def test_observation_tokens_may_carry_any_finite_logprob_but_model_tokens_not(fn_file, tok):
    samples = FakeEngine().generate([[1]], 2, None)
    prompts = [SimpleNamespace(prompt_ids=[1])]
    ok = [dataclasses.replace(s, output_mask=[1, 0, 1], output_logprobs=[-0.5, 0.7, -0.5]) for s in samples]
    check_rollout_output(ok, prompts, 2, SamplingParams(), "x")  # context: never trained, never compared
    bad = [dataclasses.replace(s, output_mask=[1, 1, 1], output_logprobs=[-0.5, 0.7, -0.5]) for s in samples]
    with pytest.raises(RolloutFunctionError, match="output_logprobs.1.=0.7 on a model token"):
        check_rollout_output(bad, prompts, 2, SamplingParams(), "x")


def test_sampling_mask_replay_needs_the_kept_sets(fn_file, tok):
    replay = SamplingParams(top_p=0.7, sampling_mask_max_kept=16)
    prompts = [make_prompt(tok, 0)]
    load(fn_file, "passthrough")(FakeEngine(kept=True), prompts, 2, replay, 1)  # the engine's sets: fine
    with pytest.raises(RolloutFunctionError, match="item 0: no kept_ids / log_kept_mass, but sampling-mask replay "
                                                   "is on .* or set rollout.sampling_mask_replay: false"):
        load(fn_file, "passthrough")(FakeEngine(kept=False), prompts, 2, replay, 1)


def test_bad_episode_fields(fn_file, tok):
    samples = FakeEngine().generate([[1]], 1, None)
    prompts = [SimpleNamespace(prompt_ids=[1])]
    for episode, message in [(Episode(sample=samples[0], num_turns=-1, env_reward=0.0), "num_turns=-1"),
                             (Episode(sample=samples[0], num_turns=1, env_reward=math.inf), "env_reward=inf"),
                             (Episode(sample=samples[0], num_turns=1, env_reward=0.0, error="oops"), "error='oops'")]:
        with pytest.raises(RolloutFunctionError, match=message):
            check_rollout_output([episode], prompts, 1, SamplingParams(), "f")


# ---- through generate_and_score -----------------------------------------------------------------


class ByLastToken:
    """Reward: the last response token's id / 100 (so groups have variance)."""

    def score_samples(self, samples):
        rewards = [s.response_ids[-1] / 100 for s in samples]
        return ScoredBatch(rewards=rewards, per_function={"r": rewards})


def _cfg(**rollout):
    return experiment(rollout=RolloutConfig(num_generations=2, max_new_tokens=3, **rollout),
                      algorithm=AlgorithmConfig(), trainer=TrainerConfig(run_dir="unused", seed=3))


def test_samples_and_episodes_through_generate_and_score(fn_file, tok):
    prompts = [make_prompt(tok, 0), make_prompt(tok, 1)]
    sampling = SamplingParams(max_new_tokens=3)
    plain = generate_and_score(GenerationContext(FakeEngine(), sampling, ByLastToken(), tok, _cfg(),
                                                 episode_source=load(fn_file, "passthrough")), 0, prompts)
    direct = generate_and_score(GenerationContext(FakeEngine(), sampling, ByLastToken(), tok, _cfg()), 0, prompts)
    assert torch.equal(plain.batch.tokens, direct.batch.tokens)  # a passthrough function is the single-turn path
    assert torch.equal(plain.batch.advantages, direct.batch.advantages)
    assert not any(k.startswith("multi_turn/") for k in plain.stats)
    # Episodes: the environment's reward is added, a failed episode scored by on_env_error (zero_reward)
    episodes = generate_and_score(GenerationContext(FakeEngine(), sampling, ByLastToken(), tok, _cfg(),
                                                    episode_source=load(fn_file, "as_episodes")), 0, prompts)
    assert episodes.stats["multi_turn/turns_mean"] == 1 and episodes.stats["multi_turn/env_timeouts"] == 2
    # rewards: sample 0 of each prompt 0.12 + 0; sample 1 timed out: 0 -> each group's advantages +-
    assert episodes.stats["reward_mean"] == pytest.approx(0.06)


# ---- token-in/token-out with the real embedded engine ---------------------------------------------


class Recording:
    def __init__(self, client):
        self.client, self.calls = client, []

    def generate(self, prompts, n, sampling, **kw):
        out = self.client.generate(prompts, n, sampling, **kw)
        self.calls.append(([list(p) for p in prompts], n, out))
        return out


@pytest.mark.slow
@pytest.mark.parametrize("top_p", [1.0, 0.7], ids=["full", "replay"])
def test_trainer_rows_are_the_engines_tokens_plus_observations(fn_file, tok, embedded, top_p):
    engine = Recording(embedded)
    prompts = [make_prompt(tok, 0), make_prompt(tok, 1, "what is 5 plus 1", "6")]
    cfg = _cfg(top_p=top_p)
    sampling = SamplingParams.from_rollout_config(cfg.rollout)
    sampling.stop_token_ids = [tok.eos_token_id]
    result = generate_and_score(GenerationContext(engine, sampling, ByLastToken(), tok, cfg,
                                                  episode_source=load(fn_file, "always_twice", tok)), 0, prompts)
    (first_in, _, first), (second_in, _, second) = engine.calls
    obs = tok(" <|user|> please reply with only a number <|assistant|>", add_special_tokens=False)["input_ids"]
    batch = result.batch
    assert all(s.finish_reason != "abort" for s in first + second)
    for row in range(4):
        a, b = first[row], second[row]
        assert second_in[row] == a.prompt_ids + a.output_ids + obs  # turn 2 is generated on turn 1's exact ids
        full = a.prompt_ids + a.output_ids + obs + b.output_ids
        p, n = len(a.prompt_ids), len(full)
        assert batch.tokens[row, :n].tolist() == full
        mask = [1] * len(a.output_ids) + [0] * len(obs) + [1] * len(b.output_ids)
        assert batch.loss_mask[row, p - 1: n - 1].tolist() == mask
        lps = torch.tensor(a.output_logprobs + [0.0] * len(obs) + b.output_logprobs)
        if top_p == 1.0:
            assert torch.equal(batch.rollout_log_probs[row, p - 1: n - 1], lps)
        else:  # the kept sets travel with the model tokens, none on the observation
            assert batch.kept_ids is not None
            assert result.stats["rollout/log_kept_mass_mean"] < 0


@pytest.mark.slow
def test_a_call_the_engine_refuses_is_one_line(fn_file, tok, embedded):
    """A call the real engine refuses (a prompt past the model's context, or ids past its
    vocabulary: HTTP 400) is the function's error in one line, not an engine failure the run
    restarted the engine for (then stopping with "its worker process was closed")."""
    rf = load(fn_file, "calls_past_the_context", vocab_size=len(tok))
    with pytest.raises(RolloutFunctionError, match=r"calls_past_the_context: engine.generate was refused: rollout "
                                                   r"server .* does not fit the context length"):
        rf(embedded, [make_prompt(tok, 0)], 1, SamplingParams(max_new_tokens=1), 1)


@pytest.mark.slow
def test_the_documented_example_runs_on_the_real_engine(tok, embedded):
    engine = Recording(embedded)
    prompts = [make_prompt(tok, i) for i in range(3)]
    sampling = SamplingParams(max_new_tokens=1, stop_token_ids=[tok.eos_token_id])
    rf = RolloutFunction.load(f"{EXAMPLE}:retry_once", tok, vocab_size=len(tok))
    out = rf(engine, prompts, 8, sampling, 5)  # 24 one-token replies of a random model: some are no number
    retried = [s for s in out if s.output_mask is not None]
    assert len(engine.calls) == 2
    (retry_in, _, again) = engine.calls[1]
    assert len(retried) == len(retry_in) == len(again) >= 1
    for s, given, got in zip(retried, retry_in, again):  # the retry is generated on the exact ids so far
        cut = len(given) - len(s.prompt_ids)
        assert s.prompt_ids + s.output_ids[:cut] == given
        assert s.output_ids[cut:] == got.output_ids and s.output_logprobs[cut:] == got.output_logprobs
        assert s.output_mask == [1] + [0] * (cut - 1) + [1] * len(got.output_ids)


# ---- megatron-grpo train --------------------------------------------------------------------------

SMALL = ("engine.kind=inprocess", "rollout.prompts_per_step=4", "rollout.num_generations=4",
         "parallel.global_batch_size=16", "parallel.micro_batch_size=8", "eval.every_n_steps=0", "logging.plot=false")
"""A small run on the in-process engine (a custom function over the launched engine's HTTP client
is the tests above, on the ``embedded`` fixture)."""


@pytest.mark.slow
def test_train_with_the_documented_rollout_function_and_a_broken_one(demo, tmp_path):
    from tests.support.demo_run import ENV, read_metrics, train_cmd

    run_dir = tmp_path / "run"
    cmd = train_cmd(demo, run_dir, 2, "episodes.kind=function", f"episodes.source={EXAMPLE}:retry_once", *SMALL)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    # a retried episode is 1 + 6 + 1 tokens long (max_new_tokens 1), only its 2 model tokens trained
    for r in rows:
        assert 1 <= r["response_length_mean"] <= 8 and 16 <= r["num_valid_tokens"] <= 32
    broken = tmp_path / "broken.py"
    broken.write_text("def fn(engine, prompts, n, sampling, seed):\n"
                      "    return engine.generate([p.prompt_ids for p in prompts], n, sampling)[1:]\n")
    cmd = train_cmd(demo, tmp_path / "run2", 1, "episodes.kind=function", f"episodes.source={broken}:fn", *SMALL)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert out.returncode != 0
    line = f"episodes.rollout_function {broken}:fn: returned 15 items; expected 16 (n=4 per prompt for 4 prompts"
    assert line in out.stderr, out.stderr[-3000:]
