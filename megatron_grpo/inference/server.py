"""FastAPI app of the embedded engine: SGLang 0.5.23's native routes and answer shapes.

``build_app`` registers the route groups, each a few methods of ``_Routes`` (which holds the
engine): health and info, /generate, pause/flush/continue, weight updates and their distributed
group, weight version and inspection, and OpenAI-compatible /v1 routes (``chat/openai_api.py``).

Differences from SGLang, all deliberate:

* ``/update_weights_from_shm`` (embedded only): the CPU tensor transport's wire, a flattened
  bucket in a ``/dev/shm`` segment the engine maps (``wire/shm.py``);
* ``/weights_checksum`` (embedded only): per-tensor checksums; the weight-update routes accept
  ``"compute_checksums": true`` to compute them in the background right after loading;
* the weight-update routes take a LoRA policy's frozen base (``lora_base``) then its adapters
  alone (``lora``), merged in fp32 by the engine (``lora_update.py``), inside a
  ``/begin_weight_update`` .. ``/end_weight_update`` session on every route;
* ``sampling_params`` keys the engine cannot honour (penalties, grammars, stop strings) are a
  400 naming the key unless left at SGLang's default;
* ``input_token_logprobs`` use the request's temperature, like the output log-probs.

Blocking work (tokenizing, waiting for generation, receiving broadcasts, loading weights) runs
in worker threads, so ``/health`` and ``/pause_generation`` answer meanwhile. What a request may
make the server do is bounded by its ``RequestLimits`` (``limits.py``): body size and a
/generate's sequences and tokens (413), weight directories (403), the weight-update group a
request may join and a LoRA merge's rank (400). Routes: docs/rollout_engines.md#embedded-engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Callable, Optional

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from megatron_grpo.chat.openai_api import (Choice, OpenAIRequestError, Sampling, chat_response, check_text,
                                           completion_response, error_body, parse_chat_request,
                                           parse_completion_request, render_chat, stop_token_ids)
from megatron_grpo.chat.tool_calls import TOOL_CALL_FORMATS
from megatron_grpo.wire import routed_experts
from megatron_grpo.inference.engine import EmbeddedEngine, EngineError
from megatron_grpo.inference.generation import Sequence
from megatron_grpo.inference.lora_update import LoraUpdate, parse_lora, parse_lora_base
from megatron_grpo.inference.limits import (RequestLimits, rendezvous_problem, request_size_problem,
                                         trusted_weight_dir, untrusted_weight_path_message)
from megatron_grpo.inference.sampling import resolve_sampling_params
from megatron_grpo.runtime.http_guard import BodyBound, Refused, bearer_ok, one_line_errors, read_json
from megatron_grpo.wire.serialize import deserialize_named_tensors

# /generate keys that are accepted at these (SGLang default) values only.
_GENERATE_DEFAULTS: dict[str, Any] = {
    "stream": False, "top_logprobs_num": None, "token_ids_logprob": None, "image_data": None,
    "audio_data": None, "video_data": None, "lora_path": None, "custom_logit_processor": None,
    "return_hidden_states": False, "session_params": None, "bootstrap_host": None,
    "log_metrics": True, "modalities": None, "data_parallel_rank": None,
}
_GENERATE_KEYS = {"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len",
                  "return_text_in_logprobs", "rid", "return_routed_experts",
                  "return_sampling_mask", "sampling_mask_max_kept", "skip_batch_window"} | set(_GENERATE_DEFAULTS)


# SGLang 0.5.23 loads tensor and distributed updates only inside a begin/end bracket (its
# scheduler answers 400 with this text otherwise); this engine keeps the same contract.
_NO_SESSION = "{route} must run between begin_weight_update() and end_weight_update()"


# ---- shared helpers -------------------------------------------------------------------


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse({"object": "error", "message": message, "type": "BadRequest", "code": 400},
                        status_code=400)


def _result(success: bool = True, message: str = "ok", **extra: Any) -> JSONResponse:
    """SGLang's answer to a weight route: ``success`` and ``message``, 400 on failure."""
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


class RequestTooLarge(ValueError):
    """A request past one of the server's bounds (HTTP 413)."""


async def _body(request: Request, bound: BodyBound) -> dict:
    """The request's JSON object through the guards (``runtime/http_guard.py``: 413 past the
    body bound, 408 past the read deadline, 400 for anything but JSON); not an object: a 400."""
    try:
        data = await read_json(request, bound)
    except Refused as e:
        raise HTTPException(e.status, e.message) from None
    if not isinstance(data, dict):
        raise HTTPException(400, "the request body must be a JSON object")
    return data


