"""The Edge's HTTP serving with a drain it controls (`iop_edge.http.server`).

What a zero-downtime restart relies on, shown on real sockets: a second server on the
same listening socket (the successor) takes the connections the first stops accepting,
including those already waiting in the accept queue; keep-alive clients are told to
reconnect on their next request; the drain waits for requests in progress.
"""

from __future__ import annotations

import socket
from typing import Any

import httpx2
import trio
import trio.testing

from iop_edge.core.configuration.listen import parse_listen_address
from iop_edge.http.server import HttpServer, hypercorn_config
from iop_edge.runtime.lifecycle.listeners import bind_listener
from tests.e2e.asgi import complete_lifespan
from tests.timing import GUARD_S


class App:
    """Answers every request with the server's name; `/slow` waits for `release`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.release = trio.Event()
        self.served = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await complete_lifespan(receive, send)
            return
        if scope["path"] == "/slow":
            await self.release.wait()
        self.served += 1
        body = self.name.encode()
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _socket() -> socket.socket:
    return bind_listener("openai", "127.0.0.1:0", parse_listen_address("127.0.0.1:0")).socket


async def _start(nursery: trio.Nursery, app: App, sock: socket.socket) -> HttpServer:
    server = HttpServer(app, hypercorn_config("127.0.0.1:0"), sock)
    await nursery.start(server.serve)
    return server


async def test_an_idle_keep_alive_connection_is_closed_and_its_client_reconnects(
    nursery: trio.Nursery,
) -> None:
    """A draining server closes its idle keep-alive connections at once: the client's
    pool sees the close before it reuses the connection, and its next request goes over
    a new one, to the successor, without an error."""
    sock = _socket()
    old = await _start(nursery, App("old"), sock)
    async with httpx2.AsyncClient(base_url=old.url) as client:
        assert (await client.get("/")).text == "old"
        assert old.open_connections == 1
        old.stop_accepting()
        await trio.testing.wait_all_tasks_blocked()
        assert old.open_connections == 0
        await _start(nursery, App("new"), sock)
        assert (await client.get("/")).text == "new"


async def test_a_reply_begun_while_draining_closes_its_connection(
    nursery: trio.Nursery,
) -> None:
    """A response that begins while the server drains says `Connection: close`, whenever
    its request came; a request pipelined behind it is never read (its client sends it
    again, on a new connection) and never reaches the app."""
    app = App("old")
    server = await _start(nursery, app, _socket())
    address = parse_listen_address(server.url.removeprefix("http://"))
    with socket.create_connection((address.host, address.port)) as raw:
        raw.sendall(
            b"GET /slow HTTP/1.1\r\nHost: localhost\r\n\r\n"
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
        )
        with trio.fail_after(GUARD_S):
            while server.in_flight == 0:
                await trio.testing.wait_all_tasks_blocked()
        server.stop_accepting()
        app.release.set()
        received = b""
        with trio.fail_after(GUARD_S):
            while chunk := await trio.to_thread.run_sync(raw.recv, 65536):
                received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"\r\nconnection: close" in head.lower()
    assert body == b"old"  # and nothing after it
    assert app.served == 1


async def test_connections_waiting_to_be_accepted_go_to_the_successor(
    nursery: trio.Nursery,
) -> None:
    """The old server stops accepting before the new one starts: connections arriving in
    between wait in the shared socket's queue and are served by the successor."""
    sock = _socket()
    old = await _start(nursery, App("old"), sock)
    url = old.url
    old.stop_accepting()
    answers: list[str] = []

    async def call() -> None:
        async with httpx2.AsyncClient(base_url=url) as client:
            answers.append((await client.get("/")).text)

    async with trio.open_nursery() as callers:
        for _ in range(20):
            callers.start_soon(call)
        await trio.testing.wait_all_tasks_blocked()
        assert answers == []  # connected (queued by the kernel), not accepted yet
        await _start(nursery, App("new"), sock)
    assert answers == ["new"] * 20


async def test_drain_waits_for_requests_in_progress(nursery: trio.Nursery) -> None:
    app = App("old")
    server = await _start(nursery, app, _socket())
    answers: list[str] = []

    async def slow() -> None:
        async with httpx2.AsyncClient(base_url=server.url) as client:
            answers.append((await client.get("/slow")).text)

    nursery.start_soon(slow)
    await trio.testing.wait_all_tasks_blocked()
    assert server.in_flight == 1
    server.stop_accepting()
    quiet = trio.Event()

    async def drain() -> None:
        await server.wait_quiet(0.05)
        quiet.set()

    nursery.start_soon(drain)
    await trio.testing.wait_all_tasks_blocked()
    assert not quiet.is_set()
    app.release.set()
    with trio.fail_after(GUARD_S):
        await quiet.wait()
    assert answers == ["old"]
    server.terminate()
