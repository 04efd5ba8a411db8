"""Multi-turn episodes (episodes.environment, docs/multi_turn.md): the turn boundary, the token
identity with the real embedded engine, the loss over model tokens only, environment failures
(errors, timeouts, a hung sync environment killed) and the one-line errors of bad input."""

import os
import uuid
import textwrap
import time
from pathlib import Path

import pytest
import torch

from megatron_grpo.config.base import ConfigError
from megatron_grpo.config.dapo import OverlongConfig
from megatron_grpo.data.prompts import Prompt, render_prompt
from megatron_grpo.losses import compute_policy_loss
from megatron_grpo.config.algorithm import AlgorithmConfig, OffPolicyCorrectionConfig
from megatron_grpo.rollout.episodes.environment import EnvCallError, EnvContractError, EnvProcess, check_environment
from megatron_grpo.rollout.episodes.environment.builtin import BUILTINS, Calculator, GuessNumber
from megatron_grpo.rollout.episodes.environment.worker import fork_server
from megatron_grpo.rollout.episodes.hang_guard import EpisodesHung
from megatron_grpo.rollout.episodes.environment.loop import EpisodeRunner
from megatron_grpo.rollout.episodes.episode import episode_rewards, episode_stats
from megatron_grpo.rollout.episodes.turns import ObservationError, TurnRenderer
from megatron_grpo.wire.samples import Sample, SamplingParams
from tools.tiny import build_tokenizer
from megatron_grpo.rollout.batch import build_train_batch
from megatron_grpo.config import EngineConfig, EpisodesConfig, RolloutConfig
from megatron_grpo.config.episodes import BUILTIN_ENVIRONMENTS
from tests.support.configs import experiment
from tests.support.fork_workers import live_workers

ENV_SOURCE = '''
import asyncio, time

class Scripted:
    """Answers by the row's script: 'obs' -> an observation, 'raise', 'hang', 'sleep', 'bad', 'done'."""
    def __init__(self, row):
        self.script = row.get("script", "obs obs done").split()
        self.turn = 0

    def step(self, response):
        action = self.script[min(self.turn, len(self.script) - 1)]
        self.turn += 1
        if action == "raise":
            raise KeyError("boom")
        if action == "hang":
            while True:
                pass
        if action == "block":  # a hang that leaves the CPU to the others (256 of them at once)
            time.sleep(3600)
        if action == "bad":
            return {"observation": 3, "done": False}
        if action == "unk":
            return {"observation": "zebra", "done": False}
        if action == "done":
            return {"observation": None, "done": True, "reward": 1.0}
        return {"observation": "result 7", "done": False, "reward": 0.25}

class AsyncScripted(Scripted):
    async def step(self, response):
        await asyncio.sleep(0)
        return Scripted.step(self, response)

class Huge:
    """An observation of 50 MB (issue 48: 100 MB grew the trainer to 16.5 GB)."""
    def __init__(self, row):
        pass

    def step(self, response):
        return {"observation": "7 " * 25_000_000, "done": False}

class Spawner:
    """Starts a ``sleep`` in every step (issue 48: these outlived the run)."""
    def __init__(self, row):
        self.marker = row["marker"]

    def step(self, response):
        import subprocess
        subprocess.Popen(["sleep", self.marker])
        return {"observation": "result 7", "done": False}

class NoStep:
    def __init__(self, row):
        pass

class BadInit:
    def __init__(self, row):
        raise RuntimeError("no such tool")

    def step(self, response):
        return {"observation": None, "done": True}
'''


@pytest.fixture(scope="module")
def env_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("envs") / "envs.py"
    path.write_text(ENV_SOURCE)
    return str(path)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def make_prompt(tok, index=0, question="what is 3 plus 4", answer="7", **fields):
    text, prompt_ids = render_prompt(question, tok, use_template=True, system_prompt=None, where="test")
    return Prompt(index=index, where="test", text=text, prompt_ids=prompt_ids, answer=answer, fields=fields)


