"""Multi-turn episodes on the real engines and modes (docs/multi_turn.md#engines-modes-and-weight-updates):

* an episode that spans a weight update on the embedded engine: every turn after the update
  is scored by the new weights (the engine keeps no KV cache across requests: each turn is
  prefilled afresh), and the episode reports the oldest weight version that sampled it;
* token-in/token-out on the real SGLang server: each turn is generated on the exact ids so far,
  and the engine's log-probs of the model tokens are SGLang's own log-probs of the final sequence;
* `megatron-grpo train` with an environment in one_step_off_policy mode (policy lag 1), on the
  embedded engine and on the real SGLang.

The SGLang tests use the session's shared server (tests/support/sglang_shared.py), reset before each.
"""

import dataclasses
import subprocess

import pytest

from megatron_grpo.data.prompts import Prompt, render_prompt
from megatron_grpo.generation.client import RolloutClient
from megatron_grpo.generation.manager import RolloutServerManager, weight_sync_dir
from megatron_grpo.rollout.episodes.environment.loop import EpisodeRunner
from megatron_grpo.rollout.episodes.turns import TurnRenderer
from megatron_grpo.wire.samples import SamplingParams
from tools.tiny import DEMO_ARCH, build_tokenizer, save_tiny_model
from tests.support.demo_run import ENV, NUDGE, ROOT, read_metrics, train_cmd
from tests.support.sglang_shared import API_KEY
from megatron_grpo.config import EngineConfig, EpisodesConfig
from tests.support.configs import experiment

pytestmark = pytest.mark.slow

SCRIPTED = '''
class ThreeTurns:
    """Answers "result 7" twice, then ends the episode."""
    def __init__(self, row):
        self.turn = 0

    def step(self, response):
        self.turn += 1
        if self.turn < 3:
            return {"observation": "result 7", "done": False, "reward": 0.25}
        return {"observation": None, "done": True, "reward": 1.0}
'''


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def env_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("envs") / "envs.py"
    path.write_text(SCRIPTED + NUDGE)
    return path


def make_prompt(tok, index=0):
    text, prompt_ids = render_prompt("what is 3 plus 4", tok, use_template=True, system_prompt=None, where="test")
    return Prompt(index=index, where="test", text=text, prompt_ids=prompt_ids, answer="7", fields={})


def runner(tok, environment):
    cfg = EpisodesConfig(kind="environment", source=environment, observation_role="user", timeout_s=30.0)
    return EpisodeRunner.build(cfg, tok, max_inflight=1, use_template=True)


class Recording:
    """A RolloutEngine recording each generate call; ``after_first`` runs once after the first."""

    def __init__(self, client, after_first=None):
        self.client, self.calls, self.after_first = client, [], after_first

    def generate(self, prompts, n, sampling, **kw):
        out = self.client.generate(prompts, n, sampling, **kw)
        self.calls.append((list(prompts[0]), out[0]))
        if self.after_first is not None:
            self.after_first()
            self.after_first = None
        return out


def _turn_positions(episode):
    """Per model turn, the positions of its tokens in the full sequence (prompt + output)."""
    p, turns, current = len(episode.sample.prompt_ids), [], []
    for k, m in enumerate(episode.sample.output_mask + [0]):
        if m:
            current.append(p + k)
        elif current:
            turns.append(current)
            current = []
    return turns


def _check_token_in_token_out(engine, episode, tok):
    """Turn k's input is turn k-1's input + its output + the observation ids; the sample is the
    last input + output."""
    renderer = TurnRenderer(tok, "user")
    context = list(episode.sample.prompt_ids)
    for k, (given, got) in enumerate(engine.calls):
        assert given == context
        context += got.output_ids
        if k < len(engine.calls) - 1:
            context += renderer.observation_ids(got.output_ids, "result 7")
    assert context == episode.sample.prompt_ids + episode.sample.output_ids


