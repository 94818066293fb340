"""Hypercorn's connection handler, writing a response without a task switch when it can.

Hypercorn writes each piece of a response (the head, every body message) through four
layers: the ASGI stream's state checks, h11's state machine and chunk framing, then, per
connection, a `trio.Lock` and a shielded `SocketStream.send_all`. Taking the lock and
sending each yield to the scheduler once. For a streamed reply, where every relayed event
is one small write, that was most of the Edge's CPU per chunk (README, "Session 5":
~230 -> ~150 us per chunk in the fleet-shaped bench).

Two shortcuts, both falling back to Hypercorn's own path whenever they cannot finish:

- `Connection.protocol_send` writes a piece with one non-blocking `write` when no other
  write is in progress on the connection. The socket takes the whole piece almost always
  (a caller reading its stream keeps the kernel's send buffer near empty); what it does
  not take goes through Hypercorn's lock and `send_all`, which wait for the socket and
  report a broken connection as they always do. A piece is written whole or the
  connection ends: a remainder is sent under the same shield Hypercorn puts on its sends.
- `ChunkedBodyWriter` frames the body messages of a chunked HTTP/1.1 response itself
  (`hex-size CRLF data CRLF`, RFC 9112 §7.1) and hands them to the connection, skipping
  the ASGI stream and h11 for them. h11 keeps no state about a chunked body's data, so
  the head and the last body message, which do go through Hypercorn (h11 writes the
  last-chunk `0 CRLF CRLF` there), find it exactly as if it had written the chunks.

The app tasks of a connection are spawned from the connection's task, so they see the
connection through a context variable (`current_connection`). Hypercorn 0.18's
`TCPServer` is the base; on a Hypercorn whose handler has no `send_lock`, both shortcuts
step aside (`Connection.writes_directly`), and `tests/e2e/test_http_connection.py` fails
to say so.
"""

from __future__ import annotations

import os
from contextvars import ContextVar
from typing import Any

import trio
from hypercorn.events import Event, RawData
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.typing import ASGISendCallable, HTTPScope

__all__ = ["ChunkedBodyWriter", "Connection", "current_connection"]

_current: ContextVar[Connection | None] = ContextVar("iop_http_connection", default=None)

#: Responses with these headers are framed by them, not by chunked transfer coding.
_FRAMING_HEADERS = frozenset((b"content-length", b"transfer-encoding"))
#: Statuses whose responses have no body (RFC 9110 §6.4.1).
_NO_BODY_STATUSES = frozenset((204, 304))


def current_connection() -> Connection | None:
    """The connection whose request the calling task serves (None outside one)."""
    return _current.get()


class Connection(TCPServer):
    """One client connection (Hypercorn's `TCPServer`, see the module docstring).

    `writes_directly` says whether the shortcuts apply: the connection is a plain
    `trio.SocketStream` (the Edge's listeners are; TLS, when wanted, ends in front of the
    Edge) and Hypercorn keeps its writes under `send_lock` as 0.18 does. Otherwise this is
    Hypercorn's handler unchanged, only slower."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writes_directly = isinstance(self.stream, trio.SocketStream) and isinstance(
            getattr(self, "send_lock", None), trio.Lock
        )

    async def run(self) -> None:
        _current.set(self)  # seen by this connection's app tasks, spawned from here
        await super().run()

    async def protocol_send(self, event: Event) -> None:
        if type(event) is RawData and self.writes_directly:
            await self.write(event.data)
        else:
            await super().protocol_send(event)

    async def write(self, data: bytes) -> None:
        """Write `data` to the client: at once when the socket takes it all, else the
        rest through Hypercorn's locked send, whole or not at all."""
        sent = self._write_now(data)
        if sent == len(data):
            return
        if sent == 0:
            await super().protocol_send(RawData(data=data))
            return
        with trio.CancelScope(shield=True):  # half a piece on the wire: finish it
            await super().protocol_send(RawData(data=data[sent:]))

    def _write_now(self, data: bytes) -> int:
        """How much of `data` the socket took without waiting: 0 when a write is in
        progress (order is kept by going after it) or on any error (the locked path
        meets it again and reports it as Hypercorn does)."""
        if self.send_lock.locked():
            return 0
        try:
            return os.write(self.stream.socket.fileno(), data)
        except OSError:  # BlockingIOError, or a closed or broken connection
            return 0


class ChunkedBodyWriter:
    """The ASGI `send` of one HTTP/1.1 exchange whose body pieces it frames and writes
    itself once the response turns out chunked (see the module docstring)."""

    __slots__ = ("_chunked", "_connection", "_scope", "_send")

    def __init__(self, send: ASGISendCallable, connection: Connection, scope: HTTPScope) -> None:
        self._send = send
        self._connection = connection
        self._scope = scope
        self._chunked = False

    async def __call__(self, message: Any) -> None:
        if (
            self._chunked
            and message["type"] == "http.response.body"
            and message.get("more_body", False)
        ):
            body = message.get("body", b"")
            if body:
                await self._connection.write(b"%x\r\n%b\r\n" % (len(body), body))
            return
        if message["type"] == "http.response.start":
            self._chunked = _is_chunked(self._scope, message)
        await self._send(message)


def _is_chunked(scope: HTTPScope, start: Any) -> bool:
    """Whether h11 frames the response that `start` begins with chunked transfer coding:
    an HTTP/1.1 request, a response with a body, no framing header of the app's own.
    Anything else keeps Hypercorn's path (its checks stay the reference)."""
    status = start["status"]
    return (
        scope["http_version"] == "1.1"
        and scope["method"] not in ("HEAD", "CONNECT")
        and status >= 200
        and status not in _NO_BODY_STATUSES
        and not any(name.lower() in _FRAMING_HEADERS for name, _ in start.get("headers", ()))
    )
