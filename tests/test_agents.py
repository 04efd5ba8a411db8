"""Agents written against the OpenAI SDK (episodes.agent; docs/agents.md): the real `openai`
client in a worker process, the run's loopback front, and the engine's exact tokens.

References: the built-in environment loop (EpisodeRunner) on the same real engine with the same
seeds (an SDK agent that asks what the environment would answer must give the same tokens,
log-probs and rewards), the tokenizer's own chat template, and hand-built token sequences.
"""

import json
import os
import socket
import time
from pathlib import Path

import openai
import pytest

from megatron_grpo.config.base import ConfigError, ConfigValueError
from megatron_grpo.config.episodes import EpisodesConfig
from megatron_grpo.data.prompts import Prompt, prompt_messages, render_prompt
from tests.support.fork_workers import live_workers
from tools.tiny import build_tokenizer
from megatron_grpo.rollout.episodes.agent.front import MAX_BODY_BYTES, AgentFront, EpisodeLog, same_message
from megatron_grpo.rollout.episodes.agent.runner import AgentContractError, AgentProcess, AgentRunner
from megatron_grpo.rollout.episodes.agent.trajectory import NotAnExtension, sample_from_calls
from megatron_grpo.rollout.episodes.hang_guard import EpisodesHung
from megatron_grpo.rollout.episodes.environment.loop import EpisodeRunner
from megatron_grpo.rollout.episodes.episode import episode_stats
from megatron_grpo.rollout.episodes.turns import TurnRenderer
from megatron_grpo.wire.samples import Sample, SamplingParams
from tests.support.demo_run import NUDGE

# The built-in loop's environment (tests/support/demo_run.py's NUDGE: turn 1 is always followed
# by a nudge, so every episode has two model turns; turn 2's last word is graded) and the same
# task as SDK agents.

AGENTS = r'''
import asyncio, json, os, time

def _grade(text, answer):
    words = (text or "").split()
    return float(bool(words) and words[-1] == answer)

def nudge(client, row):
    messages = list(row["messages"])
    first = client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "please reply with only a number"}]
    second = client.chat.completions.create(model="policy", messages=messages)
    return {"reward": _grade(second.choices[0].message.content, row["answer"]), "calls": 2}

async def nudge_async(client, row):
    messages = [{"role": "user", "content": row["prompt_text"]}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message, {"role": "user", "content": "please reply with only a number"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return _grade(second.choices[0].message.content, row["answer"])

TOOLS = [{"type": "function", "function": {"name": "compute", "description": "arithmetic",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]

def calculator(client, row):
    """The built-in calculator, as an SDK agent with tools=: a call gets its result, an answer ends."""
    from megatron_grpo.rollout.episodes.environment.builtin import evaluate, format_number
    import re
    messages = [{"role": "user", "content": row["prompt_text"]}]
    for turn in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            numbers = re.findall(r"-?\d+(?:\.\d+)?", message.content or "")
            return float(bool(numbers) and float(numbers[-1]) == float(row["answer"]))
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                value = format_number(evaluate(json.loads(call.function.arguments)["expression"]))
            except ValueError:
                value = "?"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {value}"})
    return 0.0

def raises(client, row):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "what"}])
    raise RuntimeError("the agent's own bug")

def hangs(client, row):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "what"}])
    time.sleep(600)

def rewrites_history(client, row):
    messages = [{"role": "user", "content": row["prompt_text"]}]
    first = client.chat.completions.create(model="policy", messages=messages)
    messages = [{"role": "user", "content": "what is 1 plus 1"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "please reply with only a number"}]
    client.chat.completions.create(model="policy", messages=messages)
    return 1.0

def no_calls(client, row):
    return 1.0

def bad_result(client, row):
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "what"}])
    return "yes"

def bad_request(client, row):
    try:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "what"}], n=2)
    except Exception as e:
        return {"reward": 0.0, "refused": float(type(e).__name__ == "BadRequestError")}
    return {"reward": 0.0, "refused": 0.0}
'''


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("agents")
    (d / "envs.py").write_text(NUDGE)
    (d / "agents.py").write_text(AGENTS)
    return d