class ScriptedEngine:
    """A RolloutEngine stand-in: every turn answers ``reply`` (cut to max_new_tokens) with
    log-prob -0.5 per token, and records every prompt it was given."""

    def __init__(self, tok, reply="compute 3 + 4 <eos>"):
        self.reply = ids(tok, reply)
        self.eos = tok.eos_token_id
        self.calls = []

    def generate(self, prompts, n, sampling, *, sampling_seed=None, return_routed_experts=False):
        assert n == 1 and len(prompts) == 1
        self.calls.append(list(prompts[0]))
        out = self.reply[: sampling.max_new_tokens]
        finish = "stop" if out and out[-1] == self.eos else "length"
        return [Sample(prompt_index=0, sample_index=0, prompt_ids=list(prompts[0]), output_ids=list(out),
                       output_logprobs=[-0.5] * len(out), finish_reason=finish, weight_version="3")]


def runner(tok, environment, **episodes):
    cfg = EpisodesConfig(kind="environment", source=environment, observation_role="user",
                         **{"timeout_s": 5.0, **episodes})
    return EpisodeRunner.build(cfg, tok, max_inflight=EngineConfig().max_inflight_requests, use_template=True)


# ---- the turn boundary --------------------------------------------------------------------


def test_delta_render_is_the_templates_turn_with_the_closing_on_the_observation_side(tok):
    r = TurnRenderer(tok, "user")
    assert tok.convert_ids_to_tokens(r.closing) == ["<eos>"]
    after_eos = r.observation_ids(ids(tok, "5 <eos>"), "result 7")
    assert tok.convert_ids_to_tokens(after_eos) == ["<|user|>", "result", "7", "<|assistant|>"]
    # a turn cut for length (no end-of-turn generated): the template's <eos> is the observation's
    after_cut = r.observation_ids(ids(tok, "5 6"), "result 7")
    assert tok.convert_ids_to_tokens(after_cut) == ["<eos>", "<|user|>", "result", "7", "<|assistant|>"]
    # the whole conversation rendered by the template == prompt + model tokens + observation ids
    prompt = make_prompt(tok)
    model = ids(tok, "compute 3 + 4 <eos>")
    rendered = tok.apply_chat_template([{"role": "user", "content": "what is 3 plus 4"},
                                        {"role": "assistant", "content": "compute 3 + 4"},
                                        {"role": "user", "content": "result 7"}],
                                       tokenize=False, add_generation_prompt=True)
    assert prompt.prompt_ids + model + r.observation_ids(model, "result 7") == ids(tok, rendered)


def test_unknown_tokens_are_refused(tok):
    with pytest.raises(ObservationError, match="unknown token"):
        TurnRenderer(tok, "user").observation_ids(ids(tok, "5 <eos>"), "zebra")


def test_template_that_rewrites_earlier_turns_is_refused_in_one_line(tok):
    rewriting = build_tokenizer()
    # like templates that strip earlier reasoning: only the LAST assistant turn keeps its content
    rewriting.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} "
        "{% else %}<|assistant|> {% if loop.last %}{{ m['content'] }} {% endif %}<eos> {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    with pytest.raises(ConfigError) as e:
        TurnRenderer(rewriting, "user")
    assert "prefix-stable" in str(e.value) and "observation_formatter" in str(e.value) and "\n" not in str(e.value)
    # a formatter takes over (and its ids are still checked for unknown tokens)
    fmt = TurnRenderer(rewriting, "user", formatter=lambda text, t: ids(t, f"<|user|> {text} <|assistant|>"))
    assert tok.convert_ids_to_tokens(fmt.observation_ids([5], "result 7")) == ["<|user|>", "result", "7",
                                                                               "<|assistant|>"]


def test_no_template_needs_a_formatter(tok):
    with pytest.raises(ConfigError, match="observation_formatter: is needed.*apply_chat_template is false"):
        TurnRenderer(tok, "user", use_template=False)


# ---- episodes (scripted engine; real environment workers) -----------------------------------


