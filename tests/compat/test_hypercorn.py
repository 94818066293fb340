"""iop_edge.http.compat.hypercorn on the installed Hypercorn: every internal the Edge's HTTP
layer builds on is there, with the meaning it relies on, on a real connection handler.

A connection handler (`HypercornConnection`, as `iop_edge.http.connection.Connection` is
one) serves one end of a socket pair; the test speaks HTTP/1.1 on the other end and
watches every hook the compat module offers being called by Hypercorn itself. When an
upgrade takes something away, these tests fail naming it, before any e2e test fails in
a way that says nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
from hypercorn.config import Config

from iop_edge.http.compat.hypercorn import (
    HYPERCORN_VERSION,
    KNOWN_VERSIONS,
    Http11Protocol,
    HypercornConnection,
    WorkerContext,
    missing_capabilities,
    queued_receiver,
    wrap_app,
)
from tests.timing import GUARD_S

UPGRADE_ADVICE = (
    "see iop_edge/http/compat/hypercorn.py: adapt it to the new release, then widen "
    "KNOWN_VERSIONS and the hypercorn bound in pyproject.toml"
)


async def _hello(scope: Any, receive: Any, send: Any) -> None:
    """A one-route ASGI app: 200 and `hello` for any HTTP request."""
    if scope["type"] != "http":
        return
    headers = [(b"content-length", b"5")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"hello"})


class _IdleTask:
    """A keep-alive timer that records what Hypercorn asks of it."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.idle = trio.Event()

    async def restart(self, task_group: Any, action: Callable[..., Any]) -> None:
        self.calls.append("restart")
        self.idle.set()

    async def stop(self) -> None:
        self.calls.append("stop")


class _RecordingProtocol(Http11Protocol):
    """The HTTP/1.1 protocol, recording the refusals Hypercorn hands to the hook."""

    refused: list[int] = []

    async def send_error_response(self, status_code: int) -> None:
        self.refused.append(status_code)
        await super().send_error_response(status_code)


