"""Environments written for skyrl-gym, OpenEnv and TRL's ``environment_factory`` run unchanged
through the episode loop (rollout/episodes/environment/connectors/, docs/multi_turn.md "Environments
from skyrl-gym, OpenEnv and TRL-style tool classes"), against the real libraries: each adapter
stepped through its worker process (``EnvProcess``) and checked against what the library itself
answers for the same actions, called directly here; the failures are counted or one line; and a
skyrl-gym and an OpenEnv environment each train 2 steps through ``megatron-grpo train``.

The libraries are imported at the top: a missing one fails this module (CI installs the
``agents`` extra), it is never skipped.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import skyrl_gym
from omegaconf import DictConfig
from openenv.cli.commands import init as openenv_init

from megatron_grpo.config.base import ConfigValueError
from megatron_grpo.config.connectors import AGENTS_EXTRA, CONNECTORS
from megatron_grpo.config.episodes import EpisodesConfig, environment_problem
from megatron_grpo.rollout.episodes.environment import EnvCallError, EnvContractError, EnvProcess, check_environment
from megatron_grpo.rollout.episodes.environment.connectors import openenv_adapter
from megatron_grpo.rollout.episodes.environment.worker import fork_server, shutdown_fork_server
from megatron_grpo.rollout.episodes.episode import Episode, episode_stats
from megatron_grpo.wire.samples import Sample, SamplingParams
from tests.support.demo_run import ENV, ROOT, read_metrics, train_cmd

ROW = {"prompt": "what is 3 plus 4", "answer": "7", "data_source": "test"}
INCREMENT = f"{ROOT}/docs/examples/increment_tools.py:IncrementEnv"

# A skyrl-gym environment of one's own (skyrl_gym:FILE:AskAgain); its words are the demo model's.
SKYRL_ENVS = '''
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class AskAgain(BaseTextEnv):
    """Turn 1 asks again (two messages); turn 2 ends, reward 1 when the last word is the ground truth."""

    def __init__(self, env_config=None, extras={}):
        super().__init__()
        self.truth = extras["reward_spec"]["ground_truth"]

    def step(self, action):
        self.turns += 1
        if self.turns == 1:
            return BaseTextEnvStepOutput(observations=[{"role": "user", "content": "please reply"},
                                                       {"role": "user", "content": "with only a number"}],
                                         reward=0.0, done=False, metadata={})
        words = action.split()
        return BaseTextEnvStepOutput(observations=[], reward=float(bool(words) and words[-1] == self.truth),
                                     done=True, metadata={})


class RewritesPrompt(AskAgain):
    def init(self, prompt):
        return [{"role": "system", "content": "be brief"}, *prompt], {}
'''

TOOL_ENVS = '''
class Raises:
    def reset(self, **kwargs):
        return None

    def explode(self, why: str) -> str:
        raise ValueError(f"boom: {why}")


class OwnsThePrompt(Raises):
    def reset(self, **kwargs):
        return "Increment the counter by 3."


class NoTools:
    def reset(self, **kwargs):
        return None

    def get_reward(self) -> float:
        return 0.0

    @staticmethod
    def helper(x):
        return x


class NeedsAnUrl(Raises):
    def __init__(self, url):
        self.url = url


class Calculator:
    """TRL-style: the demo model's `compute <expression>` calls this method."""
    def reset(self, **kwargs):
        self.answer, self.last = kwargs["answer"], None

    def compute(self, expression: str) -> str:
        from megatron_grpo.rollout.episodes.environment.builtin import evaluate, format_number
        self.last = format_number(evaluate(expression))
        return f"result {self.last}"

    def get_reward(self) -> float:
        return float(self.last == self.answer)