def test_episode_tokens_masks_and_limits(tok, env_file):
    engine = ScriptedEngine(tok)
    prompt = make_prompt(tok, script="obs obs obs obs")
    episodes = runner(tok, f"{env_file}:Scripted", max_turns=3).run(engine, [prompt], 2, SamplingParams(
        max_new_tokens=16), sampling_seed=5)
    assert len(episodes) == 2 and [e.sample.sample_index for e in episodes] == [0, 1]
    e = episodes[0]
    model, obs = ids(tok, "compute 3 + 4 <eos>"), ids(tok, "<|user|> result 7 <|assistant|>")
    assert e.num_turns == 3 and e.error is None and e.env_reward == pytest.approx(0.75)
    assert e.sample.output_ids == model + obs + model + obs + model
    assert e.sample.output_mask == [1] * 5 + [0] * 4 + [1] * 5 + [0] * 4 + [1] * 5
    assert e.sample.output_logprobs == [-0.5] * 5 + [0.0] * 4 + [-0.5] * 5 + [0.0] * 4 + [-0.5] * 5
    # each turn was generated on exactly the tokens of the episode so far
    p = prompt.prompt_ids
    assert sorted(engine.calls, key=len) == [p, p, p + model + obs, p + model + obs,
                                             p + (model + obs) * 2, p + (model + obs) * 2]
    stats = episode_stats(episodes)
    assert stats["multi_turn/turns_mean"] == 3 and stats["multi_turn/observation_tokens_mean"] == 8
    assert stats["multi_turn/model_tokens_mean"] == 15

    # token budget: 12 tokens after the prompt -> turn 1 (5) + obs (4) + a turn cut to 3 (length)
    cut = runner(tok, f"{env_file}:Scripted", max_turns=5, max_episode_tokens=12).run(
        ScriptedEngine(tok), [prompt], 1, SamplingParams(max_new_tokens=16))[0]
    assert len(cut.sample.output_ids) == 12 and cut.sample.finish_reason == "length"


class _Zero:
    """Reward functions that score every response 0 (the environment's reward is what counts)."""

    def score_samples(self, samples):
        from megatron_grpo.rewards.scorer import ScoredBatch
        return ScoredBatch(rewards=[0.0] * len(samples), per_function={"zero": [0.0] * len(samples)})


def test_truncated_reward_grades_an_episode_that_ended_on_a_cut(tok, env_file):
    """``rollout.overlong.truncated_reward`` with episodes (issue 64: it was refused with any
    environment, agent or rollout function, so the SmolLM2 configs took none): an episode whose
    end was a cut (its last turn cut by the budget) gets the value in place of its reward; one
    that ended on a whole turn keeps its own. 12 tokens after the prompt: "done" ends after one
    whole turn (5 tokens, <eos>); "obs obs done" gets a turn, an observation and a turn cut to 3."""
    from megatron_grpo.rollout.generate import GenerationContext, generate_round

    cfg = experiment(rollout=RolloutConfig(num_generations=2, max_new_tokens=16,
                                           overlong=OverlongConfig(truncated_reward=-1.0)),
                     episodes=EpisodesConfig(kind="environment", source=f"{env_file}:Scripted", observation_role="user",
                                             max_episode_tokens=12, max_turns=5))
    source = EpisodeRunner.build(cfg.episodes, tok, max_inflight=4, use_template=True)
    ctx = GenerationContext(ScriptedEngine(tok), SamplingParams(max_new_tokens=16), _Zero(), tok, cfg, source)
    prompts = [make_prompt(tok, 0, script="done"), make_prompt(tok, 1, script="obs obs done")]
    r = generate_round(ctx, 0, 0, prompts, seed=1)
    assert [s.finish_reason for s in r.samples] == ["stop", "stop", "length", "length"]
    assert r.rewards.tolist() == [1.0, 1.0, -1.0, -1.0]  # "done" rewards 1.0; the cut ones get -1.0


def test_async_step_and_done(tok, env_file):
    (e,) = runner(tok, f"{env_file}:AsyncScripted").run(ScriptedEngine(tok), [make_prompt(tok, script="obs done")],
                                                       1, SamplingParams(max_new_tokens=16))
    assert e.num_turns == 2 and e.env_reward == pytest.approx(1.25) and e.error is None


def test_calculator_and_guess_number():
    calc = Calculator({"answer": "7"})
    assert calc.step("compute ( 3 + 4 ) * 2") == {"observation": "result 14", "done": False, "reward": 0.0}
    assert calc.step("compute __import__('os')")["observation"] == "result ?"
    assert calc.step("the answer is 7") == {"observation": None, "done": True, "reward": 1.0}
    assert calc.step("8")["reward"] == 0.0
    game = GuessNumber({"answer": 42})
    assert [game.step(g)["observation"] for g in ("50", "10", "no idea")] == ["lower", "higher", "a number please"]
    assert game.step("42") == {"observation": None, "done": True, "reward": 1.0}
    assert set(BUILTINS) == set(BUILTIN_ENVIRONMENTS)