def test_an_episode_spanning_a_weight_update_is_scored_by_the_new_weights(tok, env_file, tmp_path):
    """The stale-prefix-cache question: the embedded engine keeps no KV cache between requests
    (prefix sharing is only among the n samples of one request, which a weight update waits
    for), so turn 2, generated after the update, is the new weights' from its first token."""
    old = save_tiny_model(tmp_path / "old", "qwen2", seed=3)
    # in the run's weight-sync directory: a launched engine loads weights from there only
    new = save_tiny_model(weight_sync_dir(tmp_path / "run") / "new", "qwen2", seed=4)
    cfg = experiment(engine=EngineConfig(dtype="float32", launch_timeout_s=300))
    with RolloutServerManager(cfg, model_dir=old, run_dir=tmp_path / "run") as manager:
        client = RolloutClient.from_config(cfg.engine, manager.urls)
        (url,) = manager.urls
        client.update_weight_version(url, "1")

        def load(model_dir, version):
            client.run(client.aio.update_weights_from_disk(url, str(model_dir), weight_version=version))

        engine = Recording(client, after_first=lambda: load(new, "2"))  # a sync between turns 1 and 2
        sampling = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=[tok.eos_token_id])
        (episode,) = runner(tok, f"{env_file}:ThreeTurns").run(engine, [make_prompt(tok)], 1, sampling,
                                                                sampling_seed=5)
        assert episode.error is None and episode.num_turns == 3
        assert [got.weight_version for _, got in engine.calls] == ["1", "2", "2"]
        assert episode.sample.weight_version == "1"  # the oldest: the trainer sees the lag
        _check_token_in_token_out(engine, episode, tok)
        full = episode.sample.prompt_ids + episode.sample.output_ids
        lp_new = client.prompt_logprobs(url, full)  # position i scores full[i + 1]
        load(old, "3")
        lp_old = client.prompt_logprobs(url, full)
        client.close()
    p = len(episode.sample.prompt_ids)
    engine_lp = {p + k: lp for k, lp in enumerate(episode.sample.output_logprobs)}
    first, *later = _turn_positions(episode)
    for i in first:  # turn 1: the old weights'
        assert abs(engine_lp[i] - lp_old[i - 1]) <= 1e-4, (i, engine_lp[i], lp_old[i - 1])
    later = [i for turn in later for i in turn]
    for i in later:  # turns 2 and 3: the new weights', context included (no stale cache)
        assert abs(engine_lp[i] - lp_new[i - 1]) <= 1e-4, (i, engine_lp[i], lp_new[i - 1])
    # the two weight sets really differ on these tokens: the check above is not vacuous
    assert max(abs(engine_lp[i] - lp_old[i - 1]) for i in later) > 1e-2


def test_episodes_on_the_real_sglang_are_token_in_token_out(tok, env_file, tmp_path, sglang_servers):
    """On the session's shared SGLang server (tests/support/sglang_shared.py), reset to a tiny Qwen2 of
    the demo models' size."""
    model = save_tiny_model(tmp_path / "model", "qwen2", seed=3, **DEMO_ARCH)
    url = sglang_servers.serve(model)
    with RolloutClient([url], api_key=API_KEY, request_timeout_s=120) as client:
        engine = Recording(client)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=[tok.eos_token_id])
        (episode,) = runner(tok, f"{env_file}:ThreeTurns").run(engine, [make_prompt(tok)], 1, sampling,
                                                                sampling_seed=5)
        full = episode.sample.prompt_ids + episode.sample.output_ids
        lp = client.prompt_logprobs(url, full)
    assert episode.error is None and episode.num_turns == 3
    assert all(got.finish_reason != "abort" for _, got in engine.calls)
    _check_token_in_token_out(engine, episode, tok)
    p = len(episode.sample.prompt_ids)
    for turn in _turn_positions(episode):  # SGLang's log-probs of each turn = its log-probs of the whole episode
        for i in turn:
            got = episode.sample.output_logprobs[i - p]
            assert abs(got - lp[i - 1]) <= 1e-4, (i, got, lp[i - 1])


