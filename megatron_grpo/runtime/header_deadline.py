"""A deadline on a request's headers for uvicorn's h11 protocol: ``megatron-grpo serve`` and the
agent front (``rollout/agents/front.py``) use it.

uvicorn times out nothing before a request's headers are complete: its keep-alive timer starts
only after a response, so a client that connects and sends half a header line (or nothing)
holds its connection, and the server's memory for it, for ever (issue 48). Each server's own
read deadline on the body (``serve``'s ``--read-timeout-s`` in ``engine/server._body``; the
agent front's ``READ_TIMEOUT_S``) starts once the headers have arrived, in the route. This
protocol adds the missing half: from the moment a connection opens, or the previous answer on
it was sent, its next request's headers must be complete within the same time; past it the
client gets a 408 in that server's error shape and the connection is closed.

The 408 is written as raw bytes: h11 lets a server answer only a request it has parsed, and
the connection is closed right after, so h11's state is never consulted again.
"""

from __future__ import annotations

import asyncio
import json
from typing import Callable, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def timeout_response(timeout_s: float, setting: str, error_body: Callable[[str, int], dict]) -> bytes:
    """The whole HTTP/1.1 408 a stalled sender gets (then the connection is closed): the body is
    ``error_body(message, 408)``, the message naming ``setting`` (what sets ``timeout_s``)."""
    message = f"the request headers were not received within {timeout_s:g} s ({setting})"
    body = json.dumps(error_body(message, 408)).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


def header_deadline_protocol(timeout_s: float, setting: str,
                             error_body: Callable[[str, int], dict]) -> type[H11Protocol]:
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
