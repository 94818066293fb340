"""A request sent on a keep-alive connection at the instant a restart drains it is
answered, never reset (design §13, `runtime.lifecycle.handoff`).

Two HTTP servers in-process on one listening socket, the old and its successor, joined
by the handoff channel a restart makes. The request's bytes are written into the old
server's connection and the drain begins before the old server's task runs: the race
that used to lose a request (the close and the request crossing on the wire), made
deterministic. The connection goes over as it is and the successor reads the request
from the socket. A connection whose response begins after the drain finishes it here,
with `Connection: close`, and is not handed over; one whose response began before the
drain (its head said nothing of closing) goes to the successor once the response ends,
so the client's next request on it is served there.
"""

from __future__ import annotations

import socket
from typing import Any

import h11
import trio
import trio.testing

from iop_edge.http.server import HttpServer
from iop_edge.runtime.lifecycle.handoff import HandoffSender, handoff_pair, receive_handoff
from tests.e2e.test_http_server import App, _socket, _start
from tests.timing import GUARD_S


class Client:
    """A keep-alive HTTP/1.1 client on a plain blocking socket: its writes take no Trio
    checkpoint, so a test decides exactly what the server has run when they land (its
    reads wait in a worker thread)."""

    def __init__(self, server: HttpServer) -> None:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.h11 = h11.Connection(h11.CLIENT)

    def send_request(self, path: str) -> None:
        request = h11.Request(method="GET", target=path, headers=[("host", "edge")])
        self.sock.sendall(self.h11.send(request) + self.h11.send(h11.EndOfMessage()))

    async def response(self) -> tuple[h11.Response, bytes]:
        head: h11.Response | None = None
        body = b""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await trio.to_thread.run_sync(self.sock.recv, 65536))
            elif isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
                    self.h11.start_next_cycle()
                return head, body
            else:
                raise AssertionError(f"no response: {event!r}")

    async def get(self, path: str) -> bytes:
        self.send_request(path)
        return (await self.response())[1]


async def _successor(
    nursery: trio.Nursery, sock: socket.socket
) -> tuple[HttpServer, HandoffSender, dict[str, tuple[float, float]]]:
    new = await _start(nursery, App("new"), sock)
    ours, theirs = handoff_pair()
    carried: dict[str, tuple[float, float]] = {}
    nursery.start_soon(
        lambda: receive_handoff(
            theirs, adopt=lambda role, connection: new.adopt(connection), carry_over=carried.update
        )
    )
    return new, HandoffSender(ours, lambda: {"alice": (10.0, 350.0)}), carried


async def test_a_request_on_its_way_when_the_drain_begins_is_served_by_the_successor(
    nursery: trio.Nursery,
) -> None:
    sock = _socket()
    old_app = App("old")
    old = await _start(nursery, old_app, sock)
    client = Client(old)
    assert await client.get("/") == b"old"  # before the successor shares the socket
    new, handoff, carried = await _successor(nursery, sock)
    await trio.testing.wait_all_tasks_blocked()  # the old server's connection is idle
    # The next request reaches the socket, and the old server drains before it reads it.
    client.send_request("/")
    old.stop_accepting(handoff)
    handoff.send_windows()
    assert handoff.connections == 1
    assert (await client.response())[1] == b"new"
    assert await client.get("/") == b"new"  # the connection lives on, the successor's
    assert old_app.served == 1
    await trio.testing.wait_all_tasks_blocked()
    assert old.open_connections == 0
    assert new.open_connections == 1
    assert carried == {"alice": (10.0, 350.0)}
    client.sock.close()


async def test_a_connection_busy_at_the_drain_finishes_here_and_closes(
    nursery: trio.Nursery,
) -> None:
    sock = _socket()
    old_app = App("old")
    old = await _start(nursery, old_app, sock)
    client = Client(old)
    _, handoff, _ = await _successor(nursery, sock)
    client.send_request("/slow")
    with trio.fail_after(GUARD_S):
        while old.in_flight == 0:  # the old server reads it (it is the old one's)
            await trio.testing.wait_all_tasks_blocked()
    old.stop_accepting(handoff)
    assert handoff.connections == 0
    old_app.release.set()
    head, body = await client.response()
    assert body == b"old"
    assert (b"connection", b"close") in head.headers
    assert old_app.served == 1
    client.sock.close()


class StreamingApp(App):
    """`/stream` sends its head and a first chunk, then waits for `release` before its
    last chunk; everything else as `App`."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.streaming = trio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan" or scope["path"] != "/stream":
            await super().__call__(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first ", "more_body": True})
        self.streaming.set()
        await self.release.wait()
        self.served += 1
        await send({"type": "http.response.body", "body": self.name.encode()})


async def test_a_response_begun_before_the_drain_leaves_its_connection_to_the_successor(
    nursery: trio.Nursery,
) -> None:
    sock = _socket()
    old_app = StreamingApp("old")
    old = await _start(nursery, old_app, sock)
    client = Client(old)
    new, handoff, _ = await _successor(nursery, sock)
    client.send_request("/stream")
    with trio.fail_after(GUARD_S):
        await old_app.streaming.wait()  # its head is out: keep-alive, nothing said of closing
    old.stop_accepting(handoff)
    assert handoff.connections == 0  # busy: not handed over yet
    old_app.release.set()
    head, body = await client.response()
    assert body == b"first old"
    assert (b"connection", b"close") not in head.headers
    await trio.testing.wait_all_tasks_blocked()  # the old server saw the connection idle
    # The client, as any keep-alive client, sends its next request on the connection.
    assert await client.get("/") == b"new"
    assert handoff.connections == 1
    assert (old.open_connections, new.open_connections) == (0, 1)
    client.sock.close()