class _Probe(HypercornConnection):
    """A connection handler recording the hooks, with our protocol and idle task."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.idle = _IdleTask()
        self.replace_idle_task(self.idle)
        self.began = trio.Event()
        self.ended = trio.Event()

    def reading_begins(self) -> None:
        self.replace_http11_protocol(_RecordingProtocol)
        self.began.set()

    def reading_ended(self) -> None:
        self.ended.set()


def _probe(stream: trio.SocketStream, asgi_app: Any = _hello) -> _Probe:
    config = Config()
    app = wrap_app(asgi_app, config.wsgi_max_body_size, "asgi")
    return _Probe(app, config, WorkerContext(None), {}, stream)


async def _read_response(client: trio.SocketStream) -> bytes:
    """One response framed by its Content-Length (the app's, or Hypercorn's error's)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await client.receive_some(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += await client.receive_some(65536)
    return head + b"\r\n\r\n" + body


def test_the_installed_hypercorn_has_every_internal_the_edge_uses() -> None:
    missing = missing_capabilities()
    assert not missing, f"Hypercorn {HYPERCORN_VERSION}: {'; '.join(missing)}; {UPGRADE_ADVICE}"


def test_the_installed_version_is_one_known_to_work() -> None:
    assert HYPERCORN_VERSION.startswith(KNOWN_VERSIONS), (
        f"Hypercorn {HYPERCORN_VERSION} is installed; {UPGRADE_ADVICE}"
    )


def test_a_connection_handler_keeps_a_write_lock() -> None:
    left, right = trio.socket.socketpair()
    with left, right:
        probe = _probe(trio.SocketStream(left))
        assert isinstance(probe.write_lock, trio.Lock), (
            f"Hypercorn {HYPERCORN_VERSION}'s TCPServer has no send_lock: the Edge's direct "
            f"writes step aside, slower; {UPGRADE_ADVICE}"
        )


async def test_every_hook_is_called_by_hypercorn_on_a_real_connection(
    nursery: trio.Nursery,
) -> None:
    _RecordingProtocol.refused = []
    left, right = trio.socket.socketpair()
    probe = _probe(trio.SocketStream(left))
    client = trio.SocketStream(right)
    nursery.start_soon(probe.run)
    with trio.fail_after(GUARD_S):
        await probe.began.wait()
        assert type(probe.protocol.protocol) is _RecordingProtocol, "protocol not replaced"

        await client.send_all(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
        response = await _read_response(client)
        assert response.startswith(b"HTTP/1.1 200") and response.endswith(b"hello")
        await probe.idle.idle.wait()  # Hypercorn told the idle task: the connection idles
        assert probe.idle.calls[:2] == ["restart", "stop"], probe.idle.calls

        await client.send_all(b"NOT HTTP AT ALL\r\n\r\n")
        refusal = await _read_response(client)
        assert refusal.startswith(b"HTTP/1.1 400"), refusal
        assert _RecordingProtocol.refused == [400]

        await probe.ended.wait()  # the refusal ends the connection, and its reading
    await client.aclose()


async def test_closing_from_the_server_closes_the_connection(nursery: trio.Nursery) -> None:
    left, right = trio.socket.socketpair()
    probe = _probe(trio.SocketStream(left))
    client = trio.SocketStream(right)
    nursery.start_soon(probe.run)
    with trio.fail_after(GUARD_S):
        await probe.began.wait()
        await probe.close_from_server()
        assert await client.receive_some(1024) == b""  # the client sees the close
        await probe.ended.wait()
    await client.aclose()


async def test_the_protocol_wrapper_keeps_what_the_protocol_is_rebuilt_with(
    nursery: trio.Nursery,
) -> None:
    left, right = trio.socket.socketpair()
    probe = _probe(trio.SocketStream(left))
    nursery.start_soon(probe.run)
    with trio.fail_after(GUARD_S):
        await probe.began.wait()
    kept = ("app", "config", "context", "task_group", "state", "ssl", "client", "server", "send")
    missing = [name for name in kept if not hasattr(probe.protocol, name)]
    assert not missing, (
        f"Hypercorn {HYPERCORN_VERSION}'s ProtocolWrapper lacks {', '.join(missing)}; "
        f"{UPGRADE_ADVICE}"
    )
    await probe.close_from_server()
    right.close()


async def test_an_apps_receive_gives_what_the_connection_holds_without_a_wait(
    nursery: trio.Nursery,
) -> None:
    """The run endpoints take a body that came with its head without awaiting `receive`
    (`runs.RunEndpoints._read_json`): Hypercorn must hand the app the `receive` of the
    channel its protocol fills, with the request's body in it by the app's first step."""
    taken: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        take = queued_receiver(receive)
        taken.append(take)
        while take is not None:
            try:
                taken.append(take())
            except trio.WouldBlock:
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    left, right = trio.socket.socketpair()
    probe = _probe(trio.SocketStream(left), app)
    client = trio.SocketStream(right)
    nursery.start_soon(probe.run)
    with trio.fail_after(GUARD_S):
        await client.send_all(b'POST / HTTP/1.1\r\nHost: test\r\ncontent-length: 7\r\n\r\n{"a":1}')
        response = await client.receive_some(65536)
    assert response.startswith(b"HTTP/1.1 200"), response
    assert taken[0] is not None, (
        f"Hypercorn {HYPERCORN_VERSION} gives the app a `receive` of its own: every run's "
        f"body is awaited under a deadline, slower; {UPGRADE_ADVICE}"
    )
    bodies = [message for message in taken[1:] if message["type"] == "http.request"]
    assert b"".join(message["body"] for message in bodies) == b'{"a":1}', taken
    await probe.close_from_server()
    await client.aclose()


def test_a_receive_of_another_kind_is_only_awaited() -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    _, channel = trio.open_memory_channel[Any](1)
    assert queued_receiver(receive) is None
    assert queued_receiver(channel.receive_nowait) is None
    assert queued_receiver(channel.receive) == channel.receive_nowait