def test_env_errors_are_counted_scored_and_reported_once(tok, env_file, capfd):
    prompts = [make_prompt(tok, index=0, script="obs raise"), make_prompt(tok, index=1, script="obs unk")]
    r = runner(tok, f"{env_file}:Scripted")
    episodes = r.run(ScriptedEngine(tok), prompts, 2, SamplingParams(max_new_tokens=16))
    assert [e.error for e in episodes] == ["error", "error", "observation", "observation"]
    # the refused observation is never in the sample
    assert all(0 not in e.sample.output_mask[-5:] for e in episodes)
    err = capfd.readouterr().err
    assert err.count("KeyError: 'boom'") == 1 and err.count("unknown token") == 1
    assert f"{env_file}:" in err  # file:line of the raise
    stats = episode_stats(episodes)
    assert stats["multi_turn/env_errors"] == 2 and stats["multi_turn/observations_refused"] == 2
    rewards, dropped = episode_rewards([1.0, 2.0, 3.0, 4.0], episodes, 2, EpisodesConfig())
    assert rewards.tolist() == [0.0] * 4 and not dropped.any()


def test_reward_add_replace_and_drop(tok):
    class E:
        def __init__(self, env_reward, error=None):
            self.env_reward, self.error = env_reward, error

    eps = [E(1.0), E(0.5, "timeout"), E(2.0), E(0.0)]
    add, _ = episode_rewards([1.0, 1.0, 1.0, 1.0], eps, 2, EpisodesConfig(on_env_error="zero_reward"))
    assert add.tolist() == [2.0, 0.0, 3.0, 1.0]
    rep, _ = episode_rewards([1.0, 1.0, 1.0, 1.0], eps, 2, EpisodesConfig(env_reward="replace"))
    assert rep.tolist() == [1.0, 0.0, 2.0, 0.0]
    drop, dropped = episode_rewards([1.0, 1.0, 1.0, 1.0], eps, 2, EpisodesConfig(on_env_error="drop"))
    assert drop.tolist() == [2.0, 2.0, 3.0, 1.0] and dropped.tolist() == [False, True, False, False]


