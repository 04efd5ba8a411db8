"""Classic verifiers environments (verifiers < 0.4) as agents (``episodes.agent:
verifiers:env.py:load_environment``; docs/agents.md, "verifiers environments"): the real
``verifiers`` library (the ``agents`` extra; its absence fails these tests, a 0.4 release skips
them: it has only ``verifiers.v1``, trained by tests/test_agents_verifiers.py), environments
built on local datasets, rolled out by their own turn loop through the run's front on the in-process engine (tiny model).

References: verifiers itself (the environment's rubric scores the completion the test rebuilds
from the episode's tokens, in this process), the engine's calls (every trained token is one
call's output, every other token masked), and the chat template (the first prompt is the
environment's prompt messages, with its tools, rendered by it).
"""

import asyncio
import importlib.util
import json

import openai
import pytest
import verifiers as vf  # the agents extra: a missing library fails here, it is never skipped

if not hasattr(vf, "Environment"):  # 0.4 on: verifiers.v1 only (tests/test_agents_verifiers.py)
    pytest.skip(f"verifiers {vf.__version__} has not the classic API (verifiers < 0.4); the agents extra installs the "
                "current release, whose tasksets tests/test_agents_verifiers.py trains", allow_module_level=True)

from verifiers.clients import OpenAIChatCompletionsClient  # noqa: E402 (after the version's check)
from verifiers.utils.message_utils import normalize_messages

from megatron_grpo.chat.openai_api import render_chat
from megatron_grpo.chat.tool_calls import parse_tool_calls
from megatron_grpo.data.prompts import Prompt, render_prompt
from tools.tiny import build_tokenizer
from megatron_grpo.config.base import ConfigError
from megatron_grpo.rollout.episodes.agent.connectors import load_agent
from megatron_grpo.rollout.episodes.agent.connectors.verifiers_env import EnvRows, question_messages, rollout_input
from megatron_grpo.rollout.episodes.agent.runner import AgentRunner, resolve_spec
from megatron_grpo.rollout.episodes.episode import episode_stats
from megatron_grpo.rollout.episodes.turns import TurnRenderer
from megatron_grpo.wire.samples import Sample, SamplingParams
from tests.support.agent_spans import Recorder, check_tokens, texts

ENVS = r'''
import verifiers as vf
from datasets import Dataset

from megatron_grpo.rollout.episodes.environment.builtin import evaluate, format_number

QUESTIONS = [("what is 3 plus 4", "7"), ("what is 9 plus 9", "18"), ("what is 2 times 3", "6")]


def dataset():
    return Dataset.from_list([{"question": q, "answer": a} for q, a in QUESTIONS])


def correct(parser, completion, answer) -> float:
    words = (parser.parse_answer(completion) or "").split()
    return float(bool(words) and words[-1] == answer)


def words(parser, completion) -> float:
    return float(len((parser.parse_answer(completion) or "").split()))


def checked(info) -> float:
    if info.get("boom"):
        raise ZeroDivisionError("the rubric's own bug")
    return 1.0


def single():
    rubric = vf.Rubric(funcs=[correct, words, checked], weights=[1.0, 0.25, 0.5])
    return vf.SingleTurnEnv(dataset=dataset(), rubric=rubric)


def feedback(text, answer):
    """The guessing game's answer to a guess (the last word of the model's message)."""
    guess = (text or "").split()[-1:]
    if not guess or not guess[0].isdigit():
        return "please reply with only a number"
    # the tiny model's vocabulary has no "higher" or "lower"
    return "result" if guess[0] == answer else ("add" if int(guess[0]) < int(answer) else "subtract")


class GuessEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content=feedback(messages[-1].content, state["answer"]))]


def guess():
    return GuessEnv(dataset=dataset(), rubric=vf.Rubric(funcs=[correct, words], weights=[1.0, 0.5]), max_turns=3)


def compute(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. 3 plus 4
    """
    if expression.replace(" ", "").endswith("/0"):
        raise ZeroDivisionError("the tool's own failure")  # one of the env's stop_errors
    try:
        return f"result {format_number(evaluate(expression))}"
    except ValueError:
        return "result ?"


def tools():
    return vf.ToolEnv(dataset=dataset(), system_prompt="compute the answer", tools=[compute],
                      rubric=vf.Rubric(funcs=[correct]), max_turns=3, stop_errors=[ZeroDivisionError])


def not_an_env():
    return 42
'''


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def envs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vf") / "envs.py"
    path.write_text(ENVS)
    return path


