"""The node websocket listener, on a socket the Edge owns, that can stop and resume
accepting without touching the sessions already open (see `listeners`, `handover`).

trio-websocket's `serve_websocket` binds its own sockets and accepts until cancelled;
here the accept loop (over a duplicate of the Edge's socket) has its own cancel scope,
while every connection runs in the server's connection nursery. So a restarting Edge can
stop taking Nodes (its successor, which shares the socket, takes them) and, should the
successor fail, take them up again.

Each connection is upgraded with trio-websocket's public `wrap_server_stream` in a
nursery of its own, and whatever the library raises for that connection ends it alone.
trio-websocket's own server lets such an error out of its handler nursery, which would
end every session and the Edge with it: in 0.12 a peer that answers the Edge's Close
with a ping makes its reader send a pong that wsproto refuses (`LocalProtocolError` on a
closing connection, trio-websocket#184), three frames any anonymous peer can send.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable

import trio
from trio_websocket import WebSocketRequest, wrap_server_stream

from iop_edge.core.configuration.listen import ListenAddress
from iop_edge.core.exception_groups import sole_exception
from iop_edge.runtime.lifecycle.listeners import Listener

__all__ = ["NodeServer"]

log = logging.getLogger(__name__)


class NodeServer:
    """Accepts node websockets on `listener` and hands each to `handler`."""

    def __init__(
        self,
        handler: Callable[[WebSocketRequest], Awaitable[None]],
        listener: Listener,
        ssl_context: ssl.SSLContext | None,
        *,
        max_message_size: int,
        receive_buffer_size: int,
        connect_timeout: float,
    ) -> None:
        self._handler = handler
        self._listener = listener
        self._ssl_context = ssl_context
        self._max_message_size = max_message_size
        self._receive_buffer_size = receive_buffer_size
        self._connect_timeout = connect_timeout
        self._connections: trio.Nursery | None = None
        self._accept_scope: trio.CancelScope | None = None

    @property
    def url(self) -> str:
        host, port = self._listener.socket.getsockname()[:2]
        return f"{'wss' if self._ssl_context else 'ws'}://{ListenAddress(host, port)}"

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Accept until cancelled; startable (reports the URL once accepting)."""
        async with trio.open_nursery() as connections:
            self._connections = connections
            self.resume_accepting()
            task_status.started(self.url)
            await trio.sleep_forever()

    def stop_accepting(self) -> None:
        if self._accept_scope is not None:
            self._accept_scope.cancel()
            self._accept_scope = None

    def resume_accepting(self) -> None:
        connections = self._connections
        if connections is None or self._accept_scope is not None:
            return
        scope = self._accept_scope = trio.CancelScope()
        socket_listener = trio.SocketListener(
            trio.socket.from_stdlib_socket(self._listener.socket.dup())
        )
        listener: trio.SocketListener | trio.SSLListener[trio.SocketStream] = socket_listener
        if self._ssl_context is not None:
            listener = trio.SSLListener(socket_listener, self._ssl_context, https_compatible=False)

        async def accept() -> None:
            with scope:
                await trio.serve_listeners(
                    self._serve_connection, [listener], handler_nursery=connections
                )

        connections.start_soon(accept, name=f"accept {self.url}")

    async def _serve_connection(self, stream: trio.abc.Stream) -> None:
        """Upgrade one connection and hand it to the handler; an error of the websocket
        library ends this connection only (see the module docstring)."""
        peer = _peer(stream)
        try:
            async with trio.open_nursery() as connection:
                # An upgrade that does not arrive is an anonymous peer too (hub Rule 1).
                request: WebSocketRequest | None = None
                with trio.move_on_after(self._connect_timeout):
                    request = await wrap_server_stream(
                        connection,
                        stream,
                        max_message_size=self._max_message_size,
                        receive_buffer_size=self._receive_buffer_size,
                    )
                if request is not None:
                    await self._handler(request)
                connection.cancel_scope.cancel()  # the connection's reader task
        except Exception as exc:  # one peer's connection, never the listener
            cause = sole_exception(exc)
            log.warning("node connection from %s ended by the websocket layer: %r", peer, cause)
        finally:
            await trio.aclose_forcefully(stream)


def _peer(stream: trio.abc.Stream) -> str:
    """`HOST:PORT` of a connection's peer (through TLS too), for a log line."""
    inner = getattr(stream, "transport_stream", stream)
    socket = getattr(inner, "socket", None)
    try:
        host, port = socket.getpeername()[:2] if socket is not None else ("?", 0)
    except OSError:
        return "an unknown peer"
    return str(ListenAddress(host, port))
