"""The agent front: an OpenAI-compatible server on loopback, in front of the run's engine,
that records every call of an episode as exact token ids (docs/agents.md).

An agent (``episodes.kind: agent``, ``runner.py``) gets an OpenAI SDK client whose base URL
names its episode, ``http://127.0.0.1:<port>/episodes/<id>/v1``; the front answers its
``chat.completions`` and ``completions`` calls with the run's engine (any kind, through the same
``RolloutEngine.generate`` the built-in loops call) and keeps each call's prompt ids, output
ids, log-probs, kept sets and weight versions (``Call``); ``trajectory.py`` builds the episode
from those records, never from the agent's text.

Token-exactness across turns: a call whose messages are the previous call's, then the answer
the front gave, then new messages gets the prompt ids ``previous prompt ids + the engine's
output ids + delta render of the new messages`` (``turns.py``). Anything else is rendered whole
and kept only if it still extends the episode token for token; otherwise the episode is
``diverged`` (counted, scored as ``on_env_error`` says with the calls before, never trained on
a re-tokenized prefix), and the call is still answered.

The run decides, not the request: the sampler's temperature, top_p, top_k and min_p (the
trainer's log-probs are computed at them; other values are said once on stderr); the seed (the
built-in loop's per-call seeds); ``max_tokens``, capped by ``rollout.max_new_tokens`` and the
episode's token budget. A call past the budget or ``max_turns`` gets an empty completion,
``finish_reason: "length"``, not recorded. ``n`` must be 1.

Loopback only, a random bearer key per run, bounded bodies (``MAX_BODY_BYTES``), header and
body deadlines (``READ_TIMEOUT_S``), unknown episodes 404: ``runtime/http_guard.py``'s guards,
shared with ``megatron-grpo serve``; every refusal is one line in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from megatron_grpo.chat.openai_api import (ChatRequest, Choice, OpenAIRequestError, chat_response,
                                           completion_response, error_body, parse_chat_request,
                                           parse_completion_request, render_chat, stop_token_ids)
from megatron_grpo.rollout.episodes.turns import ObservationError, TurnRenderer
from megatron_grpo.runtime.errors import one_line
from megatron_grpo.runtime.http_guard import (BodyBound, Refused, bearer_ok, header_deadline_protocol, one_line_errors,
                                             read_json)
from megatron_grpo.wire.samples import RolloutError, Sample, SamplingParams

MAX_BODY_BYTES = 8 * 2**20
START_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 60.0
"""Deadline for a request's headers (from the connection's start or the previous answer on it),
then again for its body: an agent sends its request at once; past it, a 408."""
SEED_MODULUS = 2**31 - 1
REFUSED = (400, 413)
"""HTTP statuses of an engine that refused a request (a prompt past its context, too large)."""
MODEL_NAME = "policy"
"""The model id the front answers to (``/v1/models``); requests may name any model."""


@dataclass
class Call:
    """One recorded engine call: the prompt ids it was given and the engine's sample."""

    prompt_ids: list[int]
    sample: Sample
    generate_s: float


@dataclass
class EpisodeLog:
    """One episode's state in the front (see the module docstring)."""

    engine: Any
    """The RolloutEngine of the round."""
    sampling: SamplingParams
    seed: Optional[int]
    """First call's sampling seed (None: unseeded); call k uses ``seed + k``."""
    max_calls: int
    max_tokens: int
    """Token budget of the episode's output (model and context tokens after the first prompt)."""
    calls: list[Call] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    """The last chat call's messages and the assistant message answered to it."""
    error: Optional[str] = None
    """None, ``diverged`` or ``observation`` (module docstring)."""
    error_message: str = ""
    tool_call_errors: int = 0
    refused_calls: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def context(self) -> list[int]:
        """Every token of the episode so far: the last prompt and the engine's answer to it."""
        last = self.calls[-1]
        return last.prompt_ids + last.sample.output_ids

    def tokens_used(self, prompt_ids: list[int]) -> int:
        return len(prompt_ids) - len(self.calls[0].prompt_ids) if self.calls else 0


def _norm_calls(calls: Any) -> list:
    out = []
    for c in calls if isinstance(calls, list) else []:
        fn = c.get("function") if isinstance(c, dict) else None
        fn = fn if isinstance(fn, dict) else {}  # a malformed call the agent sent back: compared as empty
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        out.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return out


def same_message(a: dict, b: dict) -> bool:
    """Whether two chat messages say the same: role, content (None and "" alike) and tool calls
    (name and parsed arguments); the SDK's extra fields (refusal, annotations, ids) aside."""
    return (a.get("role") == b.get("role") and (a.get("content") or "") == (b.get("content") or "")
            and _norm_calls(a.get("tool_calls")) == _norm_calls(b.get("tool_calls")))


REFUSAL_TYPES = {401: "authentication_error", 408: "timeout_error"}
"""OpenAI's error type of a refused request by status (any other: ``invalid_request_error``)."""


