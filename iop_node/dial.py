"""Open the websocket to one Edge: by its URL, or to one address of a named Edge.

A Node that serves every address a DNS name resolves to (`iop-node run --edge-dns`)
dials each address itself, yet must present the name: in the `Host` header and, over
`wss://`, in TLS (SNI, and the name the certificate must match). trio-websocket's
`open_websocket_url` connects to the URL's host only, so the TCP (and TLS) stream is
opened here, to the address when there is one and to the URL's host otherwise, and handed
to `wrap_client_stream`, with the bounds `open_websocket_url` puts on the opening and
closing handshakes. Two things are done here as that opener does not, or not for us:

- The TLS handshake is completed before the websocket's, so a certificate the Node does
  not trust fails the dial at once, saying so; done by the websocket's first read, it
  surfaced as a handshake timeout.
- Errors leave as themselves. The connection's nursery wraps whatever ends the session in
  an exception group; the one error it holds is raised alone (as `open_websocket_url`
  does for its own nursery), so the link sees `ConnectionClosed` when an Edge goes away,
  not a group it cannot read.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import NoReturn
from urllib.parse import urlsplit

import trio
from trio_websocket import (
    ConnectionTimeout,
    HandshakeError,
    WebSocketConnection,
    wrap_client_stream,
)

__all__ = ["open_edge_websocket"]

Stream = trio.SocketStream | trio.SSLStream[trio.SocketStream]


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
    the connection is open (as `open_websocket_url` does): `ConnectionTimeout` past
    `connect_timeout` (TCP, TLS and the upgrade together), else a `HandshakeError` whose
    cause says what failed (refused, unresolvable, a certificate not trusted...)."""
    parts = urlsplit(url)
    secure = parts.scheme == "wss"
    name = parts.hostname or ""
    port = parts.port or (443 if secure else 80)
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = f"[{name}]" if ":" in name else name  # an IPv6 literal keeps its brackets
    host_header = host if port in (80, 443) else f"{host}:{port}"
    try:
        async with trio.open_nursery() as nursery:
            try:
                with trio.fail_after(connect_timeout):
                    stream = await _connect(address or name, port, name if secure else None)
                    try:
                        ws = await wrap_client_stream(
                            nursery,
                            stream,
                            host_header,
                            resource,
                            max_message_size=max_message_size,
                            message_queue_size=message_queue_size,
                            receive_buffer_size=receive_buffer_size,
                        )
                    except BaseException:
                        await trio.aclose_forcefully(stream)
                        raise
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
    except BaseExceptionGroup as group:
        _raise_alone(group)


async def _connect(host: str, port: int, server_name: str | None) -> Stream:
    """A TCP stream to `host`, in TLS for `server_name` when one is given (handshake
    done: a refusal raises `HandshakeError` caused by the TLS error)."""
    tcp = await trio.open_tcp_stream(host, port)
    if server_name is None:
        return tcp
    tls = trio.SSLStream(
        tcp, ssl.create_default_context(), server_hostname=server_name, https_compatible=True
    )
    try:
        await tls.do_handshake()
    except BaseException as exc:
        await trio.aclose_forcefully(tcp)
        if isinstance(exc, trio.BrokenResourceError):
            raise HandshakeError from (exc.__cause__ or exc)
        raise
    return tls


def _raise_alone(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Raise the one exception `group` holds, or its one that is not a cancellation;
    the group itself when there are several. The exception keeps its own context (not
    the group, which holds it: trio-websocket's opener does the same, flake8-async #298)."""
    errors = [exc for exc in group.exceptions if not isinstance(exc, trio.Cancelled)]
    if len(group.exceptions) == 1:
        alone = group.exceptions[0]
    elif len(errors) == 1:
        alone = errors[0]
    else:
        raise group
    context = alone.__context__
    try:
        raise alone
    finally:
        alone.__context__ = context
