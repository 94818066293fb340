"""The Edge's HTTP connections write responses themselves when they can
(`iop_edge.http.connection`): what reaches the client must be byte for byte what
Hypercorn alone would have written, whatever the socket takes at once.

The client side is a raw socket, so each test sees the exact bytes on the wire."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
from collections.abc import Sequence
from typing import Any

import httpx2
import pytest
import trio
import trio.testing

from iop_edge.core.configuration.listen import parse_listen_address
from iop_edge.http.connection import ChunkedBodyWriter, Connection, current_connection
from iop_edge.http.server import HttpServer, hypercorn_config
from iop_edge.runtime.lifecycle.listeners import bind_listener
from schemas.config import DEFAULT_SEND_TIMEOUT_S
from tests.e2e.asgi import complete_lifespan
from tests.timing import GUARD_S

Headers = Sequence[tuple[bytes, bytes]]


class StreamingApp:
    """Answers with `pieces`, one body message each, then a last message carrying `last`.

    `hold` (when given) is awaited after the first piece; `finished` is set once the
    app has sent everything without an error."""

    def __init__(
        self,
        pieces: Sequence[bytes],
        headers: Headers = (),
        hold: trio.Event | None = None,
        status: int = 200,
        last: bytes = b"",
    ) -> None:
        self.pieces = pieces
        self.last = last
        self.status = status
        self.headers = list(headers)
        self.hold = hold
        self.finished = trio.Event()
        self.connection: Connection | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await complete_lifespan(receive, send)
            return
        self.connection = current_connection()
        start = {"type": "http.response.start", "status": self.status, "headers": self.headers}
        await send(start)
        for number, piece in enumerate(self.pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            if number == 0 and self.hold is not None:
                await self.hold.wait()
        await send({"type": "http.response.body", "body": self.last})
        self.finished.set()


def _server(
    app: StreamingApp | WatchingApp,
    *,
    graceful_timeout_s: float | None = None,
    send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
    keep_alive_timeout_s: float | None = None,
) -> tuple[HttpServer, tuple[str, int]]:
    """An Edge HTTP server for `app` on a loopback port (not started), and its address."""
    sock = bind_listener("openai", "127.0.0.1:0", parse_listen_address("127.0.0.1:0")).socket
    config = hypercorn_config("127.0.0.1:0")
    if graceful_timeout_s is not None:
        config.graceful_timeout = graceful_timeout_s
    if keep_alive_timeout_s is not None:
        config.keep_alive_timeout = keep_alive_timeout_s
    host, port = sock.getsockname()[:2]
    return HttpServer(app, config, sock, send_timeout_s=send_timeout_s), (host, port)


async def _serve(nursery: trio.Nursery, app: StreamingApp | WatchingApp) -> tuple[str, int]:
    server, address = _server(app)
    await nursery.start(server.serve)
    return address


async def _exchange(address: tuple[str, int], request: bytes) -> bytes:
    """Send `request` on a new connection; everything the server writes until it closes."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(request)
        received = bytearray()
        while data := await stream.receive_some(1 << 16):
            received += data
    return bytes(received)


def _request(method: str = "POST", version: str = "1.1") -> bytes:
    return f"{method} /stream HTTP/{version}\r\nhost: t\r\nconnection: close\r\n\r\n".encode()


def _body(response: bytes) -> bytes:
    return response.partition(b"\r\n\r\n")[2]


PIECES = [b"data: one\n\n", b"data: two\n\n", b"x" * 1000]
#: `PIECES` as a chunked body on the wire, the last chunk included.
PIECES_CHUNKED = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in PIECES) + b"0\r\n\r\n"
#: 20 MB: more than a loopback connection's kernel buffers hold (Linux lets them grow to
#: 4 MB sending and 6 MB receiving by default), so a caller that reads nothing blocks.
BEYOND_SOCKET_BUFFERS = [b"z" * 1_000_000] * 20


