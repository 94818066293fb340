"""The floor of IOP's stack: an Edge and a Node that only relay (`Stack floor` in the tables).

A request through IOP crosses three transport parts: the Edge's HTTP server (Hypercorn's
connection handling, as `iop_edge.http.server` runs it), a trio-websocket connection
between a Node and its Edge, and the Node's HTTP client to the upstream (httpcore2, on the
keep-alive connections of `iop_node.adapters.run_connections`). This target crosses the
same three, in two processes, and does nothing else:

- `front` serves the caller's HTTP exactly as the Edge serves its OpenAI listener (the
  server of the `Edge HTTP` floor) and accepts websockets, as the Edge accepts its Nodes.
  Each request's body goes to the back in one message. A completion goes to its caller
  with its length in one body message; a stream's pieces as they come, those already
  waiting in one body message (as the Edge writes a run's buffered chunks).
- `back` dials the front (as a Node dials its Edge) and sends each request upstream the
  way the Node's HTTP adapter does. Each upstream read is one frame (request number,
  kind, length, data), then an end; one writer sends every frame queued by then in one
  message, as a Node's writer coalesces its runs' chunks (the batched wire, design §3).

Nothing is parsed (the front asks the body whether it streams as the fake upstream does,
by a byte search), no model is resolved, nothing is admitted, queued, metered, relabelled
or logged, and no error is handled beyond ending the request (a caller that stops reading
stalls the front's reader: a bench fixture, not a gateway). So its CPU per request is
what a gateway built from these parts in this shape costs before its first line of logic;
IOP's own work is the difference between IOP and this floor.

    python -m bench.stack_floor front [--port 0]
    python -m bench.stack_floor back --front WS_URL --upstream URL

`front` prints `bench-stack-front listening on HTTP_URL WS_URL` once accepting; `back`
prints `bench-stack-back connected to WS_URL` once its websocket is open. Both serve until
stopped (SIGINT/SIGTERM). `start_stack_floor` starts the pair.
"""

from __future__ import annotations

import argparse
import struct
import sys
from dataclasses import dataclass
from typing import Final

import httpcore2
import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    WebSocketRequest,
    open_websocket_url,
    serve_websocket,
)

from bench.asgi_floor import serve_lifespan
from bench.services import Service, python_argv, start_service, url_after
from bench.upstream import asks_for_stream
from iop_edge.core.configuration.listen import parse_listen_address
from iop_edge.http.server import HttpServer, hypercorn_config
from iop_edge.runtime.lifecycle.listeners import bind_listener
from iop_node.adapters.run_connections import RunConnections
from schemas.limits import MAX_FRAME_BYTES

FRONT_READY_PREFIX: Final = "bench-stack-front listening on "
BACK_READY_PREFIX: Final = "bench-stack-back connected to "
_CHAT_PATH: Final = "/v1/chat/completions"
#: A message is frames, each a header (the request's number, what the frame is, the length
#: of its data) and its data.
_HEADER: Final = struct.Struct("!IBI")
_REQUEST, _PIECE, _END = 0, 1, 2
#: Frames the back's calls may queue for its one writer.
_OUTBOX_FRAMES: Final = 1024
#: Frames of one request waiting for its task: a stream's pieces, then its end.
_PENDING_FRAMES: Final = 64
#: As the Node's link (`iop_node.uplink.link_settings.MESSAGE_QUEUE_SIZE`).
_MESSAGE_QUEUE_SIZE: Final = 64
#: Keep-alive connections the back keeps to the upstream: above any bench concurrency.
_KEEP_CONNECTIONS: Final = 256
_KEEPALIVE_EXPIRY_S: Final = 60.0
_JSON_HEADERS: Final = [(b"content-type", b"application/json")]
_SSE_HEADERS: Final = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def _frame(number: int, kind: int, data: bytes = b"") -> bytes:
    return _HEADER.pack(number, kind, len(data)) + data