@pytest.fixture(scope="module")
def engine(inprocess_engine):
    return inprocess_engine  # tests/conftest.py: a tiny Qwen2 in this process


def make_prompt(tok, index=0, question="what is 3 plus 4", answer="7"):
    text, prompt_ids = render_prompt(question, tok, use_template=True, system_prompt=None, where="test")
    return Prompt(index=index, where="test", text=text, prompt_ids=prompt_ids, answer=answer,
                  fields={"prompt_text": question}, messages=prompt_messages(question, None))


ROOT = Path(__file__).resolve().parents[1]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=[3])  # 3: <eos>
MAX_TURNS, BUDGET = 2, 32
FRONT_SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=[3])


def agent_runner(tok, files, fn, **kw):
    settings = dict(max_turns=MAX_TURNS, max_episode_tokens=BUDGET, timeout_s=20.0, workers=2,
                    tool_call_format="compute") | kw
    return AgentRunner(f"{files}/agents.py:{fn}", tok, TurnRenderer(tok, "user"), **settings)


def builtin_runner(tok, spec):
    cfg = EpisodesConfig(kind="environment", source=spec, observation_role="user", max_turns=MAX_TURNS,
                         max_episode_tokens=BUDGET, timeout_s=20.0)
    return EpisodeRunner.build(cfg, tok, max_inflight=2, use_template=True)


def same_episodes(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.sample.prompt_ids == y.sample.prompt_ids
        assert x.sample.output_ids == y.sample.output_ids
        assert x.sample.output_mask == y.sample.output_mask
        assert x.sample.output_logprobs == pytest.approx(y.sample.output_logprobs, abs=1e-6)
        assert (x.num_turns, x.env_reward, x.error) == (y.num_turns, y.env_reward, y.error)


@pytest.mark.parametrize("fn", ["nudge", "nudge_async"])
def test_an_sdk_agent_gives_the_builtin_loops_tokens_and_rewards(tok, files, engine, fn):
    """Same engine, same seeds: the OpenAI-SDK agent's episodes are the environment loop's,
    token for token (prompt, model turns, the nudge between them, masks, log-probs, rewards)."""
    prompts = [make_prompt(tok, 0), make_prompt(tok, 1, "what is 9 plus 9", "18")]
    builtin = builtin_runner(tok, f"{files}/envs.py:Nudge")(engine, prompts, 3, SAMPLING, 1234)
    runner = agent_runner(tok, files, fn)
    try:
        agent = runner(engine, prompts, 3, SAMPLING, 1234)
    finally:
        runner.close()
    assert all(e.num_turns == 2 for e in builtin)
    same_episodes(agent, builtin)
    if fn == "nudge":
        assert episode_stats(agent)["agent/calls_mean"] == 2.0


def test_an_sdk_agent_with_tools_is_the_builtin_calculator(tok, files, engine):
    """tools= through the model's own call format (the demo's `compute`): same tokens as the
    built-in calculator environment on the same seeds, for the test's sync agent and the
    documented example (examples/agents/calculator_sdk.py, async)."""
    prompts = [make_prompt(tok, i, f"what is {i} plus 5", str(i + 5)) for i in range(4)]
    builtin = builtin_runner(tok, "calculator")(engine, prompts, 4, SAMPLING, 99)
    for spec in (f"{files}/agents.py:calculator", f"{ROOT}/examples/agents/calculator_sdk.py:run"):  # sync, async
        runner = AgentRunner(spec, tok, TurnRenderer(tok, "user"), max_turns=MAX_TURNS, max_episode_tokens=BUDGET,
                             timeout_s=20.0, workers=2, tool_call_format="compute")
        try:
            agent = runner(engine, prompts, 4, SAMPLING, 99)
        finally:
            runner.close()
        same_episodes(agent, builtin)


class Scripted:
    """A RolloutEngine stand-in that answers each call with the next reply (ids), log-prob -0.5
    per token: for replies a random tiny model would not sample (a tool call, a token sequence
    that re-tokenizes differently)."""

    def __init__(self, replies):
        self.replies, self.prompts = list(replies), []

    def generate(self, prompts, n, sampling, *, sampling_seed=None, **kw):
        self.prompts.append(list(prompts[0]))
        out = self.replies.pop(0)[: sampling.max_new_tokens]
        return [Sample(prompt_index=0, sample_index=0, prompt_ids=list(prompts[0]), output_ids=list(out),
                       output_logprobs=[-0.5] * len(out), finish_reason="stop", weight_version="7")]


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def front(tok):
    f = AgentFront(tok, TurnRenderer(tok, "user"), tool_call_format="compute").start()
    yield f
    f.close()


def open_episode(front, engine, **kw):
    front.open_episode("ep", EpisodeLog(engine=engine, sampling=FRONT_SAMPLING, seed=5, **({"max_calls": 4,
                                                                                       "max_tokens": 64} | kw)))
    return openai.OpenAI(base_url=front.base_url("ep"), api_key=front.api_key, max_retries=0)


def test_the_front_answers_tool_calls_with_token_ids_and_logprobs(tok, front):
    engine = Scripted([ids(tok, "compute 3 + 4 <eos>"), ids(tok, "7 <eos>")])
    client = open_episode(front, engine)
    tools = [{"type": "function", "function": {"name": "compute", "parameters": {}}}]
    messages = [{"role": "user", "content": "what is 3 plus 4"}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=tools, logprobs=True)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "compute"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"expression": "3 + 4"}
    assert first.prompt_token_ids == engine.prompts[0] == ids(tok, tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True))
    assert choice.token_ids == ids(tok, "compute 3 + 4 <eos>")
    assert [t.logprob for t in choice.logprobs.content] == [-0.5] * 5
    assert first.usage.prompt_tokens == len(first.prompt_token_ids) and first.usage.completion_tokens == 5
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "result 7"}]
    second = client.chat.completions.create(model="policy", messages=messages, tools=tools)
    assert second.choices[0].message.content == "7" and second.choices[0].finish_reason == "stop"
    # the exact episode: prompt, the sampled call, the tool turn (delta render), the answer
    assert engine.prompts[1] == engine.prompts[0] + ids(tok, "compute 3 + 4 <eos> <|user|> result 7 <|assistant|>")
    log = front.close_episode("ep")
    sample = sample_from_calls([(c.prompt_ids, c.sample) for c in log.calls], prompt_index=0, sample_index=0,
                               with_kept=False)
    assert sample.output_ids == ids(tok, "compute 3 + 4 <eos> <|user|> result 7 <|assistant|> 7 <eos>")
    assert sample.output_mask == [1] * 5 + [0] * 4 + [1] * 2
    assert log.error is None and log.tool_call_errors == 0