@pytest.fixture(scope="module")
def envs(envs_file):
    """The same file, loaded in this process: the reference environments."""
    spec = importlib.util.spec_from_file_location("vf_test_envs", envs_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engine(inprocess_engine):
    return inprocess_engine  # tests/conftest.py: a tiny Qwen2 in this process


SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=[3])  # 3: <eos>


def make_prompt(tok, index, text, answer, **fields):
    rendered, prompt_ids = render_prompt(text, tok, use_template=True, system_prompt=None, where="test")
    return Prompt(index=index, where="test", text=rendered, prompt_ids=prompt_ids, answer=answer, fields=fields)


def agent_runner(tok, envs_file, fn):
    """One worker: the library's import and the environment's construction, once per runner."""
    return AgentRunner(f"verifiers:{envs_file}:{fn}", tok, TurnRenderer(tok, "user"), max_turns=2,
                       max_episode_tokens=48, timeout_s=60.0, workers=1, tool_call_format="compute")


def roll_out(tok, envs_file, engine, fn, prompts, n, seed):
    runner = agent_runner(tok, envs_file, fn)
    try:
        recorder = Recorder(engine)
        return runner(recorder, prompts, n, SAMPLING, seed), recorder.calls
    finally:
        runner.close()


class Scripted:
    """A RolloutEngine stand-in answering each call with the next reply (text), log-prob -0.5
    per token: a tool call that the random tiny model would not write."""

    def __init__(self, tok, replies):
        self.replies = [tok(r, add_special_tokens=False)["input_ids"] for r in replies]

    def generate(self, prompts, n, sampling, *, sampling_seed=None, **kw):
        out = self.replies.pop(0)
        return [Sample(prompt_index=0, sample_index=0, prompt_ids=list(prompts[0]), output_ids=out,
                       output_logprobs=[-0.5] * len(out), finish_reason="stop", weight_version="1")]


def reference_score(env, row, completion, turns):
    """The environment's rubric on ``completion`` (verifiers' own state and scoring, this process)."""
    async def score():
        client = OpenAIChatCompletionsClient(openai.AsyncOpenAI(api_key="unused", base_url="http://127.0.0.1:9"))
        state = await env.init_state(row, client, "policy")
        state["completion"] = normalize_messages(completion)
        state["trajectory"] = [{}] * turns  # the rubrics read its length only (num_turns)
        await env.rubric.score_rollout(state)
        return {"reward": state["reward"], **state["metrics"]}

    return asyncio.run(score())


def check_scores(episodes, expected):
    for e, want in zip(episodes, expected, strict=True):
        assert e.error is None
        assert e.env_reward == pytest.approx(want.pop("reward"))
        assert e.metrics == pytest.approx(want)


