"""A reward computed by an HTTP server (a verifier, a sandbox, a reward model).

``reward.functions[i]`` with ``name: remote`` and a ``remote:`` section (url, timeout_s,
max_retries, api_key_env; ``max_concurrency`` on the function bounds the requests in
flight). For every response the trainer POSTs the ``RewardSample`` as JSON::

    {"prompt": "...", "response": "...", "answer": "...", "response_ids": [...],
     "prompt_ids": [...], "finish_reason": "stop", "row": {...}}

and expects ``{"reward": <finite number>}`` back (HTTP 200). Every wait is bounded:

* no answer within ``timeout_s`` (the whole request, however slowly the server trickles
  bytes), a connection error, or HTTP 429/5xx: retried up to ``max_retries`` times with
  a short back-off; each retry is counted (``reward/<label>/retries`` in metrics.jsonl);
  when the retries are used up, a one-line ``RewardError``;
* any other HTTP status, a body that is not JSON, or JSON without a finite ``reward``: a
  one-line ``RewardError`` at once (retrying a server bug would only hide it);
* an answer over ``MAX_ANSWER_BYTES``, as sent or once decompressed (a gzip bomb is read a
  chunk at a time and dropped at the limit): "too large", at once.

So a hung server costs at most ``timeout_s * (max_retries + 1)`` plus the back-off per
response, and the run stops with a line naming the URL and the sample, never a hang.
"""

from __future__ import annotations

import asyncio
import json
import math
import numbers
import os
from typing import Any, Optional

import httpx

from megatron_grpo.config.base import ConfigError
from megatron_grpo.rewards.sample import RewardSample
from megatron_grpo.runtime.errors import one_line

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
MAX_ANSWER_BYTES = 1 << 20
"""Largest answer read, compressed or not: ``{"reward": 0.5}`` is 15 bytes; 1 MiB leaves room
for servers that echo the sample back."""
BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0


class RemoteRewardFailure(RuntimeError):
    """One response could not be scored by the server; ``str(e)`` is one line."""


class RemoteReward:
    """Per-sample async reward function backed by an HTTP server (see the module docstring).

    remote_cfg: a ``RemoteRewardConfig``; key: ``reward.functions[i]`` for config errors.
    """

    def __init__(self, remote_cfg, key: str):
        self.url = remote_cfg.url
        self.timeout_s = float(remote_cfg.timeout_s)
        self.max_retries = int(remote_cfg.max_retries)
        self.headers = {"Content-Type": "application/json"}
        if remote_cfg.api_key_env:
            api_key = os.environ.get(remote_cfg.api_key_env)
            if not api_key:
                raise ConfigError(f"{key}.remote.api_key_env",
                                  f"environment variable {remote_cfg.api_key_env} is not set (or empty)")
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.retries = 0  # since the last pop_stats()
        self._client: Optional[httpx.AsyncClient] = None
        self.__name__ = f"remote({self.url})"

    async def __call__(self, sample: RewardSample) -> float:
        body = json.dumps(sample.to_json()).encode()
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.retries += 1
                await asyncio.sleep(min(BACKOFF_S * 2 ** (attempt - 1), MAX_BACKOFF_S))
            try:
                status, answer = await asyncio.wait_for(self._post(body), self.timeout_s)
            except (asyncio.TimeoutError, httpx.TimeoutException):
                last = f"no answer within timeout_s={self.timeout_s:g}"
                continue
            except httpx.HTTPError as e:
                last = one_line(e, 120)
                continue
            if status in RETRY_STATUSES:
                last = f"HTTP {status}"
                continue
            return self._parse(status, answer)
        raise RemoteRewardFailure(f"{self.url}: {last} after {self.max_retries + 1} attempt(s) "
                                  f"(remote.max_retries={self.max_retries})")

    async def _post(self, body: bytes) -> tuple[int, bytes]:
        """(HTTP status, decoded answer), reading at most ``MAX_ANSWER_BYTES`` either way."""
        if self._client is None:  # made on the scorer's event loop, where it is used and closed
            timeout = httpx.Timeout(self.timeout_s)
            self._client = httpx.AsyncClient(timeout=timeout, trust_env=False)
        async with self._client.stream("POST", self.url, content=body, headers=self.headers) as response:
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_ANSWER_BYTES:
                raise self._too_large(f"Content-Length {int(declared)}")
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_ANSWER_BYTES or response.num_bytes_downloaded > MAX_ANSWER_BYTES:
                    raise self._too_large("as sent" if response.num_bytes_downloaded > MAX_ANSWER_BYTES
                                          else "once decompressed")
                chunks.append(chunk)
            return response.status_code, b"".join(chunks)

    def _too_large(self, how: str) -> RemoteRewardFailure:
        """The one-line failure for an answer over ``MAX_ANSWER_BYTES`` (``how``: which measure)."""
        return RemoteRewardFailure(f"{self.url}: the answer is too large ({how}; the limit is {MAX_ANSWER_BYTES} "
                                   'bytes); expected {"reward": <number>}')

    def _parse(self, status: int, answer: bytes) -> float:
        """The reward in a 200 answer; RemoteRewardFailure naming what is wrong otherwise."""
        text = answer.decode("utf-8", errors="replace")
        if status != 200:
            raise RemoteRewardFailure(f"{self.url}: HTTP {status}: {' '.join(text.split())[:120]}")
        try:
            data: Any = json.loads(text)
        except (ValueError, RecursionError):
            text = " ".join(text.split())[:60]
            raise RemoteRewardFailure(f"{self.url}: the answer is not JSON: {text!r}; "
                                      'expected {"reward": <number>}') from None
        value = data.get("reward") if isinstance(data, dict) else None
        try:  # a JSON integer of 400 digits is a Real no float holds (OverflowError, not this line)
            finite = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
        except OverflowError:
            finite = False
        if not finite:
            raise RemoteRewardFailure(f"{self.url}: expected {{\"reward\": <finite number>}}, got "
                                      f"{json.dumps(data)[:80]}")
        return float(value)

    def pop_stats(self) -> dict[str, float]:
        """Counters since the last call (the scorer logs them as ``reward/<label>/<name>``)."""
        out, self.retries = {"retries": float(self.retries)}, 0
        return out

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