def test_exact_tokens_when_re_tokenizing_the_history_would_differ(tok, front):
    """The model sampled a special token inside its answer; the SDK's message holds the decoded
    text without it, so re-rendering the history would give other ids than those sampled. The
    front keeps the sampled ids (the previous prompt + the engine's output + the new turn)."""
    sampled = ids(tok, "7 <|user|> 8 <eos>")
    engine = Scripted([sampled, ids(tok, "7 <eos>")])
    client = open_episode(front, engine)
    messages = [{"role": "user", "content": "what is 3 plus 4"}]
    first = client.chat.completions.create(model="policy", messages=messages)
    assert first.choices[0].message.content == "7 8"
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "result 7"}]
    client.chat.completions.create(model="policy", messages=messages)
    exact = engine.prompts[0] + sampled + ids(tok, "<|user|> result 7 <|assistant|>")
    naive = ids(tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert engine.prompts[1] == exact
    assert naive != exact and naive[:len(engine.prompts[0])] == engine.prompts[0]
    assert front.close_episode("ep").error is None


def test_a_conversation_that_does_not_continue_the_episode_is_refused(tok, front):
    engine = Scripted([ids(tok, "5 <eos>"), ids(tok, "6 <eos>")])
    client = open_episode(front, engine)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "what is 2 plus 3"}])
    again = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "what is 1 plus 1"}])
    assert again.choices[0].finish_reason == "length" and again.choices[0].token_ids == []
    log = front.close_episode("ep")
    assert log.error == "diverged" and len(log.calls) == 1 and "does not continue" in log.error_message