'''


@pytest.fixture(scope="module")
def env_files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("connector_envs")
    (d / "skyrl_envs.py").write_text(SKYRL_ENVS)
    (d / "tool_envs.py").write_text(TOOL_ENVS)
    return d


# ---- the spec: one table of prefixes, checked at config load ---------------------------------------

def test_specs_are_checked_at_config_load_in_one_line(env_files, monkeypatch):
    assert environment_problem("skyrl_gym:gsm8k") is None
    assert environment_problem(f"skyrl_gym:{env_files}/skyrl_envs.py:AskAgain") is None
    assert environment_problem(f"tools:{INCREMENT}") is None
    assert environment_problem("openenv:http://127.0.0.1:8000") is None
    assert environment_problem("gym:CartPole-v1") == ("'gym:CartPole-v1': unknown environment connector 'gym' "
                                                      "(known: skyrl_gym, openenv, tools)")
    assert environment_problem("tools:gsm8k") == "'tools:gsm8k' is not of the form tools:path/to/env.py:ClassName"
    assert "nope/app.py not found" in environment_problem("openenv:nope/app.py:app")
    # the one table holds the agents' connectors too: named as such
    assert environment_problem(f"verifiers:{INCREMENT}") == (f"'verifiers:{INCREMENT}': verifiers is an agent "
                                                             "connector; set episodes.kind: agent")
    # a library that is not installed: named, with the extra that installs it
    missing = dataclasses.replace(CONNECTORS["skyrl_gym"], library="no_such_library_in_this_test")
    monkeypatch.setitem(CONNECTORS, "skyrl_gym", missing)
    assert environment_problem("skyrl_gym:gsm8k") == ("'skyrl_gym:gsm8k' needs the skyrl-gym library, which is not "
                                                      f"installed: {AGENTS_EXTRA}")
    with pytest.raises(ConfigValueError, match=r"^source: 'skyrl_gym:gsm8k' needs the skyrl-gym library"):
        EpisodesConfig(kind="environment", source="skyrl_gym:gsm8k")


# ---- skyrl-gym -------------------------------------------------------------------------------------

def library_steps(env, responses: list[str]) -> list[dict]:
    """skyrl-gym's own answers: ``env.init`` then ``env.step`` per response, until done."""
    env.init([{"role": "user", "content": ROW["prompt"]}])
    out = []
    for r in responses:
        out.append(env.step(r))
        if out[-1]["done"]:
            break
    return out


def expected_answer(step_output: dict) -> dict:
    """What the adapter must send for a library answer (the mapping docs/multi_turn.md states)."""
    done = bool(step_output["done"])
    text = "\n".join(m["content"] for m in step_output["observations"])
    return {"observation": None if done else text, "done": done, "reward": float(step_output["reward"])}


@pytest.mark.parametrize("env_id, responses", [
    ("gsm8k", ["the answer is #### 7"]),
    ("gsm8k", ["7"]),
    ("gsm8k_multi_turn", ["7", "#### 8", "#### 7"]),
    ("aime", ["the answer is \\boxed{7}"]),
])
def test_a_registered_skyrl_gym_env_answers_as_the_library_does(env_id, responses):
    row = {**ROW, "extra_info": {"max_turns": 3}, "reward_model": {"ground_truth": "7"}}
    # skyrl-gym, called directly: SkyRL's extras are the row's fields but the prompt
    extras = {"answer": "7", "data_source": "test", "extra_info": {"max_turns": 3},
              "reward_model": {"ground_truth": "7"}, "reward_spec": {"method": "rule", "ground_truth": "7"}}
    expected = [expected_answer(o) for o in
                library_steps(skyrl_gym.make(env_id, env_config=DictConfig({}), extras=extras), responses)]
    env = EnvProcess(f"skyrl_gym:{env_id}", row, 30)
    try:
        got = [env.step(r) for r in responses[:len(expected)]]
    finally:
        env.close()
    assert got == expected
    assert expected[-1]["done"] and len(expected) == len(responses)


def test_a_skyrl_gym_env_of_ones_own_and_the_one_line_refusals(env_files):
    spec = f"skyrl_gym:{env_files}/skyrl_envs.py:AskAgain"
    check_environment(spec, 30)
    sys.path.insert(0, str(env_files))
    try:
        from skyrl_envs import AskAgain  # the same class, called directly
    finally:
        sys.path.remove(str(env_files))
    extras = {"answer": "7", "data_source": "test", "reward_spec": {"method": "rule", "ground_truth": "7"}}
    for responses in (["3", "7"], ["3", "8"]):
        expected = [expected_answer(o) for o in library_steps(AskAgain(extras=extras), responses)]
        env = EnvProcess(spec, ROW, 30)
        assert [env.step(r) for r in responses] == expected
        env.close()
    assert expected[0]["observation"] == "please reply\nwith only a number"  # two messages, one observation turn

    with pytest.raises(EnvContractError, match=r"^episodes.environment skyrl_gym:nope: no skyrl-gym environment "
                                               r"'nope' is registered \(registered: aime, gsm8k, gsm8k_multi_turn"):
        check_environment("skyrl_gym:nope", 30)
    with pytest.raises(EnvContractError, match=r"skyrl_envs.py:RewritesPrompt: init\(prompt\) returned a different "
                                               r"prompt .*cannot run unchanged"):
        EnvProcess(f"skyrl_gym:{env_files}/skyrl_envs.py:RewritesPrompt", ROW, 30)


# ---- TRL-style tool classes ----------------------------------------------------------------------

def call(name: str, **arguments) -> str:
    """A Hermes-format tool call, as a Qwen model writes it."""
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_a_tool_class_answers_as_its_methods_do():
    sys.path.insert(0, str(ROOT / "docs" / "examples"))
    try:
        from increment_tools import IncrementEnv  # the class itself, called directly
    finally:
        sys.path.remove(str(ROOT / "docs" / "examples"))
    direct = IncrementEnv()
    direct.reset(target=3, answer="7", data_source="test")
    env = EnvProcess(f"tools:{INCREMENT}", {**ROW, "target": 3}, 30)
    try:
        first = env.step("let me count " + call("increment", step=2))
        assert first["observation"] == str(direct.increment(step=2)) == "2"
        assert first["done"] is False and first["reward"] == direct.get_reward() == 0.0
        assert first["counts"] == {"tool_calls": 1, "tool_failures": 0, "tool_call_errors": 0}
        # two calls in one turn: one result each, in order, one observation
        second = env.step(call("increment", step=-1) + call("increment", step=2))
        assert second["observation"] == f"{direct.increment(step=-1)}\n{direct.increment(step=2)}" == "1\n3"
        assert second["reward"] == direct.get_reward() == 1.0  # get_reward's change: the target is reached
        # a turn without a call ends the episode; the sum of the step rewards is get_reward() of the end
        last = env.step("done")
        assert last == {"observation": None, "done": True, "reward": 0.0,
                        "counts": {"tool_calls": 0, "tool_failures": 0, "tool_call_errors": 0}}
        assert first["reward"] + second["reward"] + last["reward"] == direct.get_reward()
    finally:
        env.close()


def test_a_bad_tool_call_is_a_visible_counted_observation_not_a_crash(env_files):
    from megatron_grpo.chat.tool_calls import parse_tool_calls

    env = EnvProcess(f"tools:{env_files}/tool_envs.py:Raises", ROW, 30)
    try:
        malformed = "<tool_call>{name: explode}</tool_call>"
        turn = call("explode", why="no reason") + call("vanish") + call("explode", reason="typo") + malformed
        out = env.step(turn)
    finally:
        env.close()
    # the messages TRL's loop gives the model: str({"error": ...}) per failed call
    (parse_error,) = parse_tool_calls(malformed).errors
    assert out["observation"].split("\n") == [
        "{'error': 'boom: no reason'}",
        "{'error': 'Tool vanish not found.'}",
        "{'error': \"Raises.explode() got an unexpected keyword argument 'reason'\"}",
        str({"error": parse_error})]
    assert out["done"] is False and out["counts"] == {"tool_calls": 3, "tool_failures": 3, "tool_call_errors": 1}
    # the counts are summed into the step's metrics
    sample = Sample(prompt_index=0, sample_index=0, prompt_ids=[1], output_ids=[2], output_logprobs=[-1.0],
                    finish_reason="stop", weight_version="0")
    stats = episode_stats([Episode(sample, 2, 0.0, counts={"tool_calls": 3, "tool_failures": 3}, tool_call_errors=1),
                           Episode(sample, 1, 0.0),
                           Episode(sample, 2, 1.0, counts={"tool_calls": 2, "tool_failures": 0})])
    assert (stats["multi_turn/env/tool_calls"], stats["multi_turn/env/tool_failures"],
            stats["multi_turn/tool_call_errors"]) == (5.0, 3.0, 1.0)


def test_a_reset_that_owns_the_prompt_is_refused_in_one_line(env_files):
    with pytest.raises(EnvContractError, match=r"tool_envs.py:OwnsThePrompt: reset returned a prompt "
                                               r"\('Increment the counter by 3.'\); TRL appends it"):
        EnvProcess(f"tools:{env_files}/tool_envs.py:OwnsThePrompt", ROW, 30)
    with pytest.raises(EnvContractError, match="the class must be constructed with no argument"):
        check_environment(f"tools:{env_files}/tool_envs.py:NeedsAnUrl", 30)


def test_a_tool_class_without_a_tool_is_refused_at_preflight(env_files):
    """Issue 64: a class with no tool method started training, and every call failed at run time
    ("Tool compute not found"). The pre-flight refuses it in one line."""
    with pytest.raises(EnvContractError, match=r"^episodes.environment tools:.*tool_envs.py:NoTools: the class has no "
                                               r"tool: a tool is a public method other than reset and get_reward"):
        check_environment(f"tools:{env_files}/tool_envs.py:NoTools", 30)


# ---- OpenEnv -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def echo_env(tmp_path_factory) -> Path:
    """OpenEnv's own echo environment, generated by ``openenv init`` from the package's template
    (the package ships no ready environment), its app's max_concurrent_envs raised from 1 to 64
    (the documented change: the loop runs several episodes at once)."""
    root = tmp_path_factory.mktemp("openenv")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(openenv_init, "_generate_uv_lock", lambda env_dir: False)  # `uv lock` resolves on the index
        openenv_init.init("echo_env", output_dir=str(root))
    app = root / "echo_env" / "server" / "app.py"
    app.write_text(app.read_text().replace("max_concurrent_envs=1,", "max_concurrent_envs=64,"))
    return root


def echo_spec(root: Path) -> str:
    return f"openenv:{root}/echo_env/server/app.py:app"


def server_pids() -> list[int]:
    """The OpenEnv servers this process's fork server started (children named ``openenv-server``)."""
    parent = fork_server().proc.pid
    children = " ".join(p.read_text() for p in Path(f"/proc/{parent}/task").glob("*/children"))
    return [int(pid) for pid in children.split() if comm(int(pid)) == openenv_adapter.PROCESS_NAME]


def comm(pid: int) -> str | None:
    """Process ``pid``'s name; None when it is gone (or a zombie: a dead process)."""
    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return None
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while comm(pid) is not None:
        assert time.monotonic() < deadline, f"process {pid} still alive"
        time.sleep(0.05)


def test_an_openenv_server_is_started_once_and_answers_as_the_environment_does(echo_env):
    spec = echo_spec(echo_env)
    check_environment(spec, 30)  # the launcher's check: no server
    assert server_pids() == []
    # OpenEnv's server side (~10 s of imports) loads here while the fork server loads it too
    reference = threading.Thread(target=importlib.import_module, args=("openenv.core.env_server.serialization",))
    reference.start()
    check_environment(spec, 30, prepare=True)  # the run's own pre-flight starts it, from the fork server
    (pid,) = server_pids()
    reference.join()
    # the environment itself, called directly: the echo env and OpenEnv's serialization
    sys.path.insert(0, str(echo_env))
    try:
        from echo_env.models import EchoAction
        from echo_env.server.echo_env_environment import EchoEnvironment
        from openenv.core.env_server.serialization import serialize_observation
    finally:
        sys.path.remove(str(echo_env))
    messages = ["3", "what is the answer", ""]
    direct = EchoEnvironment()
    direct.reset()
    expected = []
    for m in messages:
        out = serialize_observation(direct.step(EchoAction(message=m)))
        expected.append({"observation": out["observation"]["echoed_message"], "done": out["done"],
                         "reward": float(out["reward"])})
    envs = [EnvProcess(spec, ROW, 30) for _ in range(3)]  # three sessions at once, one server
    try:
        for env in envs:
            assert [env.step(m) for m in messages] == expected
    finally:
        for env in envs:
            env.close()
    assert (expected[1]["observation"], expected[1]["done"]) == ("what is the answer", False)
    # the template's reward: 0.1 per character (openenv-core 0.3), capped at 1 (openenv 0.10)
    assert expected[1]["reward"] in (pytest.approx(1.8), pytest.approx(1.0))
    assert server_pids() == [pid]


TWO_FIELDS_APP = '''
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class CodeAction(Action):
    code: str
    language: str


