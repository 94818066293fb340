"""Hypercorn's connection handler, writing a response without a task switch when it can.

Hypercorn writes each piece of a response (the head, every body message) through four
layers: the ASGI stream's state checks, h11's state machine and chunk framing, then, per
connection, a `trio.Lock` and a shielded `SocketStream.send_all`. Taking the lock and
sending each yield to the scheduler once. For a streamed reply, where every relayed event
is one small write, that was most of the Edge's CPU per chunk (about a third of it
went away when the connection began writing itself, in the fleet-shaped bench).

Three shortcuts:

- `Connection.protocol_send` writes a piece with one non-blocking `write` when no other
  write is in progress on the connection. The socket takes the whole piece almost always
  (a caller reading its stream keeps the kernel's send buffer near empty); what it does
  not take is written under Hypercorn's `send_lock` as the socket takes it, shielded as
  Hypercorn shields its sends (a piece is written whole or the connection ends), with
  two bounds Hypercorn lacks: a caller that takes nothing for `send_timeout_s`
  (`openai.send_timeout_s`, 60 s by default) is disconnected, and the server `abort`s
  a connection a write still holds once its graceful timeout is over (Hypercorn would
  wait for that write for ever).
- `ChunkedBodyWriter` frames the body messages of a chunked HTTP/1.1 response itself
  (`hex-size CRLF data CRLF`, RFC 9112 §7.1) and hands them to the connection, skipping
  the ASGI stream and h11 for them, the last message's data too. h11 keeps no state
  about a chunked body's data, so the head and the end of the body, which do go through
  Hypercorn (as an empty last message: h11 writes the last-chunk `0 CRLF CRLF`), find it
  exactly as if it had written the chunks.
  Any other response, or message, takes Hypercorn's path.
- A response framed by its length (a completion, an error) goes out in one write:
  Hypercorn writes the head when the app starts the response and the body when it sends
  it, then h11's empty end of the body, three writes and two reads for the client. The
  connection holds the head (`hold_next_write`) and writes it with the body, and skips
  empty writes.

Requests are read with strict framing (`iop_edge.http.framing`): a request whose end two
parsers could place differently is refused with a 400 and the connection closed, and
framing errors carry OpenAI's error body.

The keep-alive timeout is one task per connection whose deadline moves
(`iop_edge.http.keep_alive`), not Hypercorn's task per request, and a connection its
client closed is released at once rather than when that timeout is up. The same moment
is told to whoever watches the connection (`on_client_gone`): a request in flight learns
that its caller left without a task of its own waiting on ASGI `receive` for it.

The app tasks of a connection are spawned from the connection's task, so they see the
connection through a context variable (`current_connection`). Hypercorn 0.18's
`TCPServer` is the base, through `iop_edge.http.compat.hypercorn` (every Hypercorn internal
used here is named there); on a Hypercorn whose handler has no `send_lock`, both shortcuts
step aside (`Connection.writes_directly`), and `tests/compat/test_hypercorn.py` fails to
say so.
"""

from __future__ import annotations

import logging
import os
import select
from collections.abc import Callable
from contextvars import ContextVar
from functools import partial
from typing import Any, Final

import h11
import trio
from hypercorn.config import Config
from hypercorn.typing import AppWrapper, ASGISendCallable, HTTPScope, LifespanState

from iop_edge.http.compat.hypercorn import (
    Closed,
    Event,
    HypercornConnection,
    RawData,
    WorkerContext,
)
from iop_edge.http.framing import StrictH11Protocol
from iop_edge.http.keep_alive import KeepAliveTimer
from schemas.config import DEFAULT_SEND_TIMEOUT_S

__all__ = ["ChunkedBodyWriter", "Connection", "current_connection"]

log = logging.getLogger(__name__)

_current: ContextVar[Connection | None] = ContextVar("iop_http_connection", default=None)

#: Responses with these headers are framed by them, not by chunked transfer coding.
_FRAMING_HEADERS = frozenset((b"content-length", b"transfer-encoding"))
#: The last body message of a chunked response whose data the connection wrote itself.
_END_OF_BODY: Final = {"type": "http.response.body", "body": b"", "more_body": False}
#: Statuses whose responses have no body (RFC 9110 §6.4.1).
_NO_BODY_STATUSES = frozenset((204, 304))


def current_connection() -> Connection | None:
    """The connection whose request the calling task serves (None outside one)."""
    return _current.get()


