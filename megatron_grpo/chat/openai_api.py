"""OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions``: requests in, answers out.

Pure functions shared by every server that speaks the API here (the agent front a run serves
on loopback, ``rollout/episodes/agent/front.py``): a request body is checked into a ``ChatRequest`` or
``CompletionRequest`` (a bad one is an ``OpenAIRequestError`` naming the key, answered 400 in
OpenAI's error shape), a conversation is rendered to token ids by the model's chat template
(``tools`` passed to the template, as transformers' ``apply_chat_template(tools=...)`` does),
and the engine's samples become the answer.

Departures from OpenAI's API, all deliberate:

* Token ids are always returned, as vLLM's and SGLang's extensions do: ``prompt_token_ids`` at
  the top level and ``token_ids`` on each choice (the OpenAI SDK keeps unknown fields, read as
  ``completion.prompt_token_ids``), so a client can build exact trajectories;
* ``logprobs`` are the engine's, under the request's temperature (SGLang's definition);
  ``top_logprobs`` above 0 is refused (the engines return the sampled token's only);
* ``stop`` strings are accepted only when each is one token of the vocabulary (it becomes a
  stop token id): cutting a completion's text after generation would train tokens the client
  never saw; ``tool_choice`` is ``auto`` or ``none`` (forcing a call needs constrained
  decoding); ``stream``, penalties and ``response_format`` other than text are refused;
* a choice whose text holds tool calls (``tools`` given, ``tool_choice`` auto) answers
  ``finish_reason: "tool_calls"``, with the calls parsed in the model's own format
  (``chat/tool_calls.py``); malformed calls stay in ``content`` and are counted.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from megatron_grpo.chat.tool_calls import ParsedTurn, parse_tool_calls

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_N = 64
"""Choices per request at most (bounded work per request)."""


class OpenAIRequestError(ValueError):
    """A request the API cannot serve: one line naming the key (``param``)."""

    def __init__(self, param: Optional[str], message: str):
        self.param = param
        super().__init__(f"{param}: {message}" if param else message)


def error_body(e: OpenAIRequestError) -> dict:
    """OpenAI's error shape, which the SDK turns into ``BadRequestError`` with this message."""
    return {"error": {"message": str(e), "type": "invalid_request_error", "param": e.param, "code": None}}


@dataclass
class Sampling:
    """What a request asks of the sampler (None: the server's default)."""

    n: int = 1
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    stop: list[str] = field(default_factory=list)
    seed: Optional[int] = None
    logprobs: bool = False


@dataclass
class ChatRequest:
    model: str
    messages: list[dict]
    tools: Optional[list[dict]]
    tool_choice: str
    """``auto`` (the default with tools) or ``none``."""
    sampling: Sampling


@dataclass
class CompletionRequest:
    model: str
    prompt: str | list[int]
    sampling: Sampling


# keys accepted only at these (OpenAI default) values
_DEFAULT_ONLY = {"stream": (False, None), "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None),
                 "logit_bias": (None, {}), "echo": (False, None), "best_of": (None, 1), "suffix": (None, ""),
                 "top_logprobs": (None, 0), "stream_options": (None,), "prediction": (None,),
                 "service_level": (None,), "service_tier": (None, "auto", "default")}
_IGNORED = {"user", "metadata", "store", "parallel_tool_calls", "reasoning_effort", "modalities", "audio",
            "extra_body", "return_token_ids"}