def test_budget_and_turn_limits_answer_length_without_recording(tok, front):
    engine = Scripted([ids(tok, "1 2 3 4"), ids(tok, "5")])
    client = open_episode(front, engine, max_calls=1)
    messages = [{"role": "user", "content": "what"}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    assert first.choices[0].token_ids == ids(tok, "1 2")  # max_tokens honoured
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    second = client.chat.completions.create(model="policy", messages=messages)
    assert second.choices[0].finish_reason == "length" and second.choices[0].message.content == ""
    log = front.close_episode("ep")
    assert len(log.calls) == 1 and log.refused_calls == 1


def test_requests_are_checked_and_authenticated(tok, front):
    engine = Scripted([ids(tok, "5 <eos>")])
    client = open_episode(front, engine)
    msgs = [{"role": "user", "content": "what"}]
    for kwargs, param in [({"n": 2}, "n"), ({"stream": True}, "stream"), ({"tool_choice": "required"}, "tool_choice"),
                          ({"stop": ["what is"]}, "stop"), ({"top_logprobs": 3}, "top_logprobs"),
                          ({"temperature": float("nan")}, None)]:
        with pytest.raises((openai.BadRequestError, ValueError)) as e:
            client.chat.completions.create(model="policy", messages=msgs, **kwargs)
        if param is not None:
            assert param in str(e.value)
    bad = openai.OpenAI(base_url=front.base_url("ep"), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="policy", messages=msgs)
    other = openai.OpenAI(base_url=front.base_url("nope"), api_key=front.api_key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.create(model="policy", messages=msgs)
    assert [m.id for m in client.models.list()] == ["policy"]
    assert front.close_episode("ep").calls == []


def test_the_front_refuses_in_one_line_of_openais_shape(tok):
    """The front's guards are the engine server's (runtime/http_guard.py): a wrong key is a 401,
    a body past MAX_BODY_BYTES a 413 (by its Content-Length, before a byte of it is read), a body
    that is not JSON or holds NaN a 400; each one line in OpenAI's error shape, naming the setting."""
    import httpx

    front = AgentFront(tok, TurnRenderer(tok, "user"), tool_call_format="compute").start()
    try:
        url = f"http://127.0.0.1:{front.port}/episodes/ep/v1/chat/completions"
        key = {"Authorization": f"Bearer {front.api_key}", "Content-Type": "application/json"}
        cases = [({"Authorization": "Bearer wrong"}, b"{}", 401, "authentication_error", "invalid API key"),
                 (key, b" " * (MAX_BODY_BYTES + 1), 413, "invalid_request_error",
                  f"exceeds this server's limit of {MAX_BODY_BYTES} bytes (MAX_BODY_BYTES)"),
                 (key, b"{not json", 400, "invalid_request_error", "the request body must be JSON"),
                 (key, b'{"temperature": NaN}', 400, "invalid_request_error", "holds NaN")]
        with httpx.Client(timeout=30) as client:
            for headers, body, status, kind, said in cases:
                answer = client.post(url, headers=headers, content=body)
                error = answer.json()["error"]
                assert (answer.status_code, error["type"], error["code"]) == (status, kind, status), answer.text
                assert said in error["message"] and "\n" not in error["message"], error
    finally:
        front.close()


def test_a_stalled_sender_gets_a_408_and_the_front_serves_on(tok):
    """Issue 48: the agent front (uvicorn, in the run's process) held a connection that sent half
    its headers, or its headers and half its body, for good: a hostile or broken agent could
    tie up its sockets and threads. Now each must arrive within the front's read deadline (1 s
    here); then a 408 in OpenAI's error shape, the connection closed, and the front answers on."""
    front = AgentFront(tok, TurnRenderer(tok, "user"), tool_call_format="compute", read_timeout_s=1.0).start()
    try:
        head = (f"POST /episodes/ep/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {front.api_key}\r\nContent-Type: application/json\r\n").encode()
        stalled = []
        for first, said in [(head[:40], b"headers"), (b"", b"headers"),
                            (head + b"Content-Length: 100\r\n\r\n{\"model\": ", b"body")]:
            s = socket.create_connection(("127.0.0.1", front.port), timeout=15)
            s.sendall(first)
            stalled.append((s, said))
        start = time.monotonic()
        for s, said in stalled:
            with s:
                answer = b""
                while chunk := s.recv(4096):  # until the front closes the connection
                    answer += chunk
                assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
                body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
                assert body["error"]["message"].startswith(f"the request {said.decode()} were not received within 1 s"
                                                           if said == b"headers" else
                                                           "the request body was not received within 1 s"), body
        assert time.monotonic() - start < 8, "the stalled senders were not dropped within the deadline"
        client = open_episode(front, Scripted([ids(tok, "5 <eos>")]))
        assert client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "what"}]
                                              ).choices[0].message.content.strip() == "5"
    finally:
        front.close()


