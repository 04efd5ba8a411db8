"""The guards before every route of our HTTP servers, ``megatron-grpo serve`` (inference/server.py)
and the agent front (rollout/episodes/agent/front.py), written once: the bearer check, the body bound,
the read deadlines of the headers and of the body, and the one-line refusal.

* ``bearer_ok``: ``Authorization: Bearer <key>``, compared as bytes in constant time (the
  answer's timing must not tell how much of a guessed key was right).
* ``read_json``: the body read only up to its bound (413 past it, whatever Content-Length
  claims), within the read deadline once the headers are in (408), then parsed as JSON without
  NaN or Infinity (400: Python's parser accepts them, JSON has none).
* ``header_deadline_protocol``: uvicorn times out nothing before a request's headers are
  complete (its keep-alive timer starts only after a response), so a client that connects and
  sends half a header line, or nothing, would hold its connection for ever (issue 48). From the
  moment a connection opens, or the previous answer on it was sent, its next request's headers
  must be complete within the same deadline; past it the client gets a 408 and the connection is
  closed. The 408 is written as raw bytes: h11 lets a server answer only a request it has
  parsed, and the connection is closed right after, so h11's state is never consulted again.

* ``one_line_errors``: a middleware that turns an exception no route expected into a 500 in
  the server's error shape and one log line (method, path, the exception), never uvicorn's
  traceback: a malformed request is answered, and logged, in one line.

Every refusal is a ``Refused(status, message)`` whose message is one line naming the setting
that bounds it; each server writes it in its API's error shape (SGLang's or OpenAI's) through
one ``error_body(message, status)`` function, the same one its header deadline answers with.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional

import h11
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from megatron_grpo.runtime.errors import one_line

log = logging.getLogger(__name__)

ErrorBody = Callable[[str, int], dict]
"""A server's error shape: ``error_body(message, status)`` is the JSON object of a refusal."""


class Refused(Exception):
    """A request refused before its route runs: ``status`` (401, 400, 408, 413) and one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def bearer_ok(request: Request, api_key: str) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <api_key>``. Bytes, compared in constant
    time; the header's str is its latin-1 decoding, so this compares the raw value (a non-ASCII
    header is simply wrong, not an error)."""
    sent = request.headers.get("authorization", "").encode("latin-1")
    return hmac.compare_digest(sent, f"Bearer {api_key}".encode())


@dataclass(frozen=True)
class BodyBound:
    """How much of a request body a server reads, and how long it waits for it; ``*_setting``
    names what sets each (a command-line flag, a constant), for the refusal's line."""

    max_bytes: int
    read_timeout_s: float
    max_bytes_setting: str
    read_timeout_setting: str


class _NonFinite(ValueError):
    """A JSON body holding NaN, Infinity or -Infinity."""


def _refuse_constant(name: str) -> None:
    raise _NonFinite(name)


async def read_body(request: Request, bound: BodyBound) -> bytes:
    """The request's body, read only up to ``bound.max_bytes`` (413 past it, whatever the
    Content-Length header claims: a missing or false one is bounded while streaming) and within
    ``bound.read_timeout_s`` (408 for a slow or stalled sender). Raises ``Refused``."""
    limit = f"this server's limit of {bound.max_bytes} bytes ({bound.max_bytes_setting})"
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > bound.max_bytes:
        raise Refused(413, f"the request body of {int(declared)} bytes exceeds {limit}")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(bound.read_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > bound.max_bytes:
                    raise Refused(413, f"the request body exceeds {limit}")
                chunks.append(chunk)
    except TimeoutError:
        raise Refused(408, f"the request body was not received within {bound.read_timeout_s:g} s "
                           f"({bound.read_timeout_setting})") from None
    except ClientDisconnect:  # left starlette's traceback in the server's log (issue 64): one line
        message = "the client disconnected before its request body was received"
        log.warning("%s %s: %s", request.method, request.url.path, message)
        raise Refused(400, message) from None  # its answer goes nowhere; the route ends here
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON; anything else, or JSON holding NaN or Infinity, is a ``Refused`` 400."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except _NonFinite as e:
        raise Refused(400, f"the request body holds {e}, which is not a JSON number") from None
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        raise Refused(400, "the request body must be JSON") from None


async def read_json(request: Request, bound: BodyBound) -> Any:
    """``read_body`` then ``parse_json``: the guarded body of a JSON route."""
    return parse_json(await read_body(request, bound))


def one_line_errors(error_body: ErrorBody) -> Callable[[Request, Callable], Awaitable[Any]]:
    """An HTTP middleware (``app.middleware("http")(...)``): a route's unexpected exception is a
    500 whose body is ``error_body(message, 500)`` and one log line naming the request; the
    traceback only at DEBUG (it is a bug of ours to report, not the client's to read)."""

    async def middleware(request: Request, call_next: Callable) -> Any:
        try:
            return await call_next(request)
        except Exception as e:  # noqa: BLE001 - the server answers on, in one line
            message = f"internal error: {one_line(e)}"
            log.error("%s %s: 500: %s", request.method, request.url.path, message)
            log.debug("the traceback", exc_info=True)
            return JSONResponse(error_body(message, 500), status_code=500)

    return middleware


def timeout_response(timeout_s: float, setting: str, error_body: ErrorBody) -> bytes:
    """The whole HTTP/1.1 408 a stalled sender gets (then the connection is closed): the body is
    ``error_body(message, 408)``, the message naming ``setting`` (what sets ``timeout_s``)."""
    message = f"the request headers were not received within {timeout_s:g} s ({setting})"
    body = json.dumps(error_body(message, 408)).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


def header_deadline_protocol(timeout_s: float, setting: str, error_body: ErrorBody) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with the header deadline ``timeout_s`` (module docstring),
    answering a stalled sender as ``timeout_response`` says; pass it as ``uvicorn.Config(...,
    http=...)``."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: Optional[asyncio.TimerHandle] = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.write(timeout_response(timeout_s, setting, error_body))
                self.transport.close()

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the headers are in: the route's body deadline applies
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()  # the next request on this kept-alive connection

    return HeaderDeadlineProtocol