async def test_a_streamed_body_is_chunked_piece_by_piece(nursery: trio.Nursery) -> None:
    app = StreamingApp(PIECES)
    address = await _serve(nursery, app)
    response = await _exchange(address, _request())
    # The installed Hypercorn is one the shortcuts know (else they step aside, silently).
    assert app.connection is not None and app.connection.writes_directly
    assert b"\r\ntransfer-encoding: chunked\r\n" in response.lower()
    chunks = [
        b"b\r\ndata: one\n\n\r\n",
        b"b\r\ndata: two\n\n\r\n",
        b"3e8\r\n" + b"x" * 1000 + b"\r\n",
    ]
    last_chunk = b"0\r\n\r\n"  # written by h11 with the last body message
    assert _body(response) == b"".join(chunks) + last_chunk


async def test_the_last_body_message_may_carry_data(nursery: trio.Nursery) -> None:
    address = await _serve(nursery, StreamingApp(PIECES, last=b"data: [DONE]\n\n"))
    response = await _exchange(address, _request())
    last = b"e\r\ndata: [DONE]\n\n\r\n"
    assert _body(response) == PIECES_CHUNKED.removesuffix(b"0\r\n\r\n") + last + b"0\r\n\r\n"


async def test_a_draining_server_ends_a_reply_whole_then_closes(
    nursery: trio.Nursery,
) -> None:
    """A reply begun before the drain goes out whole, its pieces framed as usual, and the
    connection closes after it (a draining server takes no new request on it)."""
    hold = trio.Event()
    app = StreamingApp(PIECES, hold=hold)
    server, address = _server(app)
    await nursery.start(server.serve)
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(b"POST /stream HTTP/1.1\r\nhost: t\r\n\r\n")  # keep-alive
        await trio.testing.wait_all_tasks_blocked()  # the first piece is out
        server.stop_accepting()
        hold.set()
        received = bytearray()
        while data := await stream.receive_some(1 << 16):
            received += data
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert body == PIECES_CHUNKED and app.finished.is_set()


async def test_a_draining_server_refuses_a_request_on_an_old_connection_unread(
    nursery: trio.Nursery,
) -> None:
    """A request that reaches a connection accepted before the drain is answered, unread,
    with a 503 to retry elsewhere and `Connection: close` (not reset: its bytes were
    waiting when the server came to close the idle connection); the app never sees it."""
    app = StreamingApp(PIECES)
    server, address = _server(app)
    await nursery.start(server.serve)
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await trio.testing.wait_all_tasks_blocked()  # accepted
        server.stop_accepting()
        # Sent before the server's tasks run: already there when the connection is read.
        await stream.send_all(b"POST /stream HTTP/1.1\r\nhost: t\r\n\r\n")
        received = bytearray()
        while data := await stream.receive_some(1 << 16):
            received += data
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"\r\nconnection: close" in head.lower()
    assert b"\r\nretry-after: 1" in head.lower() and b'"code":"shutting_down"' in body
    assert app.connection is None  # the app was never called


async def test_pipelined_requests_get_their_replies_whole_and_in_order(
    nursery: trio.Nursery,
) -> None:
    address = await _serve(nursery, StreamingApp(PIECES))
    keep_alive = b"POST /stream HTTP/1.1\r\nhost: t\r\n\r\n"
    response = await _exchange(address, keep_alive + _request())  # the second one closes
    first, second = response.split(b"HTTP/1.1 200")[1:]
    assert first.endswith(b"\r\n\r\n" + PIECES_CHUNKED)
    assert second.endswith(b"\r\n\r\n" + PIECES_CHUNKED)


async def test_a_body_framed_by_its_length_is_left_to_hypercorn(nursery: trio.Nursery) -> None:
    length = sum(map(len, PIECES))
    headers = [(b"content-length", str(length).encode())]
    address = await _serve(nursery, StreamingApp(PIECES, headers))
    response = await _exchange(address, _request())
    assert b"transfer-encoding" not in response.lower()
    assert _body(response) == b"".join(PIECES)


async def test_an_http_1_0_caller_gets_the_body_unframed(nursery: trio.Nursery) -> None:
    address = await _serve(nursery, StreamingApp(PIECES))
    response = await _exchange(address, _request(version="1.0"))
    assert b"transfer-encoding" not in response.lower()
    assert _body(response) == b"".join(PIECES)  # ended by the close


