"""Open the websocket to one Edge: by its URL, or to one address of a named Edge.

A Node that serves every address a DNS name resolves to (`iop-node run --edge-dns`)
dials each address itself, yet must present the name: in the `Host` header and, over
`wss://`, in TLS (SNI, and the name the certificate must match). trio-websocket's
`open_websocket_url` connects to the URL's host only, so the TCP (and TLS) stream is
opened here, to the address when there is one and to the URL's host otherwise, and handed
to `wrap_client_stream`, with the bounds `open_websocket_url` puts on the opening and
closing handshakes. What is done here that opener does not do, or not for us:

- The TLS handshake is completed before the websocket's, so a certificate the Node does
  not trust fails the dial at once, saying so; done by the websocket's first read, it
  surfaced as a handshake timeout.
- An HTTP answer instead of the upgrade (`ConnectionRejected`) is described with what its
  body says and what to fix (`describe_refused_upgrade`): it is an HTTP server, not an
  Edge's node listener, most often the Edge's caller port given by mistake.
- A connection that closes before the upgrade is answered (an Edge that was stopping
  took it) fails the dial at once (`_Answered`), where trio-websocket would wait for the
  connect timeout: a Node reconnecting to a restarted Edge links as soon as it can.
- Every dial over TLS shares one client context (`iop_node.tls`), not one built (and
  the trust store loaded) per dial.
- Errors leave as themselves. The connection's nursery wraps whatever ends the session in
  an exception group; the one error it holds is raised alone (as `open_websocket_url`
  does for its own nursery), so the link sees `ConnectionClosed` when an Edge goes away,
  not a group it cannot read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import NoReturn, cast
from urllib.parse import urlsplit

import msgspec
import trio
from trio_websocket import (
    ConnectionRejected,
    ConnectionTimeout,
    HandshakeError,
    WebSocketConnection,
    wrap_client_stream,
)

from iop_node.tls import edge_tls_context

__all__ = ["WRONG_PORT_HINT", "describe_refused_upgrade", "open_edge_websocket"]

Stream = trio.SocketStream | trio.SSLStream[trio.SocketStream]

#: What to fix when an HTTP server answered instead of an Edge's node listener.
WRONG_PORT_HINT = (
    "--edge should point at the Edge's node listener, edge.listen, e.g. ws://HOST:7700"
)
#: The error code an Edge's HTTP ports refuse a websocket upgrade with.
_EDGE_WRONG_PORT_CODE = "not_a_node_port"
#: At most this much of a refusal's body is quoted in a log line.
_MAX_QUOTED_CHARS = 300


class _ErrorDetail(msgspec.Struct):
    message: str = ""
    code: str | None = None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


def describe_refused_upgrade(exc: ConnectionRejected) -> str:
    """One line for a websocket upgrade answered by HTTP: the status, what the body says
    (an OpenAI-shaped error's message, else its text) and, when the server is not an
    Edge's node listener, what to fix.

    An Edge's HTTP port says so in its body; any other 4xx is an HTTP server that takes no
    websocket at that URL, so the same fix is offered as a question. A 5xx may be a proxy
    in front of a node listener that is down: no hint."""
    status = exc.status_code
    said, code = _body_text(exc.body or b"")
    line = f"websocket upgrade refused with HTTP {status}" + (f": {said}" if said else "")
    if code == _EDGE_WRONG_PORT_CODE:
        return f"{line}; {WRONG_PORT_HINT}"
    if 400 <= status < 500:
        return f"{line}; is this the Edge's node listener? {WRONG_PORT_HINT}"
    return line


def _body_text(body: bytes) -> tuple[str, str | None]:
    """The message of an OpenAI-shaped error body and its code, else the body as text."""
    try:
        error = msgspec.json.decode(body, type=_ErrorBody).error
    except msgspec.DecodeError:  # ValidationError too: not our shape
        text = " ".join(body.decode("utf-8", "replace").split())
        if len(text) > _MAX_QUOTED_CHARS:
            text = text[:_MAX_QUOTED_CHARS] + "..."
        return text, None
    return error.message, error.code


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
                    stream = _Answered(
                        await _connect(address or name, port, name if secure else None)
                    )
                    try:
                        ws = await _upgrade(
                            stream,
                            partial(
                                wrap_client_stream,
                                nursery,
                                # Annotated as a socket or TLS stream, read and written as any
                                # `trio.abc.Stream` (trio-websocket 0.12, bounded in pyproject).
                                cast(trio.SocketStream, stream),
                                host_header,
                                resource,
                                max_message_size=max_message_size,
                                message_queue_size=message_queue_size,
                                receive_buffer_size=receive_buffer_size,
                            ),
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


async def _upgrade(
    stream: _Answered, open_websocket: Callable[[], Awaitable[WebSocketConnection]]
) -> WebSocketConnection:
    """The websocket `open_websocket()` opens on `stream`, or `HandshakeError` at once
    when the peer closes the connection without answering the upgrade (`_Answered`)."""
    with trio.CancelScope() as waiting:
        stream.unanswered = waiting
        try:
            return await open_websocket()
        finally:
            stream.unanswered = None
    raise HandshakeError("the connection closed before the websocket upgrade was answered")


class _Answered(trio.abc.Stream):
    """The connection's stream, cancelling `unanswered` when it ends before the peer sent
    a byte.

    trio-websocket's client waits for the answer to its upgrade request until the
    connect timeout even when the connection closed meanwhile (an Edge that was
    stopping had taken the TCP connection, so a Node reconnecting to a restarted Edge
    waited that long). A connection that ends unanswered cancels the wait, and the dial
    fails at once; one that did answer (an HTTP refusal, say) is left to trio-websocket."""

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._answered = False
        self.unanswered: trio.CancelScope | None = None

    @property
    def socket_stream(self) -> trio.SocketStream | None:
        """The plain TCP stream underneath (None over TLS): what the channel writes its
        frames to directly (`schemas.compat.trio_websocket.write_now`)."""
        inner = self._stream
        return inner if isinstance(inner, trio.SocketStream) else None

    @property
    def socket(self) -> trio.socket.SocketType:
        """The TCP socket (trio-websocket's `remote` and `local` read it)."""
        inner = self._stream
        return inner.transport_stream.socket if isinstance(inner, trio.SSLStream) else inner.socket

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        try:
            data = await self._stream.receive_some(max_bytes)
        except trio.BrokenResourceError:
            self._ended()
            raise
        if data:
            self._answered = True
        else:
            self._ended()
        return data

    def _ended(self) -> None:
        if not self._answered and self.unanswered is not None:
            self.unanswered.cancel()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self._stream.aclose()


async def _connect(host: str, port: int, server_name: str | None) -> Stream:
    """A TCP stream to `host`, in TLS for `server_name` when one is given (handshake
    done: a refusal raises `HandshakeError` caused by the TLS error)."""
    tcp = await trio.open_tcp_stream(host, port)
    if server_name is None:
        return tcp
    tls = trio.SSLStream(
        tcp, edge_tls_context(), server_hostname=server_name, https_compatible=True
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