def test_single_turn_env(tok, envs_file, envs, engine, capfd):
    questions = envs.QUESTIONS[:2]
    prompts = [make_prompt(tok, i, q, a, question=q) for i, (q, a) in enumerate(questions)]
    prompts.append(make_prompt(tok, 2, *envs.QUESTIONS[2], question=envs.QUESTIONS[2][0], info={"boom": True}))
    episodes, calls = roll_out(tok, envs_file, engine, "single", prompts, 3, seed=5)
    check_tokens(episodes, calls)
    env = envs.single()
    ok, expected = episodes[:6], []
    for k, e in enumerate(ok):
        q, a = questions[k // 3]
        # the first prompt is the env's prompt messages rendered by the chat template
        assert e.sample.prompt_ids == render_chat(tok, [{"role": "user", "content": q}])
        assert e.num_turns == 1 and e.sample.output_mask == [1] * len(e.sample.output_ids)
        (text,) = texts(tok, e.sample)
        expected.append(reference_score(env, {"prompt": [{"role": "user", "content": q}], "answer": a,
                                              "info": {}, "example_id": 0},
                                         [{"role": "assistant", "content": text}], 1))
    check_scores(ok, expected)
    # the rubric raised (verifiers would log it and score 0): each episode is a counted error,
    # printed once with the site in the user's file; its turns are kept, scored by on_env_error
    assert [e.error for e in episodes[6:]] == ["error"] * 3
    assert all(e.sample.output_ids for e in episodes[6:])
    err = capfd.readouterr().err
    assert err.count("episodes.agent error at") == 1 and "reward function checked raised ZeroDivisionError" in err
    assert f"{envs_file}:" in err
    assert episode_stats(episodes)["agent/words_mean"] >= 0.0


def test_multi_turn_env(tok, envs_file, envs, engine):
    """The guessing game (env_response between turns): the env's max_turns is 3, the run's 2, so
    each episode's third call is refused and ends it as truncated, not as an error."""
    prompts = [make_prompt(tok, i, q, a, question=q) for i, (q, a) in enumerate(envs.QUESTIONS[:2])]
    episodes, calls = roll_out(tok, envs_file, engine, "guess", prompts, 2, seed=7)
    check_tokens(episodes, calls)
    env, expected = envs.guess(), []
    for k, e in enumerate(episodes):
        q, a = envs.QUESTIONS[k // 2]
        first, second = texts(tok, e.sample)
        assert e.num_turns == 2
        completion = [{"role": "assistant", "content": first}, {"role": "user", "content": envs.feedback(first, a)},
                      {"role": "assistant", "content": second}]
        expected.append(reference_score(env, {"prompt": [{"role": "user", "content": q}], "answer": a,
                                              "info": {}, "example_id": 0}, completion, 2))
        assert expected[-1]["num_turns"] == 2.0
    check_scores(episodes, expected)


def test_tool_env(tok, envs_file, envs, engine, capfd):
    """A ToolEnv whose tool is a python function: the model's calls in the demo's `compute`
    format reach verifiers as OpenAI tool calls, the tool's results come back as tool messages.
    The rows carry only an example_id: the prompt is the env's own dataset row (with its
    system prompt)."""
    env = envs.tools()
    rows = env.get_dataset().to_list()
    prompts = [make_prompt(tok, i, r["question"], r["answer"], example_id=r["example_id"]) for i, r in enumerate(rows)]
    tool_defs = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.parameters}} for t in env.tool_defs]
    runner = agent_runner(tok, envs_file, "tools")
    try:
        recorder = Recorder(engine)
        episodes = runner(recorder, prompts, 3, SAMPLING, 3)
        # a scripted call and answer: the whole tool round trip, token for token
        (scripted,) = runner(Scripted(tok, ["compute 3 + 4 <eos>", "7 <eos>"]), prompts[:1], 1, SAMPLING, 3)
        # a tool failure the env stops on (stop_errors): verifiers ends the rollout with
        # state["error"]; the episode fails (counted, its site printed once), its turn kept
        (stopped,) = runner(Scripted(tok, ["compute 1 / 0 <eos>"]), prompts[:1], 1, SAMPLING, 3)
    finally:
        runner.close()
    assert stopped.error == "error" and stopped.sample.output_ids == tok("compute 1 / 0 <eos>",
                                                                          add_special_tokens=False)["input_ids"]
    err = capfd.readouterr().err
    assert err.count("episodes.agent error at") == 1 and "the rollout ended in ToolCallError" in err
    assert f"{envs_file}:" in err and "the tool's own failure" in err
    check_tokens(episodes, recorder.calls)
    assert scripted.sample.output_ids == tok("compute 3 + 4 <eos> <|user|> result 7 <|assistant|> 7 <eos>",
                                             add_special_tokens=False)["input_ids"]
    assert scripted.sample.output_mask == [1] * 5 + [0] * 4 + [1] * 2
    assert (scripted.error, scripted.env_reward, scripted.num_turns) == (None, 1.0, 2)
    assert scripted.metrics == {"correct": 1.0, "num_turns": 2.0, "total_tool_calls": 1.0, "compute_calls": 1.0}
    # seed 3: the tiny model writes one `compute` call of its own
    assert sum(e.metrics["total_tool_calls"] for e in episodes) >= 1
    expected = []
    for e, row in zip([*episodes, scripted], [rows[k // 3] for k in range(len(episodes))] + rows[:1], strict=True):
        assert e.sample.prompt_ids == render_chat(tok, row["prompt"], tool_defs)
        completion, model_texts = [], texts(tok, e.sample)
        for i, text in enumerate(model_texts):
            turn = parse_tool_calls(text, "compute", id_prefix=f"call_{i + 1}")
            calls_i = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                       for c in turn.tool_calls]
            completion.append({"role": "assistant", "content": turn.content if calls_i else text,
                               **({"tool_calls": calls_i} if calls_i else {})})
            if i + 1 < len(model_texts):  # the tool's answers, before the next turn
                completion += [{"role": "tool", "tool_call_id": c["id"],
                                "content": envs.compute(json.loads(c["arguments"])["expression"])} for c in calls_i]
        expected.append(reference_score(env, {**row, "info": {}}, completion, e.num_turns))
    check_scores([*episodes, scripted], expected)


def test_specs_and_load_errors(envs_file, envs, tmp_path, monkeypatch):
    monkeypatch.chdir(envs_file.parent)
    assert resolve_spec("verifiers:envs.py:single") == f"verifiers:{envs_file}:single"
    assert resolve_spec(f"{envs_file}:single") == f"{envs_file}:single"  # no prefix: the user's agent function
    with pytest.raises(ConfigError, match="connectors: verifiers"):
        resolve_spec("verifiers:envs:single")
    with pytest.raises(ConfigError, match="not found"):
        resolve_spec(f"verifiers:{tmp_path}/missing.py:load_environment")
    # the worker's load, here (the library is imported already): a file that returns no
    # Environment is a one-line ConfigError before any episode
    with pytest.raises(ConfigError, match=r"not_an_env returned int, not a verifiers Environment"):
        load_agent(f"verifiers:{envs_file}:not_an_env", "episodes.agent")
    fn, where = load_agent(f"verifiers:{envs_file}:single", "episodes.agent")
    assert asyncio.iscoroutinefunction(fn) and where == str(envs_file)
    assert issubclass(vf.ToolEnv, vf.MultiTurnEnv)  # the classic API the connector drives (docs/agents.md)


def test_rollout_input_from_a_row(envs):
    env = envs.tools()
    own = env.get_dataset()[1]
    rows = EnvRows(env)
    # a question, formatted as verifiers formats its dataset's question column
    assert question_messages(env, own["question"]) == own["prompt"]
    got = rollout_input(env, rows, {"example_id": 1, "prompt": "<rendered>", "answer": "18", "info": {"k": 1}})
    assert got == {**own, "info": {"k": 1}}
    other = rollout_input(env, rows, {"example_id": 1, "question": "what is 1 plus 1", "prompt": "<rendered>",
                                      "answer": "2"})
    assert other["prompt"] == [{"role": "system", "content": "compute the answer"},
                               {"role": "user", "content": "what is 1 plus 1"}] and other["answer"] == "2"
    # neither: the run's own prompt messages (Prompt.messages)
    mine = [{"role": "user", "content": "what is 5 plus 5"}]
    got = rollout_input(env, rows, {"prompt": "<rendered>", "answer": "10", "messages": mine})
    assert got["prompt"] == mine and "messages" not in got and got["answer"] == "10"
    with pytest.raises(ValueError, match="no 'question' field"):
        rollout_input(env, rows, {"prompt": "<rendered>", "answer": "2", "messages": None})