async def test_a_head_request_gets_no_body(nursery: trio.Nursery) -> None:
    address = await _serve(nursery, StreamingApp(PIECES))
    response = await _exchange(address, _request(method="HEAD"))
    assert response.startswith(b"HTTP/1.1 200")
    assert _body(response) == b""


async def test_a_status_without_a_body_gets_none(nursery: trio.Nursery) -> None:
    address = await _serve(nursery, StreamingApp(PIECES, status=204))
    response = await _exchange(address, _request())
    assert response.startswith(b"HTTP/1.1 204")
    assert _body(response) == b""


async def test_a_caller_that_does_not_read_gets_every_piece_in_order(
    nursery: trio.Nursery,
) -> None:
    """Pieces larger than the socket buffers (20 MB in all): writes are partial, and the
    rest of each waits for the socket under the send lock."""
    pieces = [bytes([65 + number]) * 1_000_000 for number in range(20)]
    app = StreamingApp(pieces)
    address = await _serve(nursery, app)
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(_request())
        await trio.testing.wait_all_tasks_blocked()
        assert not app.finished.is_set()  # the buffers are full: the app waits on the socket
        received = bytearray()
        while data := await stream.receive_some(1 << 16):
            received += data
    expected = b"".join(b"%x\r\n%b\r\n" % (len(piece), piece) for piece in pieces)
    assert _body(bytes(received)) == expected + b"0\r\n\r\n"
    assert app.finished.is_set()


async def test_a_caller_gone_mid_stream_ends_only_its_connection(nursery: trio.Nursery) -> None:
    """Writes to a connection the caller closed fail quietly, as Hypercorn's own do: the
    app finishes its sends, and the server goes on serving."""
    hold = trio.Event()
    app = StreamingApp([b"data: first\n\n"] + [b"data: more\n\n"] * 50, hold=hold)
    address = await _serve(nursery, app)
    stream = await trio.open_tcp_stream(*address)
    await stream.send_all(_request())
    received = b""
    while b"data: first" not in received:
        received += await stream.receive_some(1 << 16)
    linger_zero = struct.pack("ii", 1, 0)  # close with a reset: every later write fails
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_zero)
    await stream.aclose()
    await trio.testing.wait_all_tasks_blocked()
    hold.set()
    with trio.fail_after(GUARD_S):
        await app.finished.wait()
    app.hold = None
    async with httpx2.AsyncClient() as client:
        again = await client.post(f"http://{address[0]}:{address[1]}/stream")
    assert again.content == b"".join(app.pieces)


async def test_stopping_does_not_wait_for_a_caller_that_does_not_read() -> None:
    """A piece half written to a caller that reads nothing is finished under a shield;
    the server's graceful timeout still ends it (closing the connection frees the write)."""
    app = StreamingApp(BEYOND_SOCKET_BUFFERS)
    server, address = _server(app, graceful_timeout_s=0.1)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            stream = await trio.open_tcp_stream(*address)
            await stream.send_all(_request())
            await trio.testing.wait_all_tasks_blocked()
            assert server.in_flight == 1  # blocked on the full socket
            server.terminate()
        await stream.aclose()
    assert not app.finished.is_set()


async def test_a_caller_that_takes_nothing_for_the_send_timeout_is_disconnected(
    nursery: trio.Nursery,
) -> None:
    app = StreamingApp(BEYOND_SOCKET_BUFFERS)
    server, address = _server(app, send_timeout_s=0.2)
    await nursery.start(server.serve)
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(_request())
        with trio.fail_after(GUARD_S):
            await app.finished.wait()  # its writes failed quietly, as for a caller gone
        received = bytearray()
        with contextlib.suppress(trio.BrokenResourceError):  # a reset: bytes left unsent
            while data := await stream.receive_some(1 << 16):
                received += data
    assert len(_body(bytes(received))) < 20_000_000
    assert not received.endswith(b"0\r\n\r\n")