async def _in_thread(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn`` in a worker thread (the event loop keeps serving); an ``EngineError`` is a 400."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except EngineError as e:
        raise HTTPException(400, str(e)) from None


def http_error_body(message: str, status: int) -> dict:
    """SGLang's error shape for a status other than 400 (what a 408 or 413 carries)."""
    return {"object": "error", "message": message, "code": status}


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Errors in SGLang's shape: a 400 is a ``BadRequest``, other codes carry only their message."""
    if exc.status_code == 400:
        return _bad_request(str(exc.detail))
    return JSONResponse(http_error_body(str(exc.detail), exc.status_code), status_code=exc.status_code)


def _per_item(value: Any, count: int, key: str) -> list:
    """SGLang broadcasting: one value for all items, or a list with one per item."""
    if isinstance(value, list):
        if len(value) != count:
            raise EngineError(f"{key} has {len(value)} entries for {count} inputs")
        return value
    return [value] * count


def _lora_update(req: dict) -> Optional[LoraUpdate]:
    """A weight-update request's ``lora`` key (``lora_update.py``); a malformed one is a 400."""
    try:
        return parse_lora(req.get("lora"))
    except ValueError as e:
        raise HTTPException(400, str(e)) from None


def _lora_keys(req: dict, names: list) -> dict:
    """``lora`` and ``lora_base`` of a weight-update request over the tensors ``names``, as the
    engine's receive methods take them; a malformed one is a 400."""
    try:
        return {"lora": _lora_update(req), "lora_base": parse_lora_base(req.get("lora_base"), names)}
    except ValueError as e:
        raise HTTPException(400, str(e)) from None


def _all_finished(items: list[Sequence]) -> asyncio.Future:
    """A future of the running loop that completes once every sequence of ``items`` has finished."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    remaining = [len(items)]

    def on_finish(_: Sequence) -> None:
        # Called from the scheduler thread (or from pause/abort): hop to the loop.
        def tick() -> None:
            remaining[0] -= 1
            if remaining[0] == 0 and not done.done():
                done.set_result(None)
        loop.call_soon_threadsafe(tick)

    for s in items:
        s.on_finish = on_finish
    return done


# ---- the app ---------------------------------------------------------------------------


def build_app(engine: EmbeddedEngine, *, api_key: Optional[str] = None,
              limits: RequestLimits = RequestLimits(), tool_call_format: str = "hermes") -> FastAPI:
    """The HTTP app serving ``engine``; with ``api_key`` every route but /health needs
    ``Authorization: Bearer <api_key>`` (SGLang's rule) and answers 401 otherwise. ``limits``
    bounds what one request may make it do (``limits.py``); ``tool_call_format``: how the
    OpenAI routes find tool calls in a completion (``chat/tool_calls.py``)."""
    if tool_call_format not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool-call format {tool_call_format!r} (known: {', '.join(TOOL_CALL_FORMATS)})")
    app = FastAPI(title="megatron-grpo embedded rollout engine", openapi_url=None)
    routes = _Routes(engine, api_key, limits)
    routes.tool_call_format = tool_call_format
    if api_key:
        app.middleware("http")(routes.authenticate)
    app.middleware("http")(one_line_errors(http_error_body))  # outermost: an unexpected error is one line
    app.exception_handler(HTTPException)(_http_error)
    for path, methods, endpoint in routes.table():
        app.add_api_route(path, endpoint, methods=methods)
    return app


class _Routes:
    """Every route's handler, over one engine. Handlers that only read or flip engine state run on
    the event loop; those that may block go through ``_in_thread``."""

    def __init__(self, engine: EmbeddedEngine, api_key: Optional[str], limits: RequestLimits) -> None:
        self.engine = engine
        self.api_key = api_key
        self.limits = limits
        self.bound = BodyBound(limits.max_request_bytes, limits.read_timeout_s, "--max-request-bytes",
                               "--read-timeout-s")
        # /generate requests being answered, answered so far, and answered on the current
        # weight version (in /get_server_info): what an operator or a test watches to see a
        # step's generation under way or done. Only the event loop touches them: no lock.
        self.generate_in_flight = 0
        self.generate_answered = 0
        self._answered_on: tuple[str, int] = ("", 0)  # (weight version, requests answered on it)

    async def _body(self, request: Request) -> dict:
        return await _body(request, self.bound)

    def table(self) -> list[tuple[str, list[str], Callable]]:
        """(path, methods, handler) of every route, in registration order."""
        return [
            ("/health_generate", ["GET"], self.health), ("/health", ["GET"], self.health),
            ("/get_model_info", ["GET"], self.model_info), ("/get_server_info", ["GET"], self.server_info),
            ("/get_weight_version", ["GET"], self.weight_version),
            ("/generate", ["POST", "PUT"], self.generate),
            ("/flush_cache", ["GET", "POST"], self.flush_cache),
            ("/pause_generation", ["POST"], self.pause_generation),
            ("/continue_generation", ["POST"], self.continue_generation),
            ("/update_weights_from_disk", ["POST"], self.update_weights_from_disk),
            ("/begin_weight_update", ["POST"], self.begin_weight_update),
            ("/end_weight_update", ["POST"], self.end_weight_update),
            ("/update_weights_from_tensor", ["POST"], self.update_weights_from_tensor),
            ("/update_weights_from_shm", ["POST"], self.update_weights_from_shm),
            ("/init_weights_update_group", ["POST"], self.init_weights_update_group),
            ("/update_weights_from_distributed", ["POST"], self.update_weights_from_distributed),
            ("/destroy_weights_update_group", ["POST"], self.destroy_weights_update_group),
            ("/update_weight_version", ["POST"], self.update_weight_version),
            ("/get_weights_by_name", ["GET", "POST"], self.get_weights_by_name),
            ("/weights_checksum", ["POST"], self.weights_checksum),
            ("/v1/models", ["GET"], self.openai_models),
            ("/v1/chat/completions", ["POST"], self.chat_completions),
            ("/v1/completions", ["POST"], self.completions),
        ]

    async def authenticate(self, request: Request, call_next: Callable):
        """HTTP middleware, installed only with an API key; /health stays open for probes."""
        if request.url.path.startswith("/health") or request.method == "OPTIONS":
            return await call_next(request)
        if not bearer_ok(request, self.api_key):
            return JSONResponse({"error": "Unauthorized"}, status_code=401)  # SGLang's own 401
        return await call_next(request)

    def _set_version(self, version: Optional[str]) -> str:
        """Sets the engine's weight version when given; the sentence to append to the answer."""
        if version is not None:
            self.engine.weight_version = str(version)
            return f" Weight version updated to {version}."
        return ""

    # ---- health and info ----------------------------------------------------------------

    async def health(self) -> Response:
        return Response(status_code=200)

    async def model_info(self) -> dict:
        engine = self.engine
        return {"model_path": engine.model_dir, "tokenizer_path": engine.model_dir, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": engine.weight_version}

    async def server_info(self) -> dict:
        engine = self.engine
        return {"model_path": engine.model_dir, "tp_size": 1, "dp_size": 1, "engine": "embedded",
                "device": str(engine.device),
                "dtype": str(engine.dtype).removeprefix("torch."), "max_batch_size": engine.max_batch_size,
                "context_length": engine.max_context, "weight_version": engine.weight_version,
                "paused": engine.paused,
                # this engine's extension: /generate requests under way and answered so far
                "generate_requests": {"in_flight": self.generate_in_flight, "answered": self.generate_answered,
                                      "answered_on_weight_version": self._answered_on_current()},
                # SGLang's key; fp8-e4m3, fp8-e5m2 or int8 (null: unquantized)
                "quantization": engine.quantization.describe() if engine.quantization else None,
                # this engine's extension: the decode path (engine.embedded.decode) and what it ran
                "decode": engine.decode_info()}

    def _answered_on_current(self) -> int:
        """/generate requests answered since the engine's weight version became the current one
        (a run's versions never repeat)."""
        version, count = self._answered_on
        return count if version == self.engine.weight_version else 0

    # ---- generation ---------------------------------------------------------------------

    async def generate(self, request: Request):
        req = await self._body(request)
        try:  # in a thread: tokenizing a long text must not stall the event loop
            items, single = await asyncio.to_thread(_parse_generate, self.engine, req, self.limits)
        except RequestTooLarge as e:
            raise HTTPException(413, str(e)) from None
        except (EngineError, ValueError, TypeError) as e:
            return _bad_request(str(e))
        done = _all_finished(items)  # set before submitting: a sequence may finish at once
        started = time.monotonic()
        self.generate_in_flight += 1
        try:
            try:
                # this engine's extension: the client sends all it has in this one request, so
                # holding it for the batching window would only add the window to its latency
                self.engine.submit(items, hold=not req.get("skip_batch_window", False))
            except EngineError as e:
                return _bad_request(str(e))
            await done
        finally:
            self.generate_in_flight -= 1
        self.generate_answered += 1
        self._answered_on = (self.engine.weight_version, self._answered_on_current() + 1)
        latency = time.monotonic() - started
        with_text = bool(req.get("return_text_in_logprobs", False))
        outputs = [_render(self.engine, s, with_text, latency) for s in items]
        # A Response, not the list: FastAPI would walk every log-prob through its
        # jsonable_encoder first, which was a third of the server's time for short responses.
        return JSONResponse(outputs[0] if single and len(outputs) == 1 else outputs)

    # ---- the OpenAI-compatible routes (chat/openai_api.py) ------------------------------

    async def openai_models(self) -> dict:
        return {"object": "list", "data": [{"id": self.engine.model_dir, "object": "model",
                                            "owned_by": "megatron-grpo"}]}

    def _openai_sequences(self, prompt_ids: list[int], sampling: Sampling) -> list[Sequence]:
        """The request's ``n`` sequences; OpenAIRequestError (400) or RequestTooLarge (413)."""
        tok = self.engine.tokenizer
        if not prompt_ids or max(prompt_ids) >= len(tok):
            raise OpenAIRequestError("prompt", f"must be token ids below the vocabulary size {len(tok)}")
        max_new = sampling.max_tokens or max(1, self.engine.max_context - len(prompt_ids))
        raw = {"n": sampling.n, "max_new_tokens": max_new,
               "stop_token_ids": stop_token_ids(sampling.stop, tok) + ([tok.eos_token_id] if tok.eos_token_id
                                                                        is not None else [])}
        for key in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(sampling, key) is not None:
                raw[key] = getattr(sampling, key)
        if sampling.seed is not None:
            raw["sampling_seed"] = sampling.seed % 2**63
        try:
            params = resolve_sampling_params(raw)
        except ValueError as e:
            raise OpenAIRequestError(None, str(e)) from None
        too_large = request_size_problem(self.limits, params.n, params.n * (len(prompt_ids) + params.max_new_tokens))
        if too_large:
            raise RequestTooLarge(too_large)
        rid = uuid.uuid4().hex
        return [Sequence(rid=f"{rid}-{j}", prompt_ids=list(prompt_ids), params=params, return_logprob=True,
                         logprob_start_len=-1, return_sampling_mask=False, max_kept=1, return_routed_experts=False)
                for j in range(params.n)]

    async def _openai(self, request: Request, parse: Callable, prompt_of: Callable, answer: Callable):
        """Parse, render, generate, answer: the shared path of the two OpenAI routes."""
        body = await self._body(request)
        try:
            req = parse(body)
            prompt_ids = await asyncio.to_thread(prompt_of, req)
            items = self._openai_sequences(prompt_ids, req.sampling)
        except OpenAIRequestError as e:
            return JSONResponse(error_body(e), status_code=400)
        except RequestTooLarge as e:
            raise HTTPException(413, str(e)) from None
        except Exception as e:  # the chat template refused the conversation (a Jinja error)
            return JSONResponse(error_body(OpenAIRequestError("messages", f"{type(e).__name__}: {e}")), 400)
        done = _all_finished(items)
        try:
            self.engine.submit(items, hold=False)
        except EngineError as e:
            return JSONResponse(error_body(OpenAIRequestError(None, str(e))), status_code=400)
        await done
        choices = [Choice(list(s.output_ids), list(s.output_logprobs), s.finish_reason["type"]) for s in items]
        return JSONResponse(answer(req, prompt_ids, choices, items[0].weight_version))

    async def chat_completions(self, request: Request):
        tok = self.engine.tokenizer
        return await self._openai(
            request, parse_chat_request, lambda req: render_chat(tok, req.messages, req.tools),
            lambda req, ids, choices, version: chat_response(tok, req, ids, choices,
                                                             tool_call_format=self.tool_call_format,
                                                             weight_version=version)[0])

    async def completions(self, request: Request):
        tok = self.engine.tokenizer

        def prompt_of(req) -> list[int]:
            return list(req.prompt) if isinstance(req.prompt, list) else tok.encode(req.prompt,
                                                                                    add_special_tokens=False)

        return await self._openai(
            request, parse_completion_request, prompt_of,
            lambda req, ids, choices, version: completion_response(tok, req, ids, choices, weight_version=version))

    # ---- pause, flush and continue ------------------------------------------------------

    async def flush_cache(self) -> Response:
        # No prefix cache outlives the sequences that share it, so there is nothing to flush: report success.
        return Response(content="Cache flushed.\n", status_code=200)

    async def pause_generation(self, request: Request):
        req = await self._body(request)
        await _in_thread(self.engine.pause, req.get("mode", "abort"))
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation(self):
        self.engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # ---- weight updates from disk, tensor and shm ---------------------------------------

    async def update_weights_from_disk(self, request: Request):
        req = await self._body(request)
        if not isinstance(req.get("model_path"), str) or not req["model_path"]:
            return _bad_request("model_path is required (a directory path string)")
        directory = trusted_weight_dir(self.limits, req["model_path"])
        if directory is None:
            raise HTTPException(403, untrusted_weight_path_message(self.limits))

        def load() -> int:
            with self.engine.exclusive():
                return self.engine.load_from_disk(str(directory), compute_checksums=bool(req.get("compute_checksums")))

        count = await _in_thread(load)
        return _result(True, f"Loaded {count} tensors from {req['model_path']}."
                       + self._set_version(req.get("weight_version")), num_paused_requests=0)

    async def begin_weight_update(self):
        await _in_thread(self.engine.begin_weight_update)
        return _result(True, "Weight update session started.")

    async def end_weight_update(self):
        self.engine.end_weight_update()
        return _result(True, "Weight update session ended.")

    async def update_weights_from_tensor(self, request: Request):
        req = await self._body(request)
        if not self.engine.in_update_session:
            return _bad_request(_NO_SESSION.format(route="update_weights_from_tensor"))
        if req.get("load_format") not in (None, "direct"):
            return _bad_request(f"load_format {req.get('load_format')!r} is not supported (null)")
        serialized = req.get("serialized_named_tensors")
        if not isinstance(serialized, list) or not serialized:
            return _bad_request("serialized_named_tensors must be a non-empty list (one entry per TP rank)")

        lora = _lora_update(req)

        def load() -> int:
            # Deserializing maps the sender's shared memory: in the thread, with the load.
            try:
                named = list(deserialize_named_tensors(serialized[0]))  # this engine is TP rank 0
                lora_base = parse_lora_base(req.get("lora_base"), [n for n, _ in named])
            except ValueError as e:
                raise EngineError(str(e)) from None
            plan = self.engine.lora_plan([n for n, _ in named], [list(t.shape) for _, t in named],
                                         [t.dtype for _, t in named], lora=lora, lora_base=lora_base)
            return self.engine.take(named, compute_checksums=bool(req.get("compute_checksums")), lora=lora,
                                    plan=plan, lora_base=lora_base)

        count = await _in_thread(load)
        return _result(True, f"Loaded {count} tensors." + self._set_version(req.get("weight_version")))

    async def update_weights_from_shm(self, request: Request):
        # embedded only: the CPU tensor transport's cheaper wire (wire/shm.py)
        req = await self._body(request)
        if not self.engine.in_update_session:
            return _bad_request(_NO_SESSION.format(route="update_weights_from_shm"))
        try:
            kwargs = dict(path=str(req["path"]), names=list(req["names"]), dtypes=list(req["dtypes"]),
                          shapes=[list(s) for s in req["shapes"]])
        except (KeyError, TypeError) as e:
            return _bad_request(f"bad update_weights_from_shm request: {type(e).__name__}: {e}")
        count = await _in_thread(self.engine.receive_shm, **kwargs, **_lora_keys(req, kwargs["names"]),
                                 compute_checksums=bool(req.get("compute_checksums")))
        return _result(True, f"Loaded {count} tensors." + self._set_version(req.get("weight_version")))

    # ---- the distributed weight-update group --------------------------------------------

    async def init_weights_update_group(self, request: Request):
        req = await self._body(request)
        try:
            kwargs = dict(master_address=str(req["master_address"]), master_port=int(req["master_port"]),
                          rank_offset=int(req["rank_offset"]), world_size=int(req["world_size"]),
                          backend=str(req.get("backend", "gloo")))
        except (KeyError, TypeError, ValueError) as e:
            return _bad_request(f"bad init_weights_update_group request: {e}")
        problem = rendezvous_problem(self.limits, master_address=kwargs["master_address"],
                                     rank_offset=kwargs["rank_offset"], world_size=kwargs["world_size"])
        if problem is not None:
            return _bad_request(problem)
        if kwargs["backend"] not in self.engine.backends:
            return _bad_request(f"backend {kwargs['backend']!r} is not supported on this engine "
                                f"({', '.join(self.engine.backends)} on {self.engine.device})")
        group_name = str(req.get("group_name", "weight_update_group"))
        # Not _in_thread: a failed rendezvous is a success=false answer, not a raised 400.
        try:
            await asyncio.to_thread(self.engine.init_group, group_name, **kwargs)
        except EngineError as e:
            return _bad_request(str(e))
        except Exception as e:  # noqa: BLE001 - rendezvous failures are the caller's to see
            return _result(False, f"Failed to init group {group_name}: {type(e).__name__}: {e}")
        return _result(True, f"Initialized weight update group {group_name}.")

    async def update_weights_from_distributed(self, request: Request):
        req = await self._body(request)
        if not self.engine.in_update_session:
            return _bad_request(_NO_SESSION.format(route="update_weights_from_distributed"))
        try:
            names = list(req["names"])
            count = await _in_thread(self.engine.receive_distributed, names=names,
                                     dtypes=list(req["dtypes"]), shapes=[list(s) for s in req["shapes"]],
                                     group_name=str(req.get("group_name", "weight_update_group")),
                                     load_format=req.get("load_format"), **_lora_keys(req, names),
                                     compute_checksums=bool(req.get("compute_checksums")))
        except KeyError as e:
            return _bad_request(f"missing key {e}")
        except HTTPException:  # an EngineError, already a 400
            raise
        except Exception as e:  # noqa: BLE001 - a broken broadcast: report, stay alive
            return _result(False, f"Failed to update parameter online: {type(e).__name__}: {e}")
        return _result(True, f"Loaded {count} tensors." + self._set_version(req.get("weight_version")))

    async def destroy_weights_update_group(self, request: Request):
        req = await self._body(request)
        await _in_thread(self.engine.destroy_group, str(req.get("group_name", "weight_update_group")))
        return _result(True, "Destroyed weight update group.")

    # ---- weight version -----------------------------------------------------------------

    async def weight_version(self) -> dict:
        return {"weight_version": self.engine.weight_version}

    async def update_weight_version(self, request: Request):
        req = await self._body(request)
        if "new_version" not in req:
            return _bad_request("new_version is required")
        self._set_version(req["new_version"])
        return _result(True, f"Weight version updated to {req['new_version']}", new_version=str(req["new_version"]))

    # ---- weight inspection and checksums ------------------------------------------------

    async def get_weights_by_name(self, request: Request):
        req = await self._body(request)
        truncate = req.get("truncate_size", 100)
        if type(truncate) is not int or truncate < 0:
            raise HTTPException(400, f"truncate_size must be a non-negative integer, got {truncate!r:.40}")
        return await _in_thread(self.engine.weights_by_name, str(req.get("name")), truncate)

    async def weights_checksum(self, request: Request):
        req = await self._body(request)
        names = req.get("names")
        if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise HTTPException(400, "names must be a list of parameter names, or null for all")
        return {"weight_version": self.engine.weight_version,
                "checksums": await _in_thread(self.engine.checksums, names)}


def _parse_generate(engine: EmbeddedEngine, req: dict, limits: RequestLimits) -> tuple[list[Sequence], bool]:
    """A /generate body -> the sequences to run (prompt-major with n) and whether it was single.
    RequestTooLarge past ``limits``'s bounds, checked before any sequence is built."""
    unknown = sorted(set(req) - _GENERATE_KEYS)
    if unknown:
        raise EngineError(f"unknown /generate key(s) {unknown}")
    for key, default in _GENERATE_DEFAULTS.items():
        if key in req and req[key] != default:
            raise EngineError(f"/generate {key}={req[key]!r} is not supported by the embedded engine")
    if req.get("input_ids") is not None:
        prompts = req["input_ids"]
    elif req.get("text") is not None:
        texts = req["text"] if isinstance(req["text"], list) else [req["text"]]
        for t in texts:
            if isinstance(t, str):
                try:
                    check_text("text", t)
                except OpenAIRequestError as e:
                    raise EngineError(str(e)) from None
        prompts = [engine.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        prompts = prompts if isinstance(req["text"], list) else prompts[0]
    else:
        raise EngineError("/generate needs input_ids or text")
    single = bool(prompts) and isinstance(prompts[0], int)
    if single or not prompts:
        prompts = [prompts]
    if not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise EngineError("input_ids must be a non-empty list of token ids or a list of such lists")
    count = len(prompts)
    too_large = request_size_problem(limits, count, 0)  # every input is at least one sequence
    if too_large:
        raise RequestTooLarge(too_large)
    params = [resolve_sampling_params(p) for p in _per_item(req.get("sampling_params"), count, "sampling_params")]
    too_large = request_size_problem(limits, sum(p.n for p in params),
                                     sum(p.n * (len(prompt) + p.max_new_tokens) for prompt, p in zip(prompts, params)))
    if too_large:
        raise RequestTooLarge(too_large)
    starts = _per_item(req.get("logprob_start_len", -1), count, "logprob_start_len")
    returns = _per_item(req.get("return_logprob", False), count, "return_logprob")
    routed = _per_item(req.get("return_routed_experts", False), count, "return_routed_experts")
    masks = _per_item(req.get("return_sampling_mask", False), count, "return_sampling_mask")
    budgets = _per_item(req.get("sampling_mask_max_kept", 1024), count, "sampling_mask_max_kept")
    if not isinstance(req.get("skip_batch_window", False), bool):
        raise EngineError(f"skip_batch_window must be true or false, got {req['skip_batch_window']!r}")
    rid = str(req.get("rid") or uuid.uuid4().hex)
    seqs = []
    for i, (prompt, p, start, ret, rout, mask, budget) in enumerate(
            zip(prompts, params, starts, returns, routed, masks, budgets)):
        start = -1 if start is None else start
        if not isinstance(start, int) or isinstance(start, bool):
            raise EngineError(f"logprob_start_len must be an integer, got {start!r}")
        for key, flag in (("return_logprob", ret), ("return_routed_experts", rout), ("return_sampling_mask", mask)):
            if not isinstance(flag, bool):
                raise EngineError(f"{key} must be true or false, got {flag!r}")
        if start >= len(prompt):
            raise EngineError(f"logprob_start_len {start} must be < the prompt length {len(prompt)}")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise EngineError(f"sampling_mask_max_kept must be an integer >= 1, got {budget!r}")
        for j in range(p.n):
            seqs.append(Sequence(rid=f"{rid}-{i}-{j}", prompt_ids=list(prompt), params=p,
                                 return_logprob=bool(ret), logprob_start_len=start if ret else -1,
                                 return_sampling_mask=bool(mask), max_kept=budget,
                                 return_routed_experts=bool(rout)))
    return seqs, single


def _render(engine: EmbeddedEngine, s: Sequence, with_text: bool, latency: float) -> dict:
    """One SGLang /generate answer item."""
    tok = engine.tokenizer
    text = tok.decode(s.output_ids, skip_special_tokens=s.params.skip_special_tokens)
    meta: dict[str, Any] = {
        "id": s.rid,
        "finish_reason": s.finish_reason,
        "prompt_tokens": len(s.prompt_ids),
        "completion_tokens": len(s.output_ids),
        "cached_tokens": 0,
        "weight_version": s.weight_version,
        "e2e_latency": latency,
    }
    if s.return_logprob:
        def token_text(t: int) -> Optional[str]:
            return tok.decode([t]) if with_text else None

        meta["output_token_logprobs"] = [[lp, t, token_text(t)] for lp, t in zip(s.output_logprobs, s.output_ids)]
        # this engine's extension: the weight version of each token's draw (rollout.mode async)
        meta["output_token_versions"] = list(s.output_versions)
        if s.input_logprobs is not None:
            tokens = s.prompt_ids[s.logprob_start_len:]
            meta["input_token_logprobs"] = [[lp, t, token_text(t)] for lp, t in zip(s.input_logprobs, tokens)]
    if s.return_sampling_mask:  # this engine's extension: what each draw could pick
        meta["sampling_mask"] = {"kept_ids": s.output_kept_ids, "log_kept_mass": s.output_log_kept_mass}
    if s.return_routed_experts and s.routed_blocks:
        meta["routed_experts"] = routed_experts.encode(s.routed_experts)
    return {"text": text, "output_ids": list(s.output_ids), "meta_info": meta}
