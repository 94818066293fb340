"""Open the websocket to one Edge: by its URL, or to one address of a named Edge.

A Node that serves every address a DNS name resolves to (`iop-node run --edge-dns`)
dials each address itself, yet must present the name: in the `Host` header and, over
`wss://`, in TLS (SNI, and the name the certificate must match). trio-websocket's
`open_websocket_url` connects to the URL's host only, so for an address this opens the
TCP (and TLS) stream here and hands it to `wrap_client_stream`, with the same bounds on
the opening and closing handshakes.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import trio
from trio_websocket import (
    ConnectionTimeout,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
    wrap_client_stream,
)

__all__ = ["open_edge_websocket"]


@asynccontextmanager
async def open_edge_websocket(
    url: str,
    address: str | None,
    *,
    max_message_size: int,
    message_queue_size: int,
    receive_buffer_size: int,
    connect_timeout: float,
    disconnect_timeout: float,
) -> AsyncIterator[WebSocketConnection]:
    """A websocket to the Edge at `url`, connected to `address` when one is given.

    Raises trio-websocket's `HandshakeError` family for anything that goes wrong before
    the connection is open (as `open_websocket_url` does)."""
    if address is None:
        async with open_websocket_url(
            url,
            max_message_size=max_message_size,
            message_queue_size=message_queue_size,
            receive_buffer_size=receive_buffer_size,
            connect_timeout=connect_timeout,
            disconnect_timeout=disconnect_timeout,
        ) as ws:
            yield ws
        return
    parts = urlsplit(url)
    secure = parts.scheme == "wss"
    name = parts.hostname or ""
    port = parts.port or (443 if secure else 80)
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host_header = name if port in (80, 443) else f"{name}:{port}"
    async with trio.open_nursery() as nursery:
        try:
            with trio.fail_after(connect_timeout):
                stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]
                stream = await trio.open_tcp_stream(address, port)
                if secure:
                    stream = trio.SSLStream(
                        stream,
                        ssl.create_default_context(),
                        server_hostname=name,
                        https_compatible=True,
                    )
                ws = await wrap_client_stream(
                    nursery,
                    stream,
                    host_header,
                    resource,
                    max_message_size=max_message_size,
                    message_queue_size=message_queue_size,
                    receive_buffer_size=receive_buffer_size,
                )
        except trio.TooSlowError:
            raise ConnectionTimeout from None
        except OSError as exc:
            raise HandshakeError from exc
        try:
            yield ws
        finally:
            # As `open_websocket_url` does: bounded, and not shielded (cancelled, the
            # socket is closed at once instead of waiting for the peer's answer).
            with trio.move_on_after(disconnect_timeout):
                await ws.aclose()
            nursery.cancel_scope.cancel()
