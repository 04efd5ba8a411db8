"""One client for SGLang's native HTTP API (and the embedded engine, which speaks the same API).

``AsyncRolloutClient`` does the work: httpx async, many requests in flight (bounded by a
semaphore), a bounded timeout on every request, retries with exponential back-off on
connection failures and 5xx answers, and one-line ``RolloutError``s naming the server and
the route. Several servers are used round-robin (a retry of an unpinned request moves on to
the next server). ``RolloutClient`` is the synchronous facade the trainer uses: it owns an
event loop in a daemon thread, so the trainer's ranks never need asyncio; ``submit`` returns a
``concurrent.futures.Future`` for the weight-sync code, which must post a request and join a
broadcast at the same time.

Route and payload shapes are SGLang 0.5.23's (checked against the real server by
``tests/test_sglang_contract.py``):

* ``POST /generate`` with ``input_ids`` (a list of prompts), ``sampling_params`` (one dict or
  one per item), ``return_logprob``, ``logprob_start_len``; the answer is a list (prompt-major
  when ``n > 1``) of ``{"text", "output_ids", "meta_info": {"finish_reason": {"type": ...},
  "weight_version", "output_token_logprobs": [[logprob, token_id, text_or_null], ...], ...}}``.
* weight routes answer ``{"success": bool, "message": str}``; ``success: false`` is an error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from typing import Any, Awaitable, Optional, Sequence

import httpx

from megatron_grpo.config.engine import EngineConfig
from megatron_grpo.wire import routed_experts
from megatron_grpo.wire.samples import RolloutError, Sample, SamplingParams

# route name -> (HTTP method, path). The single list of routes this package talks to.
ROUTES: dict[str, tuple[str, str]] = {
    "health": ("GET", "/health"),
    "get_model_info": ("GET", "/get_model_info"),
    "get_server_info": ("GET", "/get_server_info"),
    "generate": ("POST", "/generate"),
    "flush_cache": ("POST", "/flush_cache"),
    "pause_generation": ("POST", "/pause_generation"),
    "continue_generation": ("POST", "/continue_generation"),
    "update_weights_from_disk": ("POST", "/update_weights_from_disk"),
    "begin_weight_update": ("POST", "/begin_weight_update"),
    "end_weight_update": ("POST", "/end_weight_update"),
    "update_weights_from_tensor": ("POST", "/update_weights_from_tensor"),
    "init_weights_update_group": ("POST", "/init_weights_update_group"),
    "update_weights_from_distributed": ("POST", "/update_weights_from_distributed"),
    "destroy_weights_update_group": ("POST", "/destroy_weights_update_group"),
    "update_weight_version": ("POST", "/update_weight_version"),
    "get_weights_by_name": ("POST", "/get_weights_by_name"),
    # Embedded engine only: per-tensor checksums of the served weights (sync verification).
    "weights_checksum": ("POST", "/weights_checksum"),
    # Embedded engine only: a flattened bucket in a /dev/shm segment (wire/shm.py).
    "update_weights_from_shm": ("POST", "/update_weights_from_shm"),
}

# Answers worth retrying: the server (or a proxy in front of it) is restarting or overloaded.
_RETRY_STATUS = frozenset({502, 503, 504})
_CONNECT_TIMEOUT_S = 10.0
FLUSH_IDLE_WAIT_S = 60.0  # how long a flush retries while the engine is busy (``flush_cache``)
_FLUSH_RETRY_S = 0.2
_MAX_BACKOFF_S = 8.0


def _error_text(response: httpx.Response) -> str:
    """The server's own error message, on one line and bounded in length."""
    try:
        body = response.json()
    except ValueError:
        text = response.text
    else:
        if isinstance(body, dict):
            inner = body.get("error")
            if isinstance(inner, dict):
                inner = inner.get("message")
            text = str(body.get("message") or body.get("detail") or inner or body)
        else:
            text = str(body)
    text = " ".join(text.split())
    return text[:500] + ("..." if len(text) > 500 else "")


