"""`iop_node.dial`: what a failed dial raises, by URL and by address (the link reads why
from it; an exception group would read as a bug)."""

from __future__ import annotations

import socket

import pytest
from trio_websocket import HandshakeError

from iop_node.dial import open_edge_websocket

LIMITS = {
    "max_message_size": 1 << 20,
    "message_queue_size": 1,
    "receive_buffer_size": 1 << 16,
    "connect_timeout": 10.0,
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