def test_completions_route_extends_by_ids(tok, front):
    engine = Scripted([ids(tok, "7 <eos>"), ids(tok, "8")])
    client = open_episode(front, engine)
    first = client.completions.create(model="policy", prompt=ids(tok, "<|user|> what <|assistant|>"), logprobs=1)
    assert first.choices[0].text == "7" and first.choices[0].logprobs.token_logprobs == [-0.5, -0.5]
    client.completions.create(model="policy", prompt=first.prompt_token_ids + first.choices[0].token_ids + [5])
    log = front.close_episode("ep")
    assert log.error is None and len(log.calls) == 2


def test_same_message_ignores_sdk_fields_and_argument_spacing():
    a = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    b = {"role": "assistant", "content": "", "refusal": None, "tool_calls": [
        {"id": "other", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}}]}
    assert same_message(a, b)
    assert not same_message(a, {**b, "content": "hi"})


def test_same_message_takes_a_malformed_call_the_agent_sent_back():
    """Issue 48, second round: an agent that echoed the answered message with its call mangled
    (``function`` a string) crashed the comparison: a 500 and uvicorn's traceback on the run's stderr."""
    answered = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    for mangled in ([{"id": "call_0", "function": "f(1)"}], ["f(1)"], "f(1)", [{"function": {"arguments": "{no json"}}]):
        assert not same_message({**answered, "tool_calls": mangled}, answered)


class Failing:
    """An engine whose every call fails (as one that died does)."""

    def generate(self, prompts, n, sampling, **kw):
        raise RuntimeError("the engine is gone")


def test_a_refused_or_failed_call_is_one_line_not_a_traceback(tok, front, engine, capfd):
    """Issue 48, second round: an agent that sent a conversation past the model's context (6 MB
    of text, under the body limit) got a 500 for each call and each of the SDK's retries, each
    with uvicorn's traceback on the run's stderr (287 lines for 4 episodes). The engine's refusal
    is a 400 now (the SDK's BadRequestError, not retried) with the engine's one line; any other
    failure of a call a one-line 500, said once on stderr."""
    client = open_episode(front, engine)
    with pytest.raises(openai.BadRequestError, match=r"prompt of \d+ tokens does not fit the context length"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "7 " * 3000}])
    assert front.close_episode("ep").calls == []
    client = open_episode(front, Failing())
    for _ in range(2):
        with pytest.raises(openai.InternalServerError, match="RuntimeError: the engine is gone"):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "what"}])
    front.close_episode("ep")
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.count("a call failed (HTTP 500 to the agent): RuntimeError") == 1, err


def test_trajectory_refuses_a_prompt_that_does_not_extend():
    s = Sample(prompt_index=0, sample_index=0, prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-1.0],
               finish_reason="stop", weight_version="2")
    with pytest.raises(NotAnExtension):
        sample_from_calls([([1, 2], s), ([1, 9, 3], s)], prompt_index=0, sample_index=0, with_kept=False)
    out = sample_from_calls([([1, 2], s), ([1, 2, 3, 4], s)], prompt_index=0, sample_index=0, with_kept=True)
    assert out.output_ids == [3, 4, 3] and out.output_mask == [1, 0, 1] and out.output_logprobs == [-1, 0, -1]
    assert out.kept_ids == [None, None, None] and out.weight_version == "2"