"""Keys that change nothing here (accepted so that SDK callers need not strip them)."""
_SAMPLING_KEYS = {"n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                  "seed", "logprobs"}
_CHAT_KEYS = {"model", "messages", "tools", "tool_choice", "response_format"} | _SAMPLING_KEYS
_COMPLETION_KEYS = {"model", "prompt"} | _SAMPLING_KEYS


def _number(body: dict, key: str, lo: float, hi: float, *, integer: bool = False) -> Optional[float]:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise OpenAIRequestError(key, f"must be {'an integer' if integer else 'a number'}, got {v!r}")
    if not (isinstance(v, int) or math.isfinite(v)) or not lo <= v <= hi:
        raise OpenAIRequestError(key, f"must be in [{lo:g}, {hi:g}], got {v!r}")
    return v


def _check_keys(body: Any, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise OpenAIRequestError(None, "the request body must be a JSON object")
    for key, value in body.items():
        if key in _DEFAULT_ONLY:
            if value not in _DEFAULT_ONLY[key]:
                raise OpenAIRequestError(key, f"is not supported here (only {_DEFAULT_ONLY[key][0]!r})")
        elif key not in allowed and key not in _IGNORED:
            raise OpenAIRequestError(key, "unknown key")


def _sampling(body: dict, *, logprobs_is_int: bool) -> Sampling:
    n = _number(body, "n", 1, MAX_N, integer=True)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        max_tokens = _number({key: max_tokens}, key, 1, 2**31 - 1, integer=True)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise OpenAIRequestError("stop", "must be a string or a list of at most 4 non-empty strings")
    for s in stop:
        check_text("stop", s)
    lp = body.get("logprobs")
    if logprobs_is_int:  # /v1/completions: logprobs is the number of top tokens, 0 = the sampled one
        if lp is not None and (isinstance(lp, bool) or lp not in (0, 1)):
            raise OpenAIRequestError("logprobs", "only 0 or 1 (the sampled token's log-prob) is supported here")
        want_lp = lp is not None
    else:
        if lp not in (None, True, False):
            raise OpenAIRequestError("logprobs", f"must be a boolean, got {lp!r}")
        want_lp = bool(lp)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise OpenAIRequestError("seed", f"must be an integer, got {seed!r}")
    return Sampling(n=int(n or 1), max_tokens=max_tokens, temperature=_number(body, "temperature", 0, 2),
                    top_p=_number(body, "top_p", 0, 1), top_k=_number(body, "top_k", -1, 2**31 - 1, integer=True),
                    min_p=_number(body, "min_p", 0, 1), stop=stop, seed=seed, logprobs=want_lp)


def check_text(where: str, text: str) -> str:
    """``text``, unless it holds a lone UTF-16 surrogate (JSON's ``"\\ud800"``, which Python's
    parser accepts): the tokenizer then failed with a type error that named neither the key nor
    the cause. OpenAIRequestError naming ``where`` otherwise."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise OpenAIRequestError(where, f"holds a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}), "
                                        "which is not text") from None
    return text


def _check_message(i: int, m: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
        raise OpenAIRequestError(where, f"must be an object whose role is one of {', '.join(CHAT_ROLES)}")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise OpenAIRequestError(f"{where}.content", "only text content parts are supported")
        m = {**m, "content": "".join(p["text"] for p in content)}
    elif content is not None and not isinstance(content, str):
        raise OpenAIRequestError(f"{where}.content", "must be a string, a list of text parts or null")
    if m.get("content") is not None:
        check_text(f"{where}.content", m["content"])
    if content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
        raise OpenAIRequestError(f"{where}.content", "is required (null only on an assistant message with tool_calls)")
    return m


def parse_chat_request(body: Any) -> ChatRequest:
    """``body`` of a /v1/chat/completions request, checked; OpenAIRequestError otherwise."""
    _check_keys(body, _CHAT_KEYS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIRequestError("messages", "must be a non-empty list")
    messages = [_check_message(i, m) for i, m in enumerate(messages)]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise OpenAIRequestError("tools", 'must be a list of {"type": "function", "function": {"name": ...}}')
        tools = tools or None
    choice = body.get("tool_choice") or "auto"
    if choice not in ("auto", "none"):
        raise OpenAIRequestError("tool_choice", "only 'auto' and 'none' are supported here (forcing a call needs "
                                                "constrained decoding)")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise OpenAIRequestError("response_format", "only {'type': 'text'} is supported here")
    model = body.get("model")
    if not isinstance(model, str):
        raise OpenAIRequestError("model", "is required (a string)")
    return ChatRequest(model=model, messages=messages, tools=tools, tool_choice=choice,
                       sampling=_sampling(body, logprobs_is_int=False))


def parse_completion_request(body: Any) -> CompletionRequest:
    """``body`` of a /v1/completions request, checked (one prompt: a string or token ids)."""
    _check_keys(body, _COMPLETION_KEYS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise OpenAIRequestError("prompt", "must be a string or one list of non-negative token ids "
                                               "(one prompt per request)")
    elif not isinstance(prompt, str) or not prompt:
        raise OpenAIRequestError("prompt", "must be a non-empty string or a list of token ids")
    else:
        check_text("prompt", prompt)
    model = body.get("model")
    if not isinstance(model, str):
        raise OpenAIRequestError("model", "is required (a string)")
    sampling = _sampling(body, logprobs_is_int=True)
    if sampling.max_tokens is None:
        sampling.max_tokens = 16  # OpenAI's default for /v1/completions
    return CompletionRequest(model=model, prompt=prompt, sampling=sampling)


def stop_token_ids(stop: Sequence[str], tokenizer) -> list[int]:
    """The token id of each stop string; OpenAIRequestError for one that is not a single token
    (module docstring: a completion is never cut after it was sampled)."""
    ids = []
    for s in stop:
        toks = tokenizer(s, add_special_tokens=False)["input_ids"]
        tid = tokenizer.convert_tokens_to_ids(s)
        if len(toks) == 1:
            ids.append(int(toks[0]))
        elif isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
            ids.append(tid)
        else:
            raise OpenAIRequestError("stop", f"{s!r} is {len(toks)} tokens; only single-token stop strings are "
                                             "supported (the completion is not cut after sampling)")
    return ids


def render_chat(tokenizer, messages: Sequence[dict], tools: Optional[Sequence[dict]] = None, *,
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template (``tools`` handed to
    it), tokenized without adding special tokens (the template writes any BOS itself)."""
    kwargs = {"tools": list(tools)} if tools else {}
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _logprobs_content(tokenizer, ids: Sequence[int], logprobs: Sequence[float]) -> list[dict]:
    out = []
    for t, lp in zip(ids, logprobs):
        text = tokenizer.decode([int(t)])
        out.append({"token": text, "logprob": float(lp), "bytes": list(text.encode()), "top_logprobs": []})
    return out


@dataclass
class Choice:
    """One sampled completion: the engine's ids and log-probs, and why it ended (Sample's)."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    """``stop``, ``length`` or ``abort``."""


def chat_choice(tokenizer, index: int, choice: Choice, req: ChatRequest, tool_call_format: str,
                id_prefix: str) -> tuple[dict, ParsedTurn]:
    """One ``choices[i]`` of a chat answer, and the tool calls parsed from it (errors included)."""
    text = tokenizer.decode(choice.output_ids, skip_special_tokens=True)
    if req.tools and req.tool_choice == "auto":
        turn = parse_tool_calls(text, tool_call_format, id_prefix=id_prefix)
    else:
        turn = ParsedTurn(text)
    message: dict[str, Any] = {"role": "assistant", "content": turn.content if turn.tool_calls else text}
    finish = "length" if choice.finish_reason == "length" else "stop"
    if turn.tool_calls:
        message["tool_calls"] = turn.tool_calls
        finish = "tool_calls" if finish == "stop" else finish
    out = {"index": index, "message": message, "finish_reason": finish, "token_ids": list(choice.output_ids),
           "logprobs": ({"content": _logprobs_content(tokenizer, choice.output_ids, choice.output_logprobs)}
                        if req.sampling.logprobs else None)}
    return out, turn


def _usage(prompt_ids: Sequence[int], choices: Sequence[Choice]) -> dict:
    completion = sum(len(c.output_ids) for c in choices)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


def chat_response(tokenizer, req: ChatRequest, prompt_ids: Sequence[int], choices: Sequence[Choice], *,
                  tool_call_format: str, id_prefix: str = "call", **extra: Any) -> tuple[dict, list[ParsedTurn]]:
    """A ``chat.completion`` answer for ``choices`` (and each choice's parsed turn). ``extra``:
    further top-level fields (e.g. ``weight_version``)."""
    built = [chat_choice(tokenizer, i, c, req, tool_call_format, f"{id_prefix}_{i}" if len(choices) > 1 else id_prefix)
             for i, c in enumerate(choices)]
    body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": req.model, "choices": [c for c, _ in built], "usage": _usage(prompt_ids, choices),
            "prompt_token_ids": list(prompt_ids), **extra}
    return body, [t for _, t in built]


def completion_response(tokenizer, req: CompletionRequest, prompt_ids: Sequence[int], choices: Sequence[Choice],
                        **extra: Any) -> dict:
    """A ``text_completion`` answer for ``choices``."""
    out = []
    for i, c in enumerate(choices):
        logprobs = None
        if req.sampling.logprobs:
            toks = [tokenizer.decode([int(t)]) for t in c.output_ids]
            offsets, pos = [], 0
            for t in toks:
                offsets.append(pos)
                pos += len(t)
            logprobs = {"tokens": toks, "token_logprobs": [float(x) for x in c.output_logprobs],
                        "top_logprobs": None, "text_offset": offsets}
        out.append({"index": i, "text": tokenizer.decode(c.output_ids, skip_special_tokens=True),
                    "finish_reason": "length" if c.finish_reason == "length" else "stop",
                    "logprobs": logprobs, "token_ids": list(c.output_ids)})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model, "choices": out, "usage": _usage(prompt_ids, choices),
            "prompt_token_ids": list(prompt_ids), **extra}
