"""`iop_node.uplink.dial`: what a failed dial raises, by URL and by address (the link reads why
from it; an exception group would read as a bug)."""

from __future__ import annotations

import socket
import struct
from functools import partial

import pytest
import trio
from trio_websocket import ConnectionRejected, HandshakeError, WebSocketRequest, serve_websocket

from iop_node.uplink.dial import WRONG_PORT_HINT, describe_refused_upgrade, open_edge_websocket
from schemas.compat.trio_websocket import write_now
from tests.timing import GUARD_S

LIMITS = {
    "max_message_size": 1 << 20,
    "message_queue_size": 1,
    "receive_buffer_size": 1 << 16,
    # Far above any wait here: a dial that fails does so at once, not at this limit.
    "connect_timeout": 100.0,
    "disconnect_timeout": 1.0,
}


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.mark.parametrize("address", [None, "127.0.0.1"], ids=["by-url", "by-address"])
async def test_a_refused_dial_is_a_handshake_error_caused_by_the_refusal(
    address: str | None,
) -> None:
    url = f"ws://127.0.0.1:{_closed_port()}"
    with pytest.raises(HandshakeError) as raised:
        async with open_edge_websocket(url, address, **LIMITS):
            pass
    cause = raised.value.__cause__
    assert isinstance(cause, OSError)
    assert f"connect to 127.0.0.1:{url.rsplit(':', 1)[1]} failed" in str(cause)


@pytest.mark.parametrize("how", ["closed", "reset"])
async def test_a_connection_closed_before_the_upgrade_is_answered_fails_at_once(
    nursery: trio.Nursery, how: str
) -> None:
    """A peer that takes the connection and closes it unanswered (an Edge stopping with
    the connection in its backlog) fails the dial now, not at the connect timeout."""

    async def take_and_close(stream: trio.SocketStream) -> None:
        await stream.receive_some()  # the upgrade request
        if how == "reset":  # SO_LINGER 0: the close is a reset, as from a closed backlog
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()

    [listener] = await nursery.start(partial(trio.serve_tcp, take_and_close, 0, host="127.0.0.1"))
    url = f"ws://127.0.0.1:{listener.socket.getsockname()[1]}"
    with trio.fail_after(GUARD_S), pytest.raises(HandshakeError) as raised:
        async with open_edge_websocket(url, None, **LIMITS):
            pass
    assert "closed before the websocket upgrade was answered" in str(raised.value)


@pytest.mark.parametrize(
    ("status", "body", "says", "hint"),
    [
        (400, b'{"error":{"message":"not here","code":"not_a_node_port"}}', ": not here;", True),
        (404, b"<html>\n<h1>Not   Found</h1></html>", ": <html> <h1>Not Found</h1></html>;", True),
        (502, None, "HTTP 502", False),
    ],
    ids=["an-edge-http-port", "another-http-server", "a-proxy-whose-upstream-is-down"],
)
def test_a_refused_upgrade_says_what_the_server_said_and_what_to_fix(
    status: int, body: bytes | None, says: str, hint: bool
) -> None:
    line = describe_refused_upgrade(ConnectionRejected(status, (), body))
    assert line.startswith(f"websocket upgrade refused with HTTP {status}")
    assert says in line
    assert (WRONG_PORT_HINT in line) is hint


def test_a_long_refusal_body_is_quoted_in_part() -> None:
    line = describe_refused_upgrade(ConnectionRejected(404, (), b"x" * 10_000))
    assert len(line) < 600 and line.count("x") <= 300


async def test_a_dialed_connection_is_written_to_directly(nursery: trio.Nursery) -> None:
    """The dial wraps its stream (to fail an unanswered upgrade at once) and names the
    plain one beneath: the link's frames go out with one write each, not through the
    lock and the send that each yield (`schemas.compat.trio_websocket.write_now`)."""
    received: list[bytes | str] = []
    arrived = trio.Event()

    async def keep(request: WebSocketRequest) -> None:
        websocket = await request.accept()
        received.append(await websocket.get_message())
        arrived.set()
        await trio.sleep_forever()

    server = await nursery.start(serve_websocket, keep, "127.0.0.1", 0, None)
    async with open_edge_websocket(f"ws://127.0.0.1:{server.port}", None, **LIMITS) as edge:
        assert write_now(edge, b"a frame") == b""
        with trio.fail_after(GUARD_S):
            await arrived.wait()
    assert received == [b"a frame"]