def test_agent_failures_are_counted_and_the_run_goes_on(tok, files, engine, capfd):
    prompts = [make_prompt(tok, 0)]
    for fn, kind, timeout in [("raises", "error", 20.0), ("hangs", "timeout", 3.0), ("no_calls", "error", 20.0),
                              ("rewrites_history", "diverged", 20.0)]:
        # both episodes hang: recovered only without the step's hang guard (the next test)
        runner = agent_runner(tok, files, fn, timeout_s=timeout, max_timeout_fraction=None)
        try:
            t0 = time.monotonic()
            episodes = runner(engine, prompts, 2, SAMPLING, 1)
            assert time.monotonic() - t0 < 30
        finally:
            runner.close()
        assert [e.error for e in episodes] == [kind, kind], fn
        # as the built-in loop, a failed episode keeps the turns it had (the calls recorded before
        # the failure: a diverging call is never recorded), scored by on_env_error
        assert all(e.num_turns == (0 if fn == "no_calls" else 1) for e in episodes), fn
        assert all(bool(e.sample.output_ids) == (fn != "no_calls") for e in episodes), fn
        err = capfd.readouterr().err
        assert err.count(f"episodes.agent {kind} at") == 1, (fn, err)  # printed once, counted twice
        if fn == "raises":
            assert "agents.py:" in err and "the agent's own bug" in err
    stats = episode_stats(episodes)
    assert stats["multi_turn/diverged"] == 2.0


def test_an_agent_that_always_hangs_ends_a_256_sample_step_in_one_wave(tok, files, engine):
    """Issue 64: 256 episodes on 8 workers at timeout_s 10 would take 32 deadlines (5 min)
    before anything was said; the step's hang guard (rollout/episodes/hang_guard.py) stops it after the
    first wave: one line, within 30 s, every worker killed."""
    runner = agent_runner(tok, files, "hangs", timeout_s=10.0, workers=8)
    try:
        for _ in range(7):  # the pool as a step after the first finds it (workers persist): started
            runner._release(AgentProcess(runner.spec))
        t0 = time.monotonic()
        with pytest.raises(EpisodesHung, match=r"^episodes.agent .*agents.py:hangs: (\d+) of the (\d+) episodes "
                                               r"started this step passed episodes.timeout_s=10s"):
            runner(engine, [make_prompt(tok, i) for i in range(64)], 4, SAMPLING, 1)
        assert time.monotonic() - t0 < 30
    finally:
        runner.close()
    assert live_workers(wait_s=10.0) == []


def test_a_bad_request_reaches_the_agent_as_the_sdks_error(tok, files, engine):
    runner = agent_runner(tok, files, "bad_request")
    try:
        (episode,) = runner(engine, [make_prompt(tok)], 1, SAMPLING, 1)
    finally:
        runner.close()
    assert episode.metrics == {"refused": 1.0} and episode.error == "error"  # no model call was made


def test_contract_errors_stop_the_run_in_one_line(tok, files, engine, tmp_path):
    runner = agent_runner(tok, files, "bad_result")
    try:
        with pytest.raises(AgentContractError, match=r"bad_result returned str; expected a number"):
            runner(engine, [make_prompt(tok)], 1, SAMPLING, 1)
    finally:
        runner.close()
    with pytest.raises(ConfigError, match="not_there"):
        agent_runner(tok, files, "not_there")
    with pytest.raises(ConfigError, match="not found"):
        AgentRunner(f"{tmp_path}/missing.py:fn", tok, TurnRenderer(tok, "user"), max_turns=1,
                    max_episode_tokens=8, timeout_s=5, workers=1)


