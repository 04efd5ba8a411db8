"""The embedded engine's OpenAI-compatible routes (`megatron-grpo serve`: /v1/models,
/v1/chat/completions, /v1/completions), called with the real `openai` SDK over HTTP.

Reference: transformers' own forward of the served model (float64 log_softmax(logits / T) of
each returned token), and the tokenizer's chat template for the prompt ids."""

import socket
import threading
import time

import openai
import pytest
import torch
import uvicorn
from transformers import AutoModelForCausalLM

from megatron_grpo.inference.engine import EmbeddedEngine
from megatron_grpo.inference.server import build_app
from tools.tiny import save_tiny_model
from megatron_grpo.models.tokenizer import load_tokenizer

KEY = "test-key"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2", seed=21))
    engine = EmbeddedEngine(model_dir, dtype="float32", max_batch_size=8, seed=0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_app(engine, api_key=KEY, tool_call_format="compute"),
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    yield client, model_dir
    server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()


def hf_logprobs(model_dir, prompt_ids, output_ids, temperature):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].double()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    n = len(prompt_ids)
    return [lp[n - 1 + i, t].item() for i, t in enumerate(output_ids)]


def test_chat_completion_with_token_ids_and_the_models_logprobs(served):
    client, model_dir = served
    tok = load_tokenizer(model_dir)  # the engine's own loader (the tiny word-level tokenizer)
    messages = [{"role": "user", "content": "what is 3 plus 4"}]
    out = client.chat.completions.create(model="any", messages=messages, n=2, max_tokens=6, temperature=0.7,
                                         logprobs=True, seed=3)
    assert out.prompt_token_ids == tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                       add_special_tokens=False)["input_ids"]
    assert len(out.choices) == 2 and out.usage.completion_tokens == sum(len(c.token_ids) for c in out.choices)
    for c in out.choices:
        assert 1 <= len(c.token_ids) <= 6 and c.finish_reason in ("stop", "length")
        assert c.message.content == tok.decode(c.token_ids, skip_special_tokens=True)
        ref = hf_logprobs(model_dir, out.prompt_token_ids, c.token_ids, 0.7)
        assert [t.logprob for t in c.logprobs.content] == pytest.approx(ref, abs=1e-4)
    again = client.chat.completions.create(model="any", messages=messages, n=2, max_tokens=6, temperature=0.7,
                                           seed=3)
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in out.choices]  # the seed replays


def test_completions_from_token_ids(served):
    client, model_dir = served
    prompt = [5, 20, 21, 6]
    out = client.completions.create(model="any", prompt=prompt, max_tokens=4, logprobs=1, temperature=1.0)
    (c,) = out.choices
    assert out.prompt_token_ids == prompt and len(c.token_ids) <= 4
    assert c.logprobs.token_logprobs == pytest.approx(hf_logprobs(model_dir, prompt, c.token_ids, 1.0), abs=1e-4)


def test_bad_requests_are_400_naming_the_key_and_the_key_is_required(served):
    client, _ = served
    msgs = [{"role": "user", "content": "what"}]
    for kwargs, param in [({"stream": True}, "stream"), ({"tool_choice": "required"}, "tool_choice"),
                          ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"), ({"n": 100}, "n")]:
        with pytest.raises(openai.BadRequestError, match=param):
            client.chat.completions.create(model="any", messages=msgs, **kwargs)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model="any", prompt=[10**6])
    bad = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert len(client.models.list().data) == 1


def test_a_lone_surrogate_is_a_400_naming_the_key(served):
    """Issue 48, second round: JSON's "\\ud800" (a lone UTF-16 surrogate, which Python's parser
    accepts and no tokenizer can encode) was a 400 saying "TextEncodeInput must be Union[...]",
    named ``messages`` even on /v1/completions. Each route now names the key and the cause."""
    import httpx

    client, _ = served
    root = str(client.base_url).removesuffix("/v1/").removesuffix("/v1")
    hostile = [("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "a \\ud800 b"}]}',
                "messages[0].content: holds a lone UTF-16 surrogate ('\\\\ud800' at character 2), which is not text"),
               ("/v1/completions", '{"model": "m", "prompt": "a \\udfff", "max_tokens": 1}',
                "prompt: holds a lone UTF-16 surrogate ('\\\\udfff' at character 2)"),
               ("/v1/completions", '{"model": "m", "prompt": "ab", "stop": ["\\ud800"], "max_tokens": 1}',
                "stop: holds a lone UTF-16 surrogate"),
               ("/generate", '{"text": "x \\ud800", "sampling_params": {"max_new_tokens": 1}}',
                "text: holds a lone UTF-16 surrogate")]
    for route, body, needle in hostile:
        r = httpx.post(root + route, content=body, timeout=30,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        assert r.status_code == 400 and needle in r.text, (route, r.status_code, r.text)