class AsyncRolloutClient:
    """Async client for one or more SGLang-API servers (``urls`` used round-robin)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        api_key: Optional[str] = None,
        request_timeout_s: float = 600.0,
        max_retries: int = 3,
        max_inflight_requests: int = 64,
        backoff_s: float = 0.5,
        sequences_per_request: Optional[int] = None,
        mask_budget_per_request: bool = True,
    ):
        if not urls:
            raise ValueError("AsyncRolloutClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.sequences_per_request = sequences_per_request
        self.mask_budget_per_request = mask_budget_per_request  # EngineAdapter.sampling_mask_budget_per_request
        self._generating = 0  # generate() calls in flight (async rollouts and episodes overlap them)
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(request_timeout_s, connect=min(_CONNECT_TIMEOUT_S, request_timeout_s))
        self._http: Optional[httpx.AsyncClient] = None
        self._max_inflight = max_inflight_requests
        self._inflight: Optional[asyncio.Semaphore] = None
        self._round_robin = itertools.count()

    async def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            limits = httpx.Limits(max_connections=self._max_inflight, max_keepalive_connections=self._max_inflight)
            self._http = httpx.AsyncClient(timeout=self._timeout, limits=limits, headers=self._headers)
            self._inflight = asyncio.Semaphore(self._max_inflight)
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def next_url(self) -> str:
        """The next server in round-robin order."""
        return self.urls[next(self._round_robin) % len(self.urls)]

    async def call(
        self,
        route: str | tuple[str, str],
        body: Optional[dict] = None,
        *,
        url: Optional[str] = None,
        timeout_s: Optional[float] = None,
        retry: bool = True,
    ) -> Any:
        """Send one request to ``route`` (a key of ``ROUTES``, or the (method, path) of a route
        only one engine adapter uses) and return the decoded answer.

        ``url`` pins the server (weight updates go to every server explicitly); without it
        the request goes round-robin and a retry moves on to the next server. Retries
        connection failures and 502/503/504 with exponential back-off; raises RolloutError
        on a 4xx/5xx answer, ``success: false``, a timeout, or when the retries run out.
        """
        return (await self._call(route, body, url=url, timeout_s=timeout_s, retry=retry))[1]

    async def _call(self, route: str | tuple[str, str], body: Optional[dict], *, url: Optional[str],
                    timeout_s: Optional[float], retry: bool) -> tuple[str, Any]:
        """``call`` that also returns the server which answered."""
        method, path = route if isinstance(route, tuple) else ROUTES[route]
        http = await self._client()
        attempts = self.max_retries if retry else 1
        timeout = httpx.Timeout(timeout_s, connect=min(_CONNECT_TIMEOUT_S, timeout_s)) if timeout_s else None
        server = url or self.next_url()
        last_error = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 1), _MAX_BACKOFF_S))
                if url is None:
                    server = self.next_url()
            try:
                async with self._inflight:
                    kwargs: dict[str, Any] = {"timeout": timeout} if timeout else {}
                    if method == "POST":
                        kwargs["json"] = body if body is not None else {}
                    response = await http.request(method, server + path, **kwargs)
            except httpx.TimeoutException as e:
                # A slow server is not retried: waiting again would multiply the bound.
                bound = timeout_s or self.request_timeout_s
                raise RolloutError(server, f"{method} {path}",
                                   f"no answer within {bound:.0f}s ({type(e).__name__})") from None
            except httpx.TransportError as e:
                last_error = f"{type(e).__name__}: {e or 'connection failed'}"
                continue
            if response.status_code in _RETRY_STATUS:
                last_error = f"HTTP {response.status_code}: {_error_text(response)}"
                continue
            if response.status_code >= 400:
                raise RolloutError(server, f"{method} {path}",
                                   f"HTTP {response.status_code}: {_error_text(response)}",
                                   status=response.status_code)
            return server, self._decode(response, server, f"{method} {path}")
        raise RolloutError(server, f"{method} {path}", f"failed after {attempts} attempts: {last_error}")

    @staticmethod
    def _decode(response: httpx.Response, server: str, route: str) -> Any:
        if "json" not in response.headers.get("content-type", ""):
            return response.text
        data = response.json()
        if isinstance(data, dict) and data.get("success") is False:
            raise RolloutError(server, route, f"success=false: {' '.join(str(data.get('message')).split())}")
        return data

    # ---- generation -------------------------------------------------------------------

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        *,
        sampling_seed: Optional[int] = None,
        return_routed_experts: bool = False,
    ) -> list[Sample]:
        """``n`` responses for each prompt, prompt-major (``[p0s0, p0s1, ..., p1s0, ...]``).
        ``return_routed_experts``: ask for the MoE routing (``Sample.routed_experts``).

        One request per prompt (or, with ``sequences_per_request``, per run of consecutive
        prompts whose ``n`` samples fit it, and at least one per server), all in flight at
        once, spread round-robin over the servers. With ``sampling_seed`` every response gets
        its own seed ``sampling_seed + k`` (k its index in the returned list), so a run is
        reproducible whatever the batching; SGLang would otherwise give the ``n`` copies of a
        request the same seed and the same answer. ``sequences_per_request`` is for the embedded
        engine, whose extension ``skip_batch_window`` these requests also set while this call is
        the client's only one in flight (a synchronous step's whole batch): the engine's
        batching window, there for concurrent requests to share a prefill, would only delay
        them. Overlapping calls (asynchronous rollouts, multi-turn episodes) keep the window.
        """
        chunks = request_chunks(len(prompts), n, self.sequences_per_request, len(self.urls))
        self._generating += 1
        try:
            tasks = [
                self._generate_groups(range(start, stop), [list(prompts[i]) for i in range(start, stop)], n,
                                      sampling, None if sampling_seed is None else sampling_seed + start * n,
                                      return_routed_experts)
                for start, stop in chunks
            ]
            groups = await asyncio.gather(*tasks)
        finally:
            self._generating -= 1
        return [s for group in groups for s in group]

    async def _generate_groups(self, indices: range, prompts: list[list[int]], n: int,
                               sampling: SamplingParams, seed: Optional[int],
                               return_routed_experts: bool = False) -> list[Sample]:
        """The ``n`` samples of each of ``prompts`` (prompt-major) from one request;
        ``indices``: their prompt indices, ``seed``: the first sample's seed."""
        if seed is None:
            params = dict(sampling.to_json(), n=n)
            body = {"input_ids": prompts, "sampling_params": params}
        else:
            body = {"input_ids": [p for p in prompts for _ in range(n)],
                    "sampling_params": [sampling.to_json(sampling_seed=seed + k) for k in range(len(prompts) * n)]}
        body.update(return_logprob=True, logprob_start_len=-1)
        if self.sequences_per_request and self._generating == 1:  # the embedded engine's extension
            body["skip_batch_window"] = True
        if return_routed_experts:  # only then: SGLang without the feature rejects the key
            body["return_routed_experts"] = True
        with_mask = sampling.sampling_mask_max_kept > 0
        if with_mask:  # SGLang's key; the budget is the embedded engine's extension (SGLang's is a launch arg)
            body["return_sampling_mask"] = True
            if self.mask_budget_per_request:
                body["sampling_mask_max_kept"] = sampling.sampling_mask_max_kept
        server, items = await self._call("generate", body, url=None, timeout_s=None, retry=True)
        expected = len(prompts) * n
        if not isinstance(items, list) or len(items) != expected:
            got = len(items) if isinstance(items, list) else type(items).__name__
            raise RolloutError(server, "POST /generate", f"expected {expected} responses, got {got}")
        return [parse_generate_item(item, prompts[k // n], indices[k // n], k % n, server, return_routed_experts,
                                    with_mask)
                for k, item in enumerate(items)]

    # ---- control and weight routes (thin wrappers; bodies as SGLang 0.5.23 expects) ----
    # ``extra`` adds engine-specific keys (the embedded engine's ``compute_checksums``); SGLang
    # rejects unknown keys, so callers only pass it to engines that accept it.

    async def health(self, url: str, timeout_s: float = 10.0) -> bool:
        """True when ``url`` answers /health with 200 (no retries: a probe)."""
        try:
            await self.call("health", url=url, timeout_s=timeout_s, retry=False)
            return True
        except RolloutError:
            return False

    async def pause_generation(self, url: str, mode: str = "abort") -> Any:
        return await self.call("pause_generation", {"mode": mode}, url=url)

    async def continue_generation(self, url: str) -> Any:
        return await self.call("continue_generation", {}, url=url)

    async def flush_cache(self, url: str, idle_wait_s: float = FLUSH_IDLE_WAIT_S) -> Any:
        """Flush ``url``'s prefix cache, retrying for up to ``idle_wait_s`` while it is busy.

        SGLang refuses a flush while a request is still running (HTTP 400, "Flush cache
        failed"), which a request's answer can precede by a scheduler iteration (seen right
        after a generate returned). Its own deferral (``/flush_cache?timeout=``) is no use here:
        it waits for the waiting queue to empty too, which never happens while generation is
        paused with requests queued (a sync's pause), where an immediate flush succeeds. So the
        immediate flush is retried. The embedded engine has nothing to flush: it always answers 200."""
        deadline = time.monotonic() + idle_wait_s
        while True:
            try:
                return await self.call("flush_cache", {}, url=url)
            except RolloutError as e:
                if e.status != 400 or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(_FLUSH_RETRY_S)

    async def update_weights_from_disk(self, url: str, model_path: str, *,
                                       weight_version: Optional[str] = None,
                                       load_format: Optional[str] = None, extra: Optional[dict] = None) -> Any:
        body = {"model_path": model_path, "load_format": load_format, "weight_version": weight_version,
                **(extra or {})}
        return await self.call("update_weights_from_disk", body, url=url, retry=False)

    async def update_weights_from_tensor(self, url: str, serialized_named_tensors: list[str], *,
                                         load_format: Optional[str] = None,
                                         weight_version: Optional[str] = None,
                                         flush_cache: bool = False, extra: Optional[dict] = None) -> Any:
        body = {"serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
                "flush_cache": flush_cache, "weight_version": weight_version, **(extra or {})}
        return await self.call("update_weights_from_tensor", body, url=url, retry=False)

    async def update_weights_from_shm(self, url: str, *, path: str, names: list[str], dtypes: list[str],
                                      shapes: list[list[int]], extra: Optional[dict] = None) -> Any:
        body = {"path": path, "names": names, "dtypes": dtypes, "shapes": shapes, **(extra or {})}
        return await self.call("update_weights_from_shm", body, url=url, retry=False)

    async def init_weights_update_group(self, url: str, *, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, group_name: str,
                                        backend: str = "gloo") -> Any:
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}
        return await self.call("init_weights_update_group", body, url=url, retry=False)

    async def update_weights_from_distributed(self, url: str, *, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              load_format: Optional[str] = None,
                                              weight_version: Optional[str] = None,
                                              flush_cache: bool = False, extra: Optional[dict] = None) -> Any:
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                "load_format": load_format, "flush_cache": flush_cache, "weight_version": weight_version,
                **(extra or {})}
        return await self.call("update_weights_from_distributed", body, url=url, retry=False)

    async def prompt_logprobs(self, url: str, token_ids: Sequence[int]) -> list[float]:
        """The server's log-probs of ``token_ids[1:]`` given their prefixes (SGLang's input
        log-probs are at temperature 1 whatever the request's temperature; one token is generated
        and ignored)."""
        body = {"input_ids": [list(token_ids)], "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 1}}
        items = await self.call("generate", body, url=url)
        try:
            pairs = items[0]["meta_info"]["input_token_logprobs"]
            values = [float(lp) for lp, _, _ in pairs[1:]]  # the first token has no log-prob
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise RolloutError(url, "POST /generate", f"no input_token_logprobs in the answer ({e})") from None
        if len(values) != len(token_ids) - 1:
            raise RolloutError(url, "POST /generate", f"expected {len(token_ids) - 1} input log-probs, "
                               f"got {len(values)}")
        return values

    async def destroy_weights_update_group(self, url: str, group_name: str) -> Any:
        return await self.call("destroy_weights_update_group", {"group_name": group_name}, url=url)

    async def update_weight_version(self, url: str, version: str) -> Any:
        # SGLang 0.5.23's route aborts every request by default: sequences retracted for an
        # asynchronous sync must survive it (the embedded engine never aborts here)
        return await self.call("update_weight_version", {"new_version": version, "abort_all_requests": False},
                               url=url)

    async def weight_version(self, url: str) -> str:
        # SGLang 0.5.23 has no /get_weight_version; /get_model_info carries the version.
        return str((await self.call("get_model_info", url=url))["weight_version"])


def versions_from_spans(spans: list[dict], num_tokens: int) -> list[str]:
    """Per-token weight versions from SGLang's ``meta_info["weight_versions"]``: spans
    ``{"version", "start", "end"}`` that must tile the output tokens ``[0, num_tokens)`` in order
    (SGLang records where each label change found the sequence: a token before ``end`` was drawn
    under ``version``); ValueError otherwise."""
    versions: list[str] = []
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if start != len(versions) or end < start:
            raise ValueError(f"weight_versions span [{start}, {end}) does not continue at token {len(versions)}")
        versions += [str(span["version"])] * (end - start)
    if len(versions) != num_tokens:
        raise ValueError(f"weight_versions cover {len(versions)} of {num_tokens} output tokens")
    return versions


def parse_sampling_mask(meta: dict, output_ids: list[int],
                        output_logprobs: Optional[list[float]] = None) -> tuple[list[Optional[list[int]]], list[float]]:
    """(kept ids, log kept masses) per output token: from the embedded engine's
    ``meta_info["sampling_mask"]``, or from SGLang's ``output_token_sampling_mask`` (the ids) and
    ``output_token_sampling_logprobs`` (the sampled token's log-prob renormalised over them),
    whose log kept mass is ``output_logprobs - sampling_logprobs`` (log p = log q + log mass).
    ValueError when missing, of the wrong length, or a sent set lacks its sampled token."""
    if "sampling_mask" not in meta and "output_token_sampling_mask" in meta:  # SGLang
        kept = meta["output_token_sampling_mask"]
        truncated = [float(lp) for lp in meta["output_token_sampling_logprobs"]]
        if output_logprobs is None or len(truncated) != len(output_logprobs):
            raise ValueError(f"{len(truncated)} sampling log-probs for "
                             f"{'no' if output_logprobs is None else len(output_logprobs)} output log-probs")
        mass = [full - lq for full, lq in zip(output_logprobs, truncated)]
    else:
        mask = meta["sampling_mask"]
        kept, mass = mask["kept_ids"], [float(m) for m in mask["log_kept_mass"]]
    if len(kept) != len(output_ids) or len(mass) != len(output_ids):
        raise ValueError(f"{len(kept)} kept sets and {len(mass)} masses for {len(output_ids)} tokens")
    kept = [None if ids is None else [int(i) for i in ids] for ids in kept]
    for j, (ids, token) in enumerate(zip(kept, output_ids)):
        if ids is not None and token not in ids:
            raise ValueError(f"token {j} ({token}) is not in its own kept set")
    return kept, mass


def request_chunks(num_prompts: int, n: int, sequences_per_request: Optional[int],
                   num_servers: int) -> list[tuple[int, int]]:
    """[start, stop) prompt ranges, one /generate request each: one prompt per request without
    ``sequences_per_request``; else as few requests as hold ``n`` samples of every prompt
    within the bound (always whole groups, at least one prompt each), but at least one per
    server so that round-robin keeps every server busy. Consecutive and in order."""
    if not sequences_per_request:
        return [(i, i + 1) for i in range(num_prompts)]
    per = max(1, sequences_per_request // max(n, 1))
    count = min(num_prompts, max(-(-num_prompts // per), num_servers))
    bounds = [round(i * num_prompts / count) for i in range(count + 1)] if count else [0]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def parse_generate_item(item: dict, prompt: list[int], prompt_index: int, sample_index: int,
                        server: str, with_routing: bool = False, with_mask: bool = False) -> Sample:
    """One SGLang /generate answer item -> Sample (checks the log-probs match the tokens)."""
    route = "POST /generate"
    try:
        meta = item["meta_info"]
        token_logprobs = meta["output_token_logprobs"]
        output_ids = [int(t) for t in item.get("output_ids", [tok for _, tok, _ in token_logprobs])]
        finish = meta["finish_reason"]
        weight_version = str(meta.get("weight_version", ""))
        versions = meta.get("output_token_versions")  # the embedded engine's extension
        if versions is None and meta.get("weight_versions") is not None:  # SGLang's spans
            versions = versions_from_spans(meta["weight_versions"], len(output_ids))
        versions = None if versions is None else [str(v) for v in versions]
    except (KeyError, TypeError, ValueError) as e:
        raise RolloutError(server, route, f"malformed answer item ({type(e).__name__}: {e})") from None
    if [int(tok) for _, tok, _ in token_logprobs] != output_ids:
        raise RolloutError(server, route, "output_token_logprobs do not match output_ids")
    if versions is not None and len(versions) != len(output_ids):
        raise RolloutError(server, route, f"{len(versions)} output_token_versions for {len(output_ids)} output tokens")
    reason = finish.get("type", "unknown") if isinstance(finish, dict) else str(finish or "unknown")
    routed = None
    if with_routing:
        try:
            routed = routed_experts.decode(meta["routed_experts"], len(prompt) + len(output_ids) - 1)
        except (KeyError, TypeError, ValueError) as e:
            raise RolloutError(server, route, f"routed_experts missing or malformed ({type(e).__name__}: {e})") from None
    output_logprobs = [float(lp) for lp, _, _ in token_logprobs]
    kept = mass = None
    if with_mask:
        try:
            kept, mass = parse_sampling_mask(meta, output_ids, output_logprobs)
        except (KeyError, TypeError, ValueError) as e:
            raise RolloutError(server, route, f"sampling_mask missing or malformed ({type(e).__name__}: {e})") from None
    return Sample(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_ids=list(prompt),
        output_ids=output_ids,
        output_logprobs=output_logprobs,
        finish_reason=reason,
        weight_version=weight_version,
        output_versions=versions,
        server=server,
        routed_experts=routed,
        kept_ids=kept,
        log_kept_mass=mass,
    )


class RolloutClient:
    """Synchronous facade over ``AsyncRolloutClient`` (an event loop in a daemon thread).

    Every blocking call is bounded: it waits at most the per-attempt timeout times the
    number of attempts plus the back-off, and then raises RolloutError.
    """

    def __init__(self, urls: Sequence[str], **kwargs: Any):
        self.aio = AsyncRolloutClient(urls, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, engine_cfg: EngineConfig, urls: Optional[Sequence[str]] = None, *,
                    sequences_per_request: Optional[int] = None,
                    mask_budget_per_request: bool = True) -> "RolloutClient":
        """A client for ``urls`` (default ``engine_cfg.urls``) with the key, timeouts and
        concurrency of the ``engine:`` section; ``sequences_per_request``: see
        ``AsyncRolloutClient.generate``; ``mask_budget_per_request``: the engine's
        ``sampling_mask_budget_per_request``."""
        return cls(
            list(urls if urls is not None else engine_cfg.urls),
            api_key=engine_cfg.api_key,
            request_timeout_s=engine_cfg.request_timeout_s,
            max_retries=engine_cfg.max_retries,
            max_inflight_requests=engine_cfg.max_inflight_requests,
            sequences_per_request=sequences_per_request,
            mask_budget_per_request=mask_budget_per_request,
        )

    @property
    def urls(self) -> list[str]:
        return self.aio.urls

    def submit(self, coro: Awaitable[Any]) -> concurrent.futures.Future:
        """Schedule a coroutine of ``self.aio`` on the client's loop; returns its Future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _bound_s(self, timeout_s: Optional[float] = None) -> float:
        per_attempt = (timeout_s or self.aio.request_timeout_s) + _CONNECT_TIMEOUT_S
        backoff = sum(min(self.aio.backoff_s * 2**i, _MAX_BACKOFF_S) for i in range(self.aio.max_retries))
        return per_attempt * self.aio.max_retries + backoff + 5.0

    def run(self, coro: Awaitable[Any], timeout_s: Optional[float] = None) -> Any:
        """Run a coroutine of ``self.aio`` to completion (bounded, see class docstring)."""
        future = self.submit(coro)
        try:
            return future.result(timeout=self._bound_s(timeout_s))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RolloutError(",".join(self.urls), "client", "request did not finish in time") from None

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams, *,
                 sampling_seed: Optional[int] = None, return_routed_experts: bool = False) -> list[Sample]:
        """``n`` samples per prompt, prompt-major; see ``AsyncRolloutClient.generate``."""
        return self.run(self.aio.generate(prompts, n, sampling, sampling_seed=sampling_seed,
                                          return_routed_experts=return_routed_experts))

    def call(self, route: str | tuple[str, str], body: Optional[dict] = None, *, url: Optional[str] = None,
             timeout_s: Optional[float] = None, retry: bool = True) -> Any:
        return self.run(self.aio.call(route, body, url=url, timeout_s=timeout_s, retry=retry), timeout_s)

    def health(self, url: str, timeout_s: float = 10.0) -> bool:
        return self.run(self.aio.health(url, timeout_s), timeout_s)

    def model_info(self, url: str) -> dict:
        return self.call("get_model_info", url=url)

    def server_info(self, url: str) -> dict:
        return self.call("get_server_info", url=url)

    def weight_version(self, url: str) -> str:
        return self.run(self.aio.weight_version(url))

    def pause_generation(self, url: str, mode: str = "abort") -> Any:
        return self.run(self.aio.pause_generation(url, mode))

    def continue_generation(self, url: str) -> Any:
        return self.run(self.aio.continue_generation(url))

    def flush_cache(self, url: str, idle_wait_s: float = FLUSH_IDLE_WAIT_S) -> Any:
        return self.run(self.aio.flush_cache(url, idle_wait_s))

    def begin_weight_update(self, url: str) -> Any:
        return self.call("begin_weight_update", {}, url=url)

    def end_weight_update(self, url: str) -> Any:
        return self.call("end_weight_update", {}, url=url)

    def update_weight_version(self, url: str, version: str) -> Any:
        return self.run(self.aio.update_weight_version(url, version))

    def prompt_logprobs(self, url: str, token_ids: Sequence[int]) -> list[float]:
        return self.run(self.aio.prompt_logprobs(url, token_ids))

    def close(self) -> None:
        """Close connections and stop the loop thread (idempotent)."""
        if self._loop.is_closed():
            return
        try:
            self.submit(self.aio.aclose()).result(timeout=10)
        except Exception:  # noqa: BLE001 - closing must not raise over a dead server
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