class DirectApp:
    """Writes 1 MB pieces with `ChunkedBodyWriter.write_now` (the run relay's way, from
    a task that never waits) until the socket takes one only in part, then the rest with
    `write_rest`; `partial` is set at that point."""

    def __init__(self, headers: Headers = ()) -> None:
        self.headers = list(headers)
        self.written: list[bytes] = []
        self.refused = 0
        """Pieces `write_now` did not take (they went as body messages instead)."""
        self.partial = trio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await complete_lifespan(receive, send)
            return
        assert isinstance(send, ChunkedBodyWriter)
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        for number in range(len(BEYOND_SOCKET_BUFFERS)):
            piece = bytes([65 + number]) * 1_000_000
            rest = send.write_now(piece)
            if rest is None:
                self.refused += 1
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            self.written.append(piece)
            if rest:
                self.partial.set()
                await send.write_rest(rest)
                break
        await send({"type": "http.response.body", "body": b""})


async def test_a_piece_written_without_waiting_is_finished_by_write_rest(
    nursery: trio.Nursery,
) -> None:
    """What the socket did not take of a piece written at once comes before anything
    else, so the caller reads every piece whole and in order."""
    app = DirectApp()
    address = await _serve(nursery, app)  # type: ignore[arg-type]
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(_request())
        with trio.fail_after(GUARD_S):
            await app.partial.wait()  # the socket is full: that piece was taken in part
        received = bytearray()
        while data := await stream.receive_some(1 << 16):
            received += data
    assert app.refused == 0
    expected = b"".join(b"%x\r\n%b\r\n" % (len(piece), piece) for piece in app.written)
    assert _body(bytes(received)) == expected + b"0\r\n\r\n"


async def test_a_body_framed_by_its_length_is_not_written_without_waiting(
    nursery: trio.Nursery,
) -> None:
    length = 1_000_000 * len(BEYOND_SOCKET_BUFFERS)
    app = DirectApp(headers=[(b"content-length", str(length).encode())])
    address = await _serve(nursery, app)  # type: ignore[arg-type]
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(_request())
        received = bytearray()
        while data := await stream.receive_some(1 << 16):
            received += data
    assert app.refused == len(app.written) == len(BEYOND_SOCKET_BUFFERS)
    assert not app.partial.is_set()
    assert _body(bytes(received)) == b"".join(app.written)


# --- keep-alive (iop_edge.http.keep_alive) ------------------------------------------------

KEEP_ALIVE_REQUEST = b"POST /stream HTTP/1.1\r\nhost: t\r\n\r\n"


async def _one_response(stream: trio.SocketStream) -> bytes:
    """Read one chunked response of `PIECES` off a keep-alive connection."""
    received = bytearray()
    while not received.endswith(b"0\r\n\r\n"):
        data = await stream.receive_some(1 << 16)
        assert data, "the server closed the connection mid-response"
        received += data
    return bytes(received)


async def test_a_connection_its_client_closed_is_released_at_once(nursery: trio.Nursery) -> None:
    """Hypercorn kept a connection its client had closed (its task, and its socket in
    CLOSE_WAIT) until the keep-alive timeout was up: 75 s of a descriptor per request for
    a client that connects per request."""
    server, address = _server(StreamingApp(PIECES))
    await nursery.start(server.serve)
    for _ in range(3):
        stream = await trio.open_tcp_stream(*address)
        await stream.send_all(KEEP_ALIVE_REQUEST)
        await _one_response(stream)
        assert server.open_connections >= 1
        await stream.aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert server.open_connections == 0