def _frames(message: bytes) -> list[tuple[int, int, bytes]]:
    """The (request number, kind, data) of each frame in `message`."""
    frames: list[tuple[int, int, bytes]] = []
    at = 0
    while at < len(message):
        number, kind, length = _HEADER.unpack_from(message, at)
        at += _HEADER.size
        frames.append((number, kind, message[at : at + length]))
        at += length
    return frames


# --- front: the caller's HTTP server and the websocket to the back ---------------------------


class _Front:
    """Relays each caller's request to the back over its websocket (the newest one)."""

    def __init__(self) -> None:
        self._back: WebSocketConnection | None = None
        self._waiting: dict[int, trio.MemorySendChannel[tuple[int, bytes]]] = {}
        self._next_number = 0

    async def accept_back(self, request: WebSocketRequest) -> None:
        back = await request.accept()
        self._back = back
        try:
            while True:
                message = await back.get_message()
                assert isinstance(message, bytes)
                for number, kind, data in _frames(message):
                    waiting = self._waiting.get(number)
                    if waiting is not None:
                        await waiting.send((kind, data))
        except ConnectionClosed:
            pass
        finally:
            if self._back is back:
                self._back = None

    async def app(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        parts: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            parts.append(message.get("body", b""))  # type: ignore[arg-type]
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        back = self._back
        if back is None or scope["method"] != "POST" or scope["path"] != _CHAT_PATH:
            status = 503 if back is None else 404
            await send({"type": "http.response.start", "status": status, "headers": []})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        number = self._next_number = (self._next_number + 1) % 2**32
        sender, replies = trio.open_memory_channel[tuple[int, bytes]](_PENDING_FRAMES)
        self._waiting[number] = sender
        try:
            await back.send_message(_frame(number, _REQUEST, body))
            if asks_for_stream(body):
                await _relay_stream(replies, send)
            else:
                await _relay_body(replies, send)
        finally:
            del self._waiting[number]


Replies = trio.MemoryReceiveChannel[tuple[int, bytes]]


async def _relay_body(replies: Replies, send: ASGISendCallable) -> None:
    """A completion: the back's pieces joined, sent with its length in one body message."""
    parts: list[bytes] = []
    async for kind, data in replies:
        if kind == _END:
            break
        parts.append(data)
    body = b"".join(parts)
    headers = [*_JSON_HEADERS, (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _relay_stream(replies: Replies, send: ASGISendCallable) -> None:
    """A stream: the back's pieces as they come, those already waiting in one body message
    (as the Edge writes a run's buffered chunks in one piece)."""
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    ended = False
    while not ended:
        kind, data = await replies.receive()
        parts: list[bytes] = []
        while kind != _END:
            parts.append(data)
            try:
                kind, data = replies.receive_nowait()
            except trio.WouldBlock:
                break
        ended = kind == _END
        if parts:
            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _serve_front(host: str, port: int) -> None:
    front = _Front()
    listen = f"{host}:{port}"
    async with trio.open_nursery() as nursery:
        sock = bind_listener("openai", listen, parse_listen_address(listen)).socket
        http_url = await nursery.start(HttpServer(front.app, hypercorn_config(listen), sock).serve)
        backs = await nursery.start(
            lambda task_status: serve_websocket(
                front.accept_back,
                host,
                0,
                ssl_context=None,
                max_message_size=MAX_FRAME_BYTES,
                task_status=task_status,
            )
        )
        print(f"{FRONT_READY_PREFIX}{http_url} ws://{host}:{backs.port}/", flush=True)


# --- back: the upstream calls ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Upstream:
    """The upstream's chat URL and the request head every call sends."""

    url: httpcore2.URL
    headers: list[tuple[bytes, bytes]]

    @classmethod
    def at(cls, root: str) -> _Upstream:
        url = httpcore2.URL(root.rstrip("/") + _CHAT_PATH)
        host = url.host + b":%d" % url.port if url.port else url.host
        headers = [
            (b"Host", host),
            (b"Connection", b"keep-alive"),
            (b"Accept-Encoding", b"identity"),
            (b"Content-Type", b"application/json"),
        ]
        return cls(url, headers)


async def _serve_back(front_url: str, upstream_root: str) -> None:
    upstream = _Upstream.at(upstream_root)
    outbox, frames = trio.open_memory_channel[bytes](_OUTBOX_FRAMES)
    async with (
        httpcore2.AsyncConnectionPool() as pool,
        open_websocket_url(
            front_url, max_message_size=MAX_FRAME_BYTES, message_queue_size=_MESSAGE_QUEUE_SIZE
        ) as front,
        trio.open_nursery() as calls,
    ):
        connections = RunConnections(pool, keep=_KEEP_CONNECTIONS, expiry_s=_KEEPALIVE_EXPIRY_S)
        calls.start_soon(_write, front, frames)
        print(BACK_READY_PREFIX + front_url, flush=True)
        try:
            while True:
                message = await front.get_message()
                assert isinstance(message, bytes)
                for number, _, body in _frames(message):
                    calls.start_soon(_call, outbox, connections, upstream, number, body)
        except ConnectionClosed:
            calls.cancel_scope.cancel()


async def _write(front: WebSocketConnection, frames: trio.MemoryReceiveChannel[bytes]) -> None:
    """Send the calls' frames, all those queued by now in one message (as a Node's writer
    coalesces the chunks of its runs)."""
    async for frame in frames:
        batch = [frame]
        while True:
            try:
                batch.append(frames.receive_nowait())
            except trio.WouldBlock:
                break
        await front.send_message(b"".join(batch))


async def _call(
    outbox: trio.MemorySendChannel[bytes],
    connections: RunConnections,
    upstream: _Upstream,
    number: int,
    body: bytes,
) -> None:
    request = httpcore2.Request(
        b"POST",
        upstream.url,
        headers=[*upstream.headers, (b"Content-Length", b"%d" % len(body))],
        content=body,
    )
    connection, response = await connections.send(request)
    try:
        async for data in response.stream:  # type: ignore[union-attr]
            await outbox.send(_frame(number, _PIECE, data))
    finally:
        await response.aclose()
        await connections.give_back(connection)
    await outbox.send(_frame(number, _END))


# --- starting the pair ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StackFloor:
    """The running pair; `url` is where callers send requests."""

    front: Service[str]
    back: Service[str]

    @property
    def url(self) -> str:
        return self.front.ready.split()[0]

    @property
    def processes(self) -> dict[str, int]:
        return {"front": self.front.pid, "back": self.back.pid}


async def start_stack_floor(nursery: trio.Nursery, upstream: str) -> StackFloor:
    """Start the front, then the back dialing it; return once the back is connected."""
    front = await start_service(
        nursery,
        "bench-stack-front",
        python_argv("bench.stack_floor", "front"),
        url_after(FRONT_READY_PREFIX),
    )
    websocket_url = front.ready.split()[1]
    back = await start_service(
        nursery,
        "bench-stack-back",
        python_argv("bench.stack_floor", "back", "--front", websocket_url, "--upstream", upstream),
        url_after(BACK_READY_PREFIX),
    )
    return StackFloor(front, back)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.stack_floor",
        description="IOP's transport parts relaying the benchmark's requests, and nothing else.",
    )
    roles = parser.add_subparsers(dest="role", required=True)
    front = roles.add_parser("front", help="the caller's HTTP server, accepting the back")
    front.add_argument("--host", default="127.0.0.1")
    front.add_argument("--port", type=int, default=0)
    back = roles.add_parser("back", help="dials the front, calls the upstream")
    back.add_argument("--front", required=True, help="the front's websocket URL")
    back.add_argument("--upstream", required=True, help="the upstream's root URL")
    args = parser.parse_args(argv)
    try:
        if args.role == "front":
            trio.run(_serve_front, args.host, args.port)
        else:
            trio.run(_serve_back, args.front, args.upstream)
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