OFF_POLICY = ("rollout.mode=one_step_off_policy", "episodes.observation_role=user",
              "episodes.max_episode_tokens=64", "rollout.prompts_per_step=4", "rollout.num_generations=4",
              "parallel.global_batch_size=16", "parallel.micro_batch_size=8", "eval.every_n_steps=0",
              "logging.plot=false")


def _train_off_policy(demo, tmp_path, env_file, *extra, timeout=900):
    run_dir = tmp_path / "run"
    cmd = train_cmd(demo, run_dir, 3, "episodes.kind=environment", f"episodes.source={env_file}:Nudge", *OFF_POLICY,
                    *extra)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the first step generates in order; each later batch was sampled by weights one step old
    assert [r["rollout/policy_lag"] for r in rows] == [0, 1, 1]
    for r in rows:
        assert r["multi_turn/turns_mean"] == 2 and r["multi_turn/env_errors"] == 0
        assert r["num_valid_tokens"] == 32  # 2 model tokens per episode, 16 episodes
    return rows


def test_train_one_step_off_policy_with_an_environment(demo, tmp_path, env_file):
    _train_off_policy(demo, tmp_path, env_file)


def test_train_on_the_real_sglang_one_step_off_policy_with_an_environment(demo, tmp_path, env_file, sglang_servers):
    """On the session's shared SGLang server (tests/support/sglang_shared.py) in engine.urls, reset to
    the demo model; the run syncs its weights into it before the first step and after each."""
    url = sglang_servers.serve(demo / "model")
    rows = _train_off_policy(demo, tmp_path, env_file, *sglang_servers.train_overrides(url))
    for r in rows:
        assert r["weight_sync_verified"] == 1


THREE_TURN_AGENT = '''
def run(client, row):
    messages = list(row["messages"])
    for turn in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "result 7"}]
    return 0.0
'''


def test_an_sdk_agent_on_the_real_sglang_is_token_in_token_out(tok, tmp_path, sglang_servers):
    """The agent front in front of the real SGLang (docs/agents.md): an OpenAI-SDK agent's three
    calls are generated on the exact ids so far, and the recorded log-probs of every model turn
    are SGLang's own log-probs of the whole episode."""
    from megatron_grpo.data.prompts import prompt_messages
    from megatron_grpo.rollout.episodes.agent.runner import AgentRunner

    agent_file = tmp_path / "agent.py"
    agent_file.write_text(THREE_TURN_AGENT)
    model = save_tiny_model(tmp_path / "model", "qwen2", seed=3, **DEMO_ARCH)
    url = sglang_servers.serve(model)
    prompt = dataclasses.replace(make_prompt(tok), messages=prompt_messages("what is 3 plus 4", None))
    runner = AgentRunner(f"{agent_file}:run", tok, TurnRenderer(tok, "user"), max_turns=3, max_episode_tokens=64,
                         timeout_s=120, workers=1, tool_call_format="compute")
    try:
        with RolloutClient([url], api_key=API_KEY, request_timeout_s=120) as client:
            engine = Recording(client)
            sampling = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=[tok.eos_token_id])
            (episode,) = runner(engine, [prompt], 1, sampling, 5)
            full = episode.sample.prompt_ids + episode.sample.output_ids
            lp = client.prompt_logprobs(url, full)
    finally:
        runner.close()
    assert episode.error is None and episode.num_turns == 3 and len(engine.calls) == 3
    _check_token_in_token_out(engine, episode, tok)
    p = len(episode.sample.prompt_ids)
    for turn in _turn_positions(episode):
        for i in turn:
            got = episode.sample.output_logprobs[i - p]
            assert abs(got - lp[i - 1]) <= 1e-4, (i, got, lp[i - 1])