class Connection(HypercornConnection):
    """One client connection (Hypercorn's `TCPServer`, see the module docstring).

    `writes_directly` says whether the shortcuts apply: the connection is a plain
    `trio.SocketStream` (the Edge's listeners are; TLS, when wanted, ends in front of the
    Edge) and Hypercorn keeps its writes under `send_lock` as 0.18 does. Otherwise this is
    Hypercorn's handler unchanged, only slower.

    While it runs, the connection is in `live` (its server's set), so the server can
    `abort` the ones a write still holds when its graceful timeout is over."""

    def __init__(
        self,
        app: AppWrapper,
        config: Config,
        context: WorkerContext,
        state: LifespanState,
        stream: trio.SocketStream,
        *,
        live: set[Connection],
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    ) -> None:
        super().__init__(app, config, context, state, stream)  # type: ignore[arg-type]
        self._live = live
        self._send_timeout_s = send_timeout_s
        lock = self.write_lock
        self.writes_directly = isinstance(stream, trio.SocketStream) and lock is not None
        self._send_lock = lock if lock is not None else trio.Lock()
        """Hypercorn's lock around its writes: ours take it too (unused when not
        `writes_directly`)."""
        self._keep_alive = KeepAliveTimer(
            config.keep_alive_timeout,
            context.terminated,
            self.close_from_server,
            pending=self._bytes_waiting,
        )
        self.replace_idle_task(self._keep_alive)
        self._holding = False
        self._held = b""
        """A response's head, waiting to go out with the first bytes after it."""
        self._reading = True
        self._gone_watchers: set[Callable[[], None]] = set()

    async def run(self) -> None:
        _current.set(self)  # seen by this connection's app tasks, spawned from here
        self._live.add(self)
        try:
            await super().run()
        finally:
            self._live.discard(self)
            self.release_protocol()  # no cycle left for the collector

    def reading_begins(self) -> None:
        """Read requests with `StrictH11Protocol` (see `iop_edge.http.framing`), swapped
        in for the HTTP/1.1 protocol Hypercorn built, before it has read a byte."""
        self.replace_http11_protocol(StrictH11Protocol)

    def reading_ended(self) -> None:
        self._keep_alive.end()  # the client closed, or we did: release the connection
        self._reading = False
        watchers, self._gone_watchers = self._gone_watchers, set()
        for watcher in watchers:
            watcher()

    def on_client_gone(self, watcher: Callable[[], None]) -> Callable[[], None]:
        """Call `watcher` (once, from the connection's task) when the connection stops
        reading: its client closed it or the socket broke, or the server closed it. That
        is when Hypercorn tells the requests in flight `http.disconnect`; an HTTP/1.1
        request learns it here instead of from a task of its own waiting on `receive`.
        A connection that stopped reading already calls `watcher` at once. Returns the
        function that stops the watch (the request is over)."""
        if not self._reading:
            watcher()
            return _nothing
        self._gone_watchers.add(watcher)
        return partial(self._gone_watchers.discard, watcher)

    def _bytes_waiting(self) -> bool:
        """Whether the client sent bytes of a request not handled yet (on its way in):
        read into the parser, or waiting in the socket."""
        if self._parser_holds_bytes():
            return True
        transport = getattr(self.stream, "transport_stream", self.stream)  # under TLS
        try:
            readable, _, _ = select.select([transport.socket.fileno()], [], [], 0)
        except (OSError, ValueError):  # closed meanwhile
            return False
        return bool(readable)

    def drain(self, hand_over: Callable[[trio.socket.SocketType], bool] | None = None) -> None:
        """The server drains: close this connection as soon as it is idle, now if it is;
        on a restart (`hand_over`, as `hand_off` takes it), hand it to the successor once
        idle instead (`KeepAliveTimer.drain`)."""
        self._keep_alive.drain(None if hand_over is None else partial(self.hand_off, hand_over))

    def hand_off(self, send: Callable[[trio.socket.SocketType], bool]) -> bool:
        """Hand this connection, idle, to a successor process (`handoff`): `send` passes
        the socket's descriptor on; then this process lets go of it without closing the
        connection (the successor holds it). Synchronous, so nothing is read here after
        the check. False (nothing changed) unless it is a plain HTTP/1.1 connection
        between requests whose parser holds no byte of a next one: bytes still in the
        socket are the successor's to read."""
        if not (self.writes_directly and self._reading and self._keep_alive.idle):
            return False
        if self._held or self._send_lock.locked() or self._parser_holds_bytes(unknown=True):
            return False
        sock: trio.socket.SocketType = self.stream.socket
        if not send(sock):
            return False
        sock.close()  # this process's descriptor only: the successor's keeps it open
        return True

    def _parser_holds_bytes(self, *, unknown: bool = False) -> bool:
        """Whether the HTTP/1.1 parser holds bytes of a request not handled yet
        (`unknown` when the connection is not HTTP/1.1 parsed by h11)."""
        parser = getattr(getattr(self, "protocol", None), "protocol", None)
        connection = getattr(parser, "connection", None)
        if not isinstance(connection, h11.Connection):
            return unknown
        data, closed = connection.trailing_data
        return bool(data) or closed

    def abort(self) -> None:
        """Close the socket now. A write waiting on it fails, and Hypercorn ends the
        connection as it does when a caller leaves. Hypercorn shields its writes (and so
        does `write`, for a piece begun), and waits for them before it closes a
        connection, so without this a caller that reads nothing keeps a stopping server
        running for ever."""
        transport = getattr(self.stream, "transport_stream", self.stream)  # under TLS
        transport.socket.close()

    async def protocol_send(self, event: Event) -> None:
        if type(event) is RawData and self.writes_directly:
            await self.write(event.data)
        else:
            await super().protocol_send(event)

    def hold_next_write(self, hold: bool = True) -> None:
        """Keep the next write (a response's head) to send it with the one after it (its
        body, or h11's empty end of a body framed by its length): one write, and one read
        for the client, instead of two. `hold_next_write(False)` cancels a hold that no
        write took (the head was refused)."""
        self._holding = hold

    async def write(self, data: bytes) -> None:
        """Write `data` to the client: at once when the socket takes it all (no task
        switch), else as the socket takes it (`_write_waiting`). Nothing for no bytes."""
        if self._holding:
            self._holding = False
            self._held = data
            return
        if self._held:
            data, self._held = self._held + data, b""
        if not data:
            return  # h11's end of a body framed by its length: no bytes to write
        sent = self.write_now(data)
        if sent < len(data):
            await self._write_waiting(memoryview(data)[sent:])

    def write_now(self, data: bytes) -> int:
        """How much of `data` the socket took without waiting: 0 when a write is in
        progress (order is kept by going after it) or on any error (`_write_waiting`
        meets it again and ends the connection)."""
        if self._send_lock.locked():
            return 0
        try:
            return os.write(self.stream.socket.fileno(), data)
        except OSError:  # BlockingIOError, or a closed or broken connection
            return 0

    async def _write_waiting(self, rest: memoryview) -> None:
        """Write `rest` under the send lock, after any write in progress, as the socket
        takes it. Shielded as Hypercorn shields its sends (a piece is written whole or the
        connection ends); a caller that takes nothing for `send_timeout_s` is disconnected
        (nginx's `send_timeout`), and `abort` ends the wait at once."""
        socket = self.stream.socket
        with trio.CancelScope(shield=True):
            async with self._send_lock:
                while rest:
                    try:
                        rest = rest[os.write(socket.fileno(), rest) :]
                        continue
                    except BlockingIOError:
                        pass
                    except OSError:  # the caller is gone, or `abort` closed the socket
                        break
                    with trio.move_on_after(self._send_timeout_s) as stalled:
                        try:
                            await trio.lowlevel.wait_writable(socket)
                        except trio.ClosedResourceError:  # `abort`, while waiting
                            break
                    if stalled.cancelled_caught:
                        log.info("caller took nothing for %gs: disconnected", self._send_timeout_s)
                        self.abort()
                        break
                else:
                    return
            await self.protocol.handle(Closed())  # as Hypercorn's own send does


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
        if self._chunked and message["type"] == "http.response.body":
            body = message.get("body", b"")
            if body:
                await self._connection.write(_chunk(body))
            if message.get("more_body", False):
                return
            message = _END_OF_BODY  # Hypercorn ends the exchange; h11 writes the last chunk
        elif message["type"] == "http.response.start":
            self._chunked = _is_chunked(self._scope, message)
            if not self._chunked:  # the head goes out with the body, in one write
                self._connection.hold_next_write()
                try:
                    await self._send(message)
                finally:
                    self._connection.hold_next_write(False)
                return
        await self._send(message)

    def write_now(self, body: bytes) -> bytes | None:
        """Write `body` as one chunk of the response, without waiting: None when nothing
        was written (the body is not chunked, or a write is in progress), else the bytes
        the socket did not take (b"" when it took all), which `write_rest` writes. The
        run relay's `DirectWrite` (see `iop_edge.runtime.runs.dispatch`, Rule 9)."""
        if not self._chunked:
            return None
        piece = _chunk(body)
        sent = self._connection.write_now(piece)
        return piece[sent:] if sent else None

    async def write_rest(self, rest: bytes) -> None:
        """Finish a piece `write_now` began (before anything else is sent)."""
        await self._connection.write(rest)


def _nothing() -> None:
    pass


def _chunk(data: bytes) -> bytes:
    """`data` framed as one chunk of a chunked body: `hex-size CRLF data CRLF`."""
    return b"%x\r\n%b\r\n" % (len(data), data)


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
        and _FRAMING_HEADERS.isdisjoint([name.lower() for name, _ in start.get("headers", ())])
    )