async def test_an_idle_connection_is_closed_when_its_keep_alive_time_is_up(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    server, address = _server(StreamingApp(PIECES), keep_alive_timeout_s=30)
    await nursery.start(server.serve)
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        for _ in range(2):  # each request starts the time again
            await stream.send_all(KEEP_ALIVE_REQUEST)
            await _one_response(stream)
            idle_from = trio.current_time()
            with trio.move_on_after(29):
                assert await stream.receive_some(1) == b"", "closed before its time"
        assert await stream.receive_some(1) == b""  # closed by the server
        assert 30 <= trio.current_time() - idle_from < 31
    await trio.testing.wait_all_tasks_blocked()
    assert server.open_connections == 0


async def test_a_request_longer_than_the_keep_alive_time_is_not_cut(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    hold = trio.Event()
    app = StreamingApp(PIECES, hold=hold)
    server, address = _server(app, keep_alive_timeout_s=30)
    await nursery.start(server.serve)
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(KEEP_ALIVE_REQUEST)
        await trio.sleep(300)  # the reply waits on `hold` meanwhile; time only jumps
        hold.set()
        response = await _one_response(stream)
    assert _body(response) == PIECES_CHUNKED  # whole: not cut when the time was up


async def test_stopping_closes_idle_connections_at_once_and_busy_ones_after_their_reply(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hold = trio.Event()
    app = StreamingApp(PIECES, hold=hold)
    server, address = _server(app)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        idle = await trio.open_tcp_stream(*address)
        busy = await trio.open_tcp_stream(*address)
        await busy.send_all(KEEP_ALIVE_REQUEST)
        await trio.testing.wait_all_tasks_blocked()  # the busy one's reply waits on `hold`
        stopped_at = trio.current_time()
        server.terminate()
        assert await idle.receive_some(1) == b""
        assert trio.current_time() == stopped_at  # at once, not after any timeout
        hold.set()
        response = await _one_response(busy)
        assert await busy.receive_some(1) == b""  # closed after its reply
    assert _body(response) == PIECES_CHUNKED
    await idle.aclose()
    await busy.aclose()


async def test_a_response_framed_by_its_length_goes_out_in_one_write(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Head and body in one write (Hypercorn: the head, the body, then an empty write),
    byte for byte what Hypercorn writes; a body-less reply's head still goes out."""
    writes: list[bytes] = []
    write = os.write

    def recording_write(fd: int, data: bytes) -> int:
        writes.append(bytes(data))
        return write(fd, data)

    monkeypatch.setattr("iop_edge.http.connection.os.write", recording_write)
    body = b'{"id": "cmpl-1"}'
    app = StreamingApp([], last=body, headers=[(b"content-length", b"%d" % len(body))])
    address = await _serve(nursery, app)
    response = await _exchange(address, _request())
    assert writes == [response]
    assert response.startswith(b"HTTP/1.1 200 \r\n") and _body(response) == body

    writes.clear()
    head = await _exchange(address, _request(method="HEAD"))
    assert writes == [head] and head.endswith(b"\r\n\r\n")


class WatchingApp:
    """Holds each request open, watching its connection (`Connection.on_client_gone`);
    `stop_first` stops the first request's watch before its caller leaves."""

    def __init__(self, *, stop_first: bool = False) -> None:
        self.stop_first = stop_first
        self.watching = trio.Event()
        self.gone: list[str] = []
        self.connection: Connection | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await complete_lifespan(receive, send)
            return
        self.connection = current_connection()
        assert self.connection is not None
        stop = self.connection.on_client_gone(lambda: self.gone.append(scope["path"]))
        if self.stop_first:
            stop()
        self.watching.set()
        await trio.sleep_forever()


async def test_a_request_in_flight_hears_its_caller_leave(nursery: trio.Nursery) -> None:
    """A caller that closes its connection mid-request is heard by the watch of the
    request in flight, once; a watch begun after the connection stopped reading is
    answered at once."""
    app = WatchingApp()
    address = await _serve(nursery, app)
    stream = await trio.open_tcp_stream(*address)
    await stream.send_all(b"POST /first HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n")
    with trio.fail_after(GUARD_S):
        await app.watching.wait()
    assert app.gone == []
    await stream.aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert app.gone == ["/first"]
    assert app.connection is not None
    app.connection.on_client_gone(lambda: app.gone.append("late"))
    assert app.gone == ["/first", "late"]


async def test_a_watch_stopped_hears_nothing(nursery: trio.Nursery) -> None:
    app = WatchingApp(stop_first=True)
    address = await _serve(nursery, app)
    stream = await trio.open_tcp_stream(*address)
    await stream.send_all(b"POST /first HTTP/1.1\r\nhost: t\r\ncontent-length: 0\r\n\r\n")
    with trio.fail_after(GUARD_S):
        await app.watching.wait()
    await stream.aclose()
    await trio.testing.wait_all_tasks_blocked()
    assert app.gone == []