def test_hung_sync_env_is_killed_within_the_timeout(tok, env_file):
    env = EnvProcess(f"{env_file}:Scripted", {"script": "hang"}, timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(EnvCallError) as e:
        env.step("anything")
    assert e.value.kind == "timeout" and 1.5 <= time.monotonic() - t0 < 5.0
    with pytest.raises(ProcessLookupError):
        os.kill(env.pid, 0)
    # in an episode: ends, counted as a timeout, reward 0, the run goes on
    (ep,) = runner(tok, f"{env_file}:Scripted", timeout_s=1.0).run(
        ScriptedEngine(tok), [make_prompt(tok, script="hang")], 1, SamplingParams(max_new_tokens=16))
    assert ep.error == "timeout" and ep.num_turns == 1 and episode_stats([ep])["multi_turn/env_timeouts"] == 1


def test_an_environment_that_always_hangs_ends_a_256_sample_step_in_one_wave(tok, env_file):
    """Issue 64: a hang past the deadline ends its episode and the run goes on, so an environment
    that hangs on every call cost one deadline per wave of episodes: 256 episodes, 64 at a time,
    10 s each, 40 s before anything was said (and 256 / concurrency deadlines in general). A
    step now stops once its expiries reach half of its started episodes: one wave, one line,
    every worker killed."""
    r = runner(tok, f"{env_file}:Scripted", timeout_s=10.0)
    prompts = [make_prompt(tok, i, script="block") for i in range(64)]
    t0 = time.monotonic()
    with pytest.raises(EpisodesHung, match=r"^episodes.environment .*envs.py:Scripted: (\d+) of the (\d+) episodes "
                                           r"started this step passed episodes.timeout_s=10s, episodes"
                                           r".max_timeout_fraction=0.5 of them: it hangs; every worker was killed"):
        r.run(ScriptedEngine(tok), prompts, 4, SamplingParams(max_new_tokens=16))
    assert time.monotonic() - t0 < 30
    assert live_workers(wait_s=10.0) == []


def test_a_rare_hang_ends_its_episode_and_the_step_goes_on(tok, env_file):
    """Three of sixteen episodes hang: each ends as a timeout, counted, and the step returns.
    With ``max_timeout_fraction: null``, even every episode hanging is only counted."""
    prompts = [make_prompt(tok, i, script="block" if i in (2, 7, 11) else "obs done") for i in range(16)]
    episodes = runner(tok, f"{env_file}:Scripted", timeout_s=2.0).run(
        ScriptedEngine(tok), prompts, 1, SamplingParams(max_new_tokens=16))
    assert [i for i, e in enumerate(episodes) if e.error is not None] == [2, 7, 11]
    assert episode_stats(episodes)["multi_turn/env_timeouts"] == 3
    hung = [make_prompt(tok, i, script="block") for i in range(2)]
    episodes = runner(tok, f"{env_file}:Scripted", timeout_s=1.0, max_timeout_fraction=None).run(
        ScriptedEngine(tok), hung, 2, SamplingParams(max_new_tokens=16))
    assert [e.error for e in episodes] == ["timeout"] * 4


class SizeSpy:
    """The tokenizer, recording the longest text handed to it or to its chat template."""

    def __init__(self, tok):
        self._tok = tok
        self.longest = 0

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def _seen(self, text):
        assert len(text) < 1_000_000, f"the tokenizer was handed {len(text)} characters"
        self.longest = max(self.longest, len(text))

    def __call__(self, text, **kwargs):
        self._seen(text)
        return self._tok(text, **kwargs)

    def apply_chat_template(self, messages, **kwargs):
        for m in messages:
            self._seen(m["content"])
        return self._tok.apply_chat_template(messages, **kwargs)


def test_huge_observation_is_cut_before_it_is_tokenized(tok, env_file):
    spy = SizeSpy(tok)
    r = runner(spy, f"{env_file}:Huge", max_turns=3, max_episode_tokens=40, timeout_s=30.0)
    (ep,) = r.run(ScriptedEngine(tok), [make_prompt(tok)], 1, SamplingParams(max_new_tokens=16))
    # 5 model tokens, then an observation of at most 34 tokens' worth of characters: it does not
    # fit (the episode ends, length, as it would uncut) and nothing near its size was tokenized
    assert ep.sample.finish_reason == "length" and ep.num_turns == 1 and ep.error is None
    assert ep.observations_cut == 1 and episode_stats([ep])["multi_turn/observations_cut"] == 1
    assert spy.longest <= r.renderer.observation_char_limit(40 - 5 - 1) + 100  # + the template around it
    # the worker sends at most the limit plus one character: 50 MB never crosses the pipe
    env = EnvProcess(f"{env_file}:Huge", {}, timeout_s=30.0)
    try:
        assert len(env.step("anything", 100)["observation"]) == 101
    finally:
        env.close()


def _sleeps(marker: str, wait_s: float = 5.0) -> list[int]:
    """Pids of live processes whose command line holds ``marker``, after waiting (bounded) for
    them to go (a killed process is a zombie, with no command line, until it is reaped)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


def _describe(pid: int) -> str:
    """``/proc/<pid>/stat``'s state, parent and process group, and the parent's command line."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        parent = (Path("/proc") / fields[1] / "cmdline").read_bytes().replace(b"\0", b" ")[:120]
        return f"pid {pid}: state {fields[0]}, ppid {fields[1]}, pgid {fields[2]}, parent {parent!r}"
    except OSError as e:
        return f"pid {pid}: {e}"


def _sleeps_shown(marker: str, count: int, wait_s: float = 10.0) -> list[int]:
    """``_sleeps(marker)`` once ``count`` of them show (bounded): a child's command line is empty
    for a while after ``Popen`` has returned in its parent (the kernel fills it late in exec;
    measured on the 2-core machine at load 4: empty right after Popen in 1518 of 2000 spawns,
    shown 0.7 ms later in the median, 4.7 ms at most), and longer on a loaded one."""
    deadline = time.monotonic() + wait_s
    while len(pids := _sleeps(marker, wait_s=0)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return pids


def test_an_environments_children_die_with_its_worker(tok, env_file):
    """Each worker leads its own process group, killed whole when its episode ends."""
    marker = f"600.{uuid.uuid4().int % 10**12}1"  # unique: a stale sleep of another run never matches
    t0 = time.monotonic()
    episodes = runner(tok, f"{env_file}:Spawner", max_turns=2).run(
        ScriptedEngine(tok), [make_prompt(tok, marker=marker)], 2, SamplingParams(max_new_tokens=16))
    assert [e.error for e in episodes] == [None, None] and time.monotonic() - t0 < 30
    try:
        left = _sleeps(marker, wait_s=15.0)  # a killed process still needs the CPU to exit: a loaded machine
        assert left == [], [_describe(pid) for pid in left]
    finally:
        for pid in _sleeps(marker, wait_s=0):
            os.kill(pid, 9)


def test_the_fork_servers_exit_ends_its_workers_children(env_file):
    """The trainer's process ends while an environment runs: the fork server's exit kills the
    process group of every worker still running, with what the environment started. (This half
    of the test above failed under load as "the sleep gone at once": it counted the sleeps by
    command line right after the step returned, before the kernel had filled the new one's.)"""
    marker = f"600.{uuid.uuid4().int % 10**12}3"
    try:
        env = EnvProcess(f"{env_file}:Spawner", {"marker": marker}, timeout_s=5.0)
        env.step("anything")
        assert len(_sleeps_shown(marker, 1)) == 1
        fork_server().close()
        left = _sleeps(marker)
        assert left == [], [_describe(pid) for pid in left]
    finally:
        for pid in _sleeps(marker, wait_s=0):
            os.kill(pid, 9)


def test_a_killed_fork_servers_workers_children_die_when_it_is_closed(env_file):
    """The fork server killed (by someone, or by ``close`` after its 5 s on a loaded machine)
    kills nothing itself; its workers die of the parent-death signal, and ``close`` kills the
    process groups of the workers this process asked for, with what they started."""
    marker = f"600.{uuid.uuid4().int % 10**12}5"
    try:
        env = EnvProcess(f"{env_file}:Spawner", {"marker": marker}, timeout_s=5.0)
        env.step("anything")
        assert len(_sleeps_shown(marker, 1)) == 1
        server = fork_server()
        server.proc.kill()
        server.proc.wait(timeout=10)
        assert len(_sleeps(marker, wait_s=1.0)) == 1  # orphaned, alive: what close must kill
        server.close()
        left = _sleeps(marker)
        assert left == [], [_describe(pid) for pid in left]
    finally:
        for pid in _sleeps(marker, wait_s=0):
            os.kill(pid, 9)


def test_constructor_error_ends_the_episode(tok, env_file):
    (ep,) = runner(tok, f"{env_file}:BadInit").run(ScriptedEngine(tok), [make_prompt(tok)], 1,
                                                  SamplingParams(max_new_tokens=16))
    assert ep.error == "error" and ep.num_turns == 0 and ep.sample.output_ids == []


# ---- bad input: one line naming the file, the class and what is wrong -------------------------


def test_bad_environment_one_liners(tok, env_file, tmp_path):
    with pytest.raises(ValueError) as e:  # ConfigValueError; the loader adds the file and the section
        EpisodesConfig(kind="environment", source=str(tmp_path / "missing.py") + ":Env")
    assert "missing.py" in str(e.value) and "not found" in str(e.value)
    with pytest.raises(ValueError, match="neither a built-in"):
        EpisodesConfig(kind="environment", source="calculater")
    with pytest.raises(EnvContractError, match=r"envs.py:NoStep: the class has no method step"):
        check_environment(f"{env_file}:NoStep", 5.0)
    with pytest.raises(EnvContractError, match=r"envs.py:Nope: the file has no attribute 'Nope'"):
        check_environment(f"{env_file}:Nope", 5.0)
    with pytest.raises(ConfigError, match="NoStep: the class has no method step"):
        runner(tok, f"{env_file}:NoStep")
    # a step answer of the wrong shape: at the first episode, the run stops with one line
    with pytest.raises(EnvContractError) as e:
        runner(tok, f"{env_file}:Scripted").run(ScriptedEngine(tok), [make_prompt(tok, script="bad")], 1,
                                                SamplingParams(max_new_tokens=16))
    assert "envs.py:Scripted: step returned observation of type int" in str(e.value) and "\n" not in str(e.value)





def test_a_reward_no_float_holds_breaks_the_contract():
    """Issue 48, second round: ``float(10**400)`` raised OverflowError inside the worker's check,
    which ended the worker as a crash: the episode was counted as an environment error and the
    run went on. It is the same one-line contract error as ``reward: inf`` now."""
    from megatron_grpo.rollout.episodes.environment.loading import check_step_result

    for reward, shown in [(10**400, "'1000000000000000000000000000000000000000'"),
                          (10**5000, "<unprintable int>"), (float("inf"), "'inf'")]:
        with pytest.raises(ValueError) as e:
            check_step_result({"observation": None, "done": True, "reward": reward}, "envs.py:Env")
        assert str(e.value) == f"episodes.environment envs.py:Env: step returned reward={shown}; expected a finite number"


def test_config_refuses_the_overlong_penalty_with_an_environment():
    with pytest.raises(ValueError, match="overlong.buffer_length"):
        experiment(rollout=RolloutConfig(overlong=OverlongConfig(buffer_length=4)),
                   episodes=EpisodesConfig(kind="environment", source="calculator"))


# ---- the loss over model tokens only ---------------------------------------------------------


def _interleaved_and_compacted(seed=0):
    """Two batches of the same episodes: with observation tokens (mask 0) interleaved, and with
    them removed (the model tokens only, contiguous); plus per-token inputs aligned on both."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[2, 5, 6], [2, 7], [2, 8, 9, 10]]
    masks = [[1, 1, 0, 0, 0, 1, 1, 1], [1, 0, 0, 1], [1, 1, 1, 0, 1, 0, 0, 1, 1]]
    outputs = [[int(t) for t in torch.randint(11, 200, (len(m),), generator=g)] for m in masks]
    lps = [[(-torch.rand((), generator=g)).item() if k else 0.0 for k in m] for m in masks]
    adv = torch.tensor([0.7, -1.2, 0.4])
    inter = build_train_batch(prompts, outputs, lps, adv, pad_id=0, output_masks=masks)
    comp = build_train_batch(prompts, [[t for t, k in zip(o, m) if k] for o, m in zip(outputs, masks)],
                             [[lp for lp, k in zip(l, m) if k] for l, m in zip(lps, masks)], adv, pad_id=0)
    # the same per-model-token values on both layouts
    model_tokens = int(inter.loss_mask.sum())
    values = {name: torch.randn(model_tokens, generator=g, dtype=torch.float64) * 0.3 for name in ("lp", "lo", "ref")}
    ent = torch.rand(model_tokens, generator=g, dtype=torch.float64)

    def place(batch, flat):
        out = torch.full(batch.loss_mask.shape, float("nan"), dtype=torch.float64)  # never read where mask 0
        out[batch.loss_mask.bool()] = flat
        return out

    def inputs(batch):
        lp = batch.rollout_log_probs.double()
        return dict(log_probs=place(batch, values["lp"] + lp[batch.loss_mask.bool()]),
                    old_log_probs=place(batch, values["lo"] + lp[batch.loss_mask.bool()]),
                    ref_log_probs=place(batch, values["ref"] + lp[batch.loss_mask.bool()]),
                    entropy=place(batch, ent), rollout_log_probs=batch.rollout_log_probs.double(),
                    advantages=batch.advantages.double(), loss_mask=batch.loss_mask)

    return inter, comp, inputs(inter), inputs(comp), masks


def test_observation_tokens_get_mask_0_and_log_prob_0():
    inter, comp, _, _, masks = _interleaved_and_compacted()
    assert int(inter.loss_mask.sum()) == sum(map(sum, masks)) == int(comp.loss_mask.sum())
    for i, m in enumerate(masks):
        p = 3 if i == 0 else (2 if i == 1 else 4)
        assert inter.loss_mask[i, p - 1: p - 1 + len(m)].tolist() == [float(k) for k in m]
        assert all(inter.rollout_log_probs[i, p - 1 + j] == 0 for j, k in enumerate(m) if not k)


OFF_POLICY = [
    {},
    {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 1.5},
    {"tis_ratio_type": "sequence", "sequence_tis_ratio_clip_high": 1.3},
    {"sequence_mask_metric": "geometric", "geo_mask_low": 0.9, "geo_mask_high": 1.05},
    {"sequence_mask_metric": "product", "product_mask_low": 0.5, "product_mask_high": 1.5},
    {"outlier_token_is_threshold_high": 1.4, "outlier_token_is_threshold_low": 0.6},
]


@pytest.mark.parametrize("reduction", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                                       "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("opc", OFF_POLICY, ids=lambda o: ",".join(o) or "none")
def test_every_reduction_and_correction_counts_model_tokens_only(reduction, opc):
    """The loss, its gradient and every metric of a batch with interleaved observation tokens
    equal those of the same episodes with the observations cut out."""
    _, _, a, b, _ = _interleaved_and_compacted(seed=1)
    cfg = AlgorithmConfig(loss_reduction=reduction, max_response_length=16, kl_loss_coef=0.1, entropy_coef=0.01,
                          off_policy_correction=OffPolicyCorrectionConfig(**opc))
    results = []
    for x in (a, b):
        lp = x["log_probs"].clone().requires_grad_(True)
        loss, metrics = compute_policy_loss(**{**x, "log_probs": lp}, config=cfg)
        loss.backward()
        results.append((loss.detach(), metrics, lp.grad[x["loss_mask"].bool()]))
    (la, ma, ga), (lb, mb, gb) = results
    assert torch.allclose(la, lb, rtol=1e-12, atol=1e-12), (la, lb)
    assert torch.allclose(ga, gb, rtol=1e-12, atol=1e-12)
    assert ma.keys() == mb.keys()
    for k in ma:
        assert ma[k] == pytest.approx(mb[k], rel=1e-10, abs=1e-12), k


def test_seq_mean_token_mean_by_hand():
    """L_i is the model-token count: rows with 5/8, 2/4 and 6/9 model tokens."""
    inter, _, a, _, masks = _interleaved_and_compacted(seed=2)
    cfg = AlgorithmConfig(loss_reduction="seq_mean_token_mean")
    loss, metrics = compute_policy_loss(a["log_probs"], a["old_log_probs"], a["advantages"], a["loss_mask"], cfg)
    # num_iterations 1 semantics do not matter here: ppo value at r = exp(lp - lo)
    r = torch.exp(a["log_probs"] - a["old_log_probs"])
    adv = a["advantages"].unsqueeze(-1)
    per_token = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
    m = a["loss_mask"].bool()
    hand = sum(per_token[i][m[i]].sum() / sum(masks[i]) for i in range(3)) / 3
    assert loss.item() == pytest.approx(hand.item(), rel=1e-12)
    assert metrics["num_valid_tokens"] == 13


# ---- token-in/token-out against the real embedded engine ------------------------------------


class Recording:
    """A RolloutEngine that records what each generate call was given and returned."""

    def __init__(self, client):
        self.client, self.calls = client, []

    def generate(self, prompts, n, sampling, **kw):
        out = self.client.generate(prompts, n, sampling, **kw)
        self.calls.append((list(prompts[0]), out[0]))
        return out


@pytest.mark.slow
def test_trainer_tokens_are_the_engines_tokens_plus_observations(tok, env_file, embedded):
    engine = Recording(embedded)
    prompts = [make_prompt(tok, index=i, script="obs obs obs") for i in range(2)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=[tok.eos_token_id])
    episodes = runner(tok, f"{env_file}:Scripted", max_turns=3).run(engine, prompts, 2, sampling, sampling_seed=11)
    assert all(e.error is None and e.num_turns == 3 for e in episodes)
    batch = build_train_batch([e.sample.prompt_ids for e in episodes], [e.sample.output_ids for e in episodes],
                              [e.sample.output_logprobs for e in episodes], torch.zeros(4), pad_id=0,
                              output_masks=[e.sample.output_mask for e in episodes])
    renderer = TurnRenderer(tok, "user")
    for row, e in enumerate(episodes):
        full = e.sample.prompt_ids + e.sample.output_ids
        # this episode's generate calls: those whose input and output are a prefix of its sequence
        turns = {len(given): got for given, got in engine.calls
                 if given + got.output_ids == full[: len(given) + len(got.output_ids)]}
        turns = [turns[k] for k in sorted(turns)]
        assert len(turns) == 3
        # turn k's input is exactly turn k-1's input + its output + the observation ids, and the
        # trainer's row is the last input + output: the trainer scores what the engine saw
        context, expected_lp, expected_mask = list(e.sample.prompt_ids), [], []
        for k, got in enumerate(turns):
            assert got.prompt_ids == context
            context += got.output_ids
            expected_lp += got.output_logprobs
            expected_mask += [1] * len(got.output_ids)
            if k < 2:
                obs = renderer.observation_ids(got.output_ids, "result 7")
                context += obs
                expected_lp += [0.0] * len(obs)
                expected_mask += [0] * len(obs)
        n = len(context)
        assert n == len(full) and batch.tokens[row, :n].tolist() == context
        p = len(e.sample.prompt_ids)
        assert batch.loss_mask[row, p - 1: n - 1].tolist() == [float(k) for k in expected_mask]
        assert batch.loss_mask[row, n - 1:].sum() == 0 and batch.loss_mask[row, : p - 1].sum() == 0
        assert batch.rollout_log_probs[row, p - 1: n - 1].tolist() == torch.tensor(expected_lp).tolist()