def test_no_agent_process_outlives_the_runner(tok, files, engine):
    runner = agent_runner(tok, files, "nudge", workers=2)
    runner(engine, [make_prompt(tok)], 2, SAMPLING, 1)
    pids = [p.pid for p in runner._idle]
    assert pids
    runner.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_exact_tokens_with_a_qwen_style_template_and_hermes_tool_calls(smollm2_dir):
    """A real BPE tokenizer (SmolLM2's) with a Qwen2.5-style template: the model wrote its call
    without JSON spaces; the SDK sends it back as parsed tool_calls, which the template would
    re-render with its own spacing. The episode keeps the sampled ids."""
    from transformers import AutoTokenizer

    from tests.support.chat_templates import QWEN_STYLE

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.chat_template = QWEN_STYLE
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    sampled = ids(tok, '<tool_call>\n{"name":"add","arguments":{"a":3,"b":4}}\n</tool_call>') + [eos]
    engine = Scripted([sampled, ids(tok, "It is 7.") + [eos]])
    front = AgentFront(tok, TurnRenderer(tok, "tool"), tool_call_format="hermes").start()
    try:
        front.open_episode("ep", EpisodeLog(engine=engine, sampling=SamplingParams(max_new_tokens=64,
                                                                                   stop_token_ids=[eos]),
                                            seed=None, max_calls=4, max_tokens=256))
        client = openai.OpenAI(base_url=front.base_url("ep"), api_key=front.api_key, max_retries=0)
        tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
        messages = [{"role": "user", "content": "What is 3 plus 4?"}]
        first = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        assert first.prompt_token_ids == ids(tok, tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                                                          add_generation_prompt=True))
        (call,) = first.choices[0].message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 3, "b": 4}
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "7"}]
        second = client.chat.completions.create(model="policy", messages=messages, tools=tools)
        assert second.choices[0].message.content == "It is 7."
        turn = "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        exact = first.prompt_token_ids + sampled + ids(tok, turn)
        assert engine.prompts[1] == exact == second.prompt_token_ids
        naive = ids(tok, tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True))
        assert naive != exact  # '{"name": "add", "arguments": {"a": 3, "b": 4}}': the template's spacing
        log = front.close_episode("ep")
        assert log.error is None and log.tool_call_errors == 0
    finally:
        front.close()


def test_config_tables_match_the_registries(tmp_path):
    """The config layer names the tool-call formats and the connectors without importing them:
    each connector's module, imported by path where it runs, has its kind's entry point."""
    import importlib

    from megatron_grpo.chat.tool_calls import TOOL_CALL_FORMATS
    from megatron_grpo.config.connectors import CONNECTORS
    from megatron_grpo.config.episodes import TOOL_CALL_FORMATS as CONFIG_FORMATS, agent_problem
    from megatron_grpo.rollout.episodes.agent.connectors import split_spec

    assert set(CONFIG_FORMATS) == set(TOOL_CALL_FORMATS)
    entry = {"environment": "environment_class", "agent": "load_agent"}
    for prefix, connector in CONNECTORS.items():
        assert callable(getattr(importlib.import_module(connector.module), entry[connector.kind])), prefix
    assert split_spec("verifiers:env.py:load") == ("verifiers", "env.py:load")
    assert split_spec("tools:env.py:Env") == (None, "tools:env.py:Env")  # an environment's prefix: no agent's
    f = tmp_path / "a.py"
    f.write_text("def run(client, row):\n    return 0.0\n")
    assert agent_problem(f"{f}:run") is None
    assert "not found" in agent_problem(f"{tmp_path}/b.py:run")
    assert "is not a file path" in agent_problem("run")
    with pytest.raises(ConfigValueError, match="is not a file path"):
        EpisodesConfig(kind="agent", source="calculator")  # an environment's name is no agent


def test_a_refused_observation_ends_both_loops_alike(tok, files):
    """A tool result with a token the vocabulary lacks ('result 249': numbers stop at 199) ends
    the episode as `observation` in the built-in loop and in the agent's, with the same tokens
    kept (the call before it) and the same reward."""
    prompts = [make_prompt(tok, 0, "what is 150 plus 99", "249")]
    replies = [ids(tok, "compute 150 + 99 <eos>"), ids(tok, "249 <eos>")]
    builtin = builtin_runner(tok, "calculator")(Scripted(list(replies)), prompts, 1, SAMPLING, 7)
    runner = agent_runner(tok, files, "calculator")
    try:
        agent = runner(Scripted(list(replies)), prompts, 1, SAMPLING, 7)
    finally:
        runner.close()
    assert builtin[0].error == "observation" and builtin[0].num_turns == 1
    same_episodes(agent, builtin)