class Runs(Environment):
    def reset(self):
        return Observation()

    def step(self, action):
        return Observation()

    @property
    def state(self):
        return State()


app = create_app(Runs, CodeAction, Observation)
'''


def test_an_openenv_app_that_does_not_start_is_one_line(tmp_path):
    broken = tmp_path / "broken_app.py"
    broken.write_text("raise RuntimeError('no database at /data/envs.sqlite')\n")
    with pytest.raises(EnvContractError, match=r"^episodes.environment openenv:.*broken_app.py:app: its server exited "
                                               r"while starting: RuntimeError: no database at /data/envs.sqlite$"):
        check_environment(f"openenv:{broken}:app", 30, prepare=True)
    two_fields = tmp_path / "two_fields_app.py"
    two_fields.write_text(TWO_FIELDS_APP)
    with pytest.raises(EnvContractError, match=r"two_fields_app.py:app: its action has 2 string fields \(code, "
                                               r"language\); a model turn's text can fill an action with exactly one"):
        check_environment(f"openenv:{two_fields}:app", 30, prepare=True)
    with pytest.raises(EnvContractError, match=r"openenv:http://127.0.0.1:9: no OpenEnv server answers: did not "
                                               r"answer http://127.0.0.1:9/health \(URLError"):
        check_environment("openenv:http://127.0.0.1:9", 30, prepare=True)  # the discard port: nothing serves


def test_an_openenv_server_that_dies_is_counted_restarted_and_ends_with_the_run(echo_env):
    spec = echo_spec(echo_env)
    env = EnvProcess(spec, ROW, 30)
    (pid,) = server_pids()
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    with pytest.raises(EnvCallError) as failed:  # the episode in flight: a counted environment error
        env.step("3")
    assert failed.value.kind == "error"
    env.close()
    env = EnvProcess(spec, ROW, 60)  # the next episode: the server is started again
    assert env.step("3")["observation"] == "3"
    env.close()
    (again,) = server_pids()
    assert again != pid  # (the fork server said so on its stderr, in one line)
    # the trainer's process killed by SIGKILL takes its fork server with it: the server follows
    # (its parent-death signal; a trainer that exits closes the fork server's stdin, and the fork
    # server kills the server's group: the training run below shows that one)
    os.kill(fork_server().proc.pid, signal.SIGKILL)
    wait_gone(again)
    shutdown_fork_server()


def test_a_server_that_keeps_dying_stops_the_run_in_one_line(monkeypatch):
    """The restart budget, in the fork server's own bookkeeping: a server found dead after
    MAX_RESTARTS restarts is not started again, and every episode's worker says why."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    target = "/nowhere/app.py:app"
    monkeypatch.setitem(openenv_adapter._servers, target,
                        openenv_adapter.Server("http://127.0.0.1:1", "message", None, pid=dead.pid, started="gone",
                                               restarts=openenv_adapter.MAX_RESTARTS))
    monkeypatch.setattr(openenv_adapter, "_failures", {})
    openenv_adapter.prepare(target, "/nowhere")
    with pytest.raises(ValueError, match=r"^episodes.environment openenv:/nowhere/app.py:app: its server died 4 times; "
                                         r"not restarted again$"):
        openenv_adapter.environment_class(target)


# ---- training runs through `megatron-grpo train` -------------------------------------------------

RUN_OVERRIDES = ("engine.kind=inprocess", "parallel.tp=1", "parallel.world_size=1",
                 "episodes.observation_role=user", "episodes.max_turns=2",
                 "episodes.max_episode_tokens=64", "rollout.prompts_per_step=4",
                 "rollout.num_generations=4", "parallel.global_batch_size=8", "parallel.micro_batch_size=8",
                 "eval.sets=[]", "logging.plot=false", "checkpoint.save_every=0")


def train(demo: Path, run_dir: Path, environment: str) -> tuple[list[dict], str]:
    out = subprocess.run(train_cmd(demo, run_dir, 2, "episodes.kind=environment", f"episodes.source={environment}",
                                   *RUN_OVERRIDES),
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["multi_turn/env_errors"] == 0 and r["multi_turn/env_timeouts"] == 0
        assert r["multi_turn/observations_refused"] == 0 and r["multi_turn/turns_mean"] == 2
    return rows, out.stderr


@pytest.mark.slow
def test_train_two_steps_with_a_skyrl_gym_env(demo, env_files, tmp_path):
    for r in train(demo, tmp_path / "run", f"skyrl_gym:{env_files}/skyrl_envs.py:AskAgain")[0]:
        # "<|user|> please reply with only a number <|assistant|>" (+ <eos> after a cut turn) between the 1-token turns
        assert 8 <= r["multi_turn/observation_tokens_mean"] <= 9 and r["multi_turn/model_tokens_mean"] == 2
        assert 0.0 <= r["multi_turn/env_reward_mean"] <= 1.0


@pytest.mark.slow
def test_train_two_steps_with_an_openenv_env_whose_server_ends_with_the_run(demo, echo_env, tmp_path):
    rows, stderr = train(demo, tmp_path / "run", echo_spec(echo_env))
    for r in rows:
        # the echo env echoes each 1-token turn (a number: 0.1 per character, at most 1 a step)
        assert 0.2 <= r["multi_turn/env_reward_mean"] <= 0.4 + 1e-6 and r["multi_turn/model_tokens_mean"] == 2
    # the launcher's pre-flight starts one and stops it (before the run directory), then the run's own
    pids = [int(m) for m in re.findall(r"its server \(pid (\d+)\) serves on http://127.0.0.1:\d+", stderr)]
    assert len(pids) == 2
    for pid in pids:
        assert comm(pid) != openenv_adapter.PROCESS_NAME  # gone with the run (its pid free, or another process's)


def test_the_episode_loop_hands_a_tool_class_the_runs_tool_call_format(env_files):
    """episodes.tool_call_format reaches the tools connector: the demo vocabulary's `compute 3 + 4`
    is a call of the class's compute method (the default hermes format would see no call)."""
    from megatron_grpo.data.prompts import Prompt, render_prompt
    from tools.tiny import build_tokenizer
    from megatron_grpo.rollout.episodes.environment.loop import EpisodeRunner

    tok = build_tokenizer()

    class Scripted:
        def __init__(self):
            self.replies = [tok("compute 3 + 4 <eos>", add_special_tokens=False)["input_ids"],
                            tok("7 <eos>", add_special_tokens=False)["input_ids"]]

        def generate(self, prompts, n, sampling, *, sampling_seed=None, **kw):
            out = self.replies.pop(0)
            return [Sample(prompt_index=0, sample_index=0, prompt_ids=list(prompts[0]), output_ids=out,
                           output_logprobs=[-0.5] * len(out), finish_reason="stop", weight_version="1")]

    text, ids = render_prompt("what is 3 plus 4", tok, use_template=True, system_prompt=None, where="t")
    prompt = Prompt(index=0, where="t", text=text, prompt_ids=ids, answer="7")
    for fmt, turns, reward in [("compute", 2, 1.0), ("hermes", 1, 0.0)]:
        cfg = EpisodesConfig(kind="environment", source=f"tools:{env_files}/tool_envs.py:Calculator",
                             observation_role="user", max_turns=2, max_episode_tokens=32, tool_call_format=fmt)
        runner = EpisodeRunner.build(cfg, tok, max_inflight=1, use_template=True)
        (episode,) = runner(Scripted(), [prompt], 1, SamplingParams(max_new_tokens=8), 0)
        assert (episode.num_turns, episode.env_reward, episode.error) == (turns, reward, None), fmt
        if fmt == "compute":
            assert "result 7" in tok.decode(episode.sample.output_ids)


@pytest.mark.slow
@pytest.mark.parametrize("app, line", [
    ("broken", "its server exited while starting: RuntimeError: no database at /data/envs.sqlite"),
    ("unreachable", "no OpenEnv server answers"),
])
def test_an_openenv_server_that_cannot_start_is_refused_before_the_run_dir_is_written(demo, tmp_path, app, line):
    """Issue 64: an app that raises on import, or a URL where nothing serves, was refused in one
    line, but by the run's own pre-flight, after the run directory was written (.lock,
    config.yaml, metrics.jsonl, debug/). The launcher's pre-flight starts the server now."""
    broken = tmp_path / "broken_app.py"
    broken.write_text("raise RuntimeError('no database at /data/envs.sqlite')\n")
    spec = f"openenv:{broken}:app" if app == "broken" else "openenv:http://127.0.0.1:9"
    run_dir = tmp_path / "run"
    out = subprocess.run(train_cmd(demo, run_dir, 2, "episodes.kind=environment", f"episodes.source={spec}",
                                   *RUN_OVERRIDES), cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)
    assert out.returncode == 2 and line in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr[-3000:]
    assert not run_dir.exists() or not any(run_dir.iterdir()), sorted(run_dir.iterdir())


OPENENV_VENV = Path(os.environ.get("MEGATRON_GRPO_OPENENV_VENV")
                    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron-grpo" / "openenv-0.10")


@pytest.mark.slow
def test_the_openenv_connector_trains_against_openenv_0_10():
    """Issue 64: OpenEnv's current release, ``openenv`` 0.10, cannot share an environment with
    verifiers 0.4 (mcp pins), so this process has openenv-core 0.3. The OpenEnv tests above (the
    server started once, its death counted, two training steps, the refusals) run again in
    ``launch/setup_openenv_venv.sh``'s environment, which .ci/run builds, with 0.10."""
    python = OPENENV_VENV / "bin" / "python"
    if not (OPENENV_VENV / ".complete").is_file():
        if os.environ.get("MEGATRON_GRPO_REQUIRE_OPENENV"):  # set by .ci/run, which builds it
            pytest.fail(f"MEGATRON_GRPO_REQUIRE_OPENENV is set but {OPENENV_VENV} is not built")
        pytest.skip("no openenv 0.10 environment: bash launch/setup_openenv_venv.sh")
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('openenv'))"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    assert version.startswith("0.10"), version
    proc = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "tests/test_env_connectors.py", "-k", "openenv and not against"],
                          cwd=ROOT, env={**ENV, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=1200)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 5 and "skipped" not in proc.stdout, tail