def refusal_body(message: str, status: int) -> dict:
    """OpenAI's error shape for a request refused before its route (bad key, body past its bound
    or deadline, not JSON; the SDK raises ``APIStatusError`` with this message)."""
    kind = REFUSAL_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def refusal(e: Refused) -> JSONResponse:
    """The answer to a refused request; after a 408 the connection is closed, so what is left of a
    stalled body is never read."""
    return JSONResponse(refusal_body(e.message, e.status), e.status,
                        headers={"connection": "close"} if e.status == 408 else None)


class AgentFront:
    """The server (module docstring). ``start()`` serves it on a free loopback port;
    ``open_episode`` / ``close_episode`` bracket one episode's calls; ``close()`` stops it."""

    def __init__(self, tokenizer, renderer: TurnRenderer, *, tool_call_format: str = "hermes",
                 max_inflight: int = 64, read_timeout_s: float = READ_TIMEOUT_S):
        self.tokenizer = tokenizer
        self.read_timeout_s = read_timeout_s
        self.renderer = renderer
        self.tool_call_format = tool_call_format
        self.api_key = os.urandom(16).hex()
        self._episodes: dict[str, EpisodeLog] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="agent-front")
        self._said: set[str] = set()
        self._server = None
        self._thread: Optional[threading.Thread] = None
        self.port: Optional[int] = None

    # ---- episodes ------------------------------------------------------------------------

    def base_url(self, episode_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{episode_id}/v1"

    def open_episode(self, episode_id: str, log: EpisodeLog) -> None:
        with self._lock:
            self._episodes[episode_id] = log

    def close_episode(self, episode_id: str) -> EpisodeLog:
        """The episode's log; later calls for it are 404 (and wait for one in progress)."""
        with self._lock:
            log = self._episodes.pop(episode_id)
        with log.lock:
            return log

    # ---- calls ---------------------------------------------------------------------------

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            print(f"[megatron-grpo] episodes.agent: {message}", file=sys.stderr, flush=True)

    def _sampling(self, log: EpisodeLog, req_sampling, max_new: int) -> SamplingParams:
        for key in ("temperature", "top_p", "top_k", "min_p"):
            asked = getattr(req_sampling, key)
            run = getattr(log.sampling, key)
            if asked is not None and float(asked) != float(run):
                self._say_once(key, f"an agent asked {key}={asked}; rollouts sample at the run's {key}={run} "
                                    "(the trainer's log-probs are computed at it)")
        if req_sampling.n != 1:
            raise OpenAIRequestError("n", "must be 1 in a training episode (one trajectory per episode)")
        stops = stop_token_ids(req_sampling.stop, self.tokenizer)
        return dataclasses.replace(log.sampling, max_new_tokens=max_new,
                                   stop_token_ids=[*log.sampling.stop_token_ids, *stops])

    def _chat_prompt(self, log: EpisodeLog, req: ChatRequest) -> list[int]:
        """The call's prompt ids (module docstring); sets ``log.error`` when they do not extend the episode."""
        if not log.calls or log.error is not None:
            return render_chat(self.tokenizer, req.messages, req.tools)
        k = len(log.messages)
        if (len(req.messages) > k and all(same_message(a, b) for a, b in zip(req.messages[:k], log.messages))
                and all(m["role"] != "assistant" for m in req.messages[k:])):
            try:
                return log.context + self.renderer.messages_ids(log.calls[-1].sample.output_ids, req.messages[k:],
                                                                req.tools)
            except ObservationError as e:
                log.error, log.error_message = "observation", str(e)
                return render_chat(self.tokenizer, req.messages, req.tools)
        ids = render_chat(self.tokenizer, req.messages, req.tools)
        context = log.context
        if ids[:len(context)] != context:
            log.error = "diverged"
            log.error_message = (f"call {len(log.calls)}'s conversation does not continue the episode's previous "
                                 "turn (its messages differ, and their rendering does not extend the episode's "
                                 "tokens)")
        return ids

    def _generate(self, log: EpisodeLog, prompt_ids: list[int], req_sampling) -> Optional[Call]:
        """The engine's answer to ``prompt_ids``, recorded (None: past the episode's budget)."""
        left = log.max_tokens - log.tokens_used(prompt_ids)
        if left <= 0 or len(log.calls) >= log.max_calls or log.error is not None:
            log.refused_calls += 1
            return None
        max_new = min(log.sampling.max_new_tokens, left, req_sampling.max_tokens or left)
        sampling = self._sampling(log, req_sampling, max_new)
        seed = None if log.seed is None else (log.seed + len(log.calls)) % SEED_MODULUS
        t0 = time.monotonic()
        try:
            (sample,) = log.engine.generate([list(prompt_ids)], 1, sampling, sampling_seed=seed)
        except RolloutError as e:
            if e.status not in REFUSED:
                raise
            # the engine refused this request (a conversation past the model's context): the
            # agent's mistake, answered as a 400 (the SDK's BadRequestError, not retried)
            raise OpenAIRequestError(None, str(e)) from None
        call = Call(list(prompt_ids), sample, time.monotonic() - t0)
        log.calls.append(call)
        return call

    def chat(self, episode_id: str, body: Any) -> tuple[int, dict]:
        """(HTTP status, JSON body) of a /v1/chat/completions call of ``episode_id``."""
        log = self._episodes.get(episode_id)
        if log is None:
            return 404, {"error": {"message": f"no episode {episode_id!r} is open", "type": "not_found"}}
        try:
            req = parse_chat_request(body)
            with log.lock:
                prompt_ids = self._chat_prompt(log, req)
                call = self._generate(log, prompt_ids, req.sampling)
                choice = (Choice([], [], "length") if call is None else
                          Choice(call.sample.output_ids, call.sample.output_logprobs, call.sample.finish_reason))
                answer, turns = chat_response(self.tokenizer, req, prompt_ids, [choice],
                                              tool_call_format=self.tool_call_format,
                                              id_prefix=f"call_{len(log.calls)}",
                                              weight_version=None if call is None else call.sample.weight_version)
                if call is not None:
                    log.tool_call_errors += len(turns[0].errors)
                    log.messages = [*req.messages, answer["choices"][0]["message"]]
                return 200, answer
        except OpenAIRequestError as e:
            return 400, error_body(e)

    def completion(self, episode_id: str, body: Any) -> tuple[int, dict]:
        """(HTTP status, JSON body) of a /v1/completions call: the prompt (text or ids) is used
        as given, so it extends the episode only if its ids do."""
        log = self._episodes.get(episode_id)
        if log is None:
            return 404, {"error": {"message": f"no episode {episode_id!r} is open", "type": "not_found"}}
        try:
            req = parse_completion_request(body)
            ids = (list(req.prompt) if isinstance(req.prompt, list)
                   else list(self.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]))
            vocab = len(self.tokenizer)
            if any(t >= vocab for t in ids):
                raise OpenAIRequestError("prompt", f"token ids must be below the vocabulary size {vocab}")
            with log.lock:
                if log.calls and log.error is None and ids[:len(log.context)] != log.context:
                    log.error = "diverged"
                    log.error_message = f"call {len(log.calls)}'s prompt does not extend the episode's tokens"
                log.messages = []
                call = self._generate(log, ids, req.sampling)
                choice = (Choice([], [], "length") if call is None else
                          Choice(call.sample.output_ids, call.sample.output_logprobs, call.sample.finish_reason))
                return 200, completion_response(self.tokenizer, req, ids, [choice],
                                                weight_version=None if call is None else call.sample.weight_version)
        except OpenAIRequestError as e:
            return 400, error_body(e)

    # ---- the server ----------------------------------------------------------------------

    def build_app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        app.middleware("http")(one_line_errors(refusal_body))  # the engine's server answers the same way

        bound = BodyBound(MAX_BODY_BYTES, self.read_timeout_s, "MAX_BODY_BYTES", "READ_TIMEOUT_S")

        async def body_of(request: Request) -> Any:
            try:
                if not bearer_ok(request, self.api_key):
                    raise Refused(401, "invalid API key")
                return await read_json(request, bound)
            except Refused as e:
                return refusal(e)

        async def answer(fn, episode_id: str, request: Request):
            body = await body_of(request)
            if isinstance(body, JSONResponse):
                return body
            try:
                status, out = await asyncio.get_running_loop().run_in_executor(self._pool, fn, episode_id, body)
            except Exception as e:  # noqa: BLE001 - a failure of the call (the engine's): one line, not
                # uvicorn's traceback on the run's stderr for each call and each of the SDK's retries
                message = one_line(e)
                self._say_once(f"500 {type(e).__name__}", f"a call failed (HTTP 500 to the agent): {message}")
                return JSONResponse({"error": {"message": message, "type": "internal_error"}}, 500)
            return JSONResponse(out, status)

        @app.post("/episodes/{episode_id}/v1/chat/completions")
        async def chat(episode_id: str, request: Request):
            return await answer(self.chat, episode_id, request)

        @app.post("/episodes/{episode_id}/v1/completions")
        async def completions(episode_id: str, request: Request):
            return await answer(self.completion, episode_id, request)

        @app.get("/episodes/{episode_id}/v1/models")
        async def models(episode_id: str):
            return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "megatron-grpo"}]}

        return app

    def start(self) -> "AgentFront":
        """Serve on a free loopback port (in a thread of this process); returns when it answers."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.build_app(), log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30,
                                http=header_deadline_protocol(self.read_timeout_s, "READ_TIMEOUT_S", refusal_body))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="agent-front")
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent front (an OpenAI-compatible server on loopback) did not start")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None
        self._pool.shutdown(wait=False, cancel_futures=True)
