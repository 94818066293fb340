"""The node websocket listener, on a socket the Edge owns, that can stop and resume
accepting without touching the sessions already open (see `listeners`, `handover`).

trio-websocket's `serve_websocket` binds its own sockets and accepts until cancelled;
here the accept loop (a `WebSocketServer` over a duplicate of the Edge's socket) has its
own cancel scope, while every connection runs in the server's handler nursery. So a
restarting Edge can stop taking Nodes (its successor, which shares the socket, takes
them) and, should the successor fail, take them up again.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable

import trio
from trio_websocket import WebSocketRequest, WebSocketServer

from iop_edge.runtime.listeners import Listener

__all__ = ["NodeServer"]


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
        host = f"[{host}]" if ":" in host else host
        return f"{'wss' if self._ssl_context else 'ws'}://{host}:{port}"

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
        server = WebSocketServer(
            self._handler,
            [listener],
            handler_nursery=connections,
            max_message_size=self._max_message_size,
            receive_buffer_size=self._receive_buffer_size,
            # An upgrade that does not arrive is an anonymous peer too (hub Rule 1).
            connect_timeout=self._connect_timeout,
        )

        async def accept() -> None:
            with scope:
                await server.run()

        connections.start_soon(accept, name=f"accept {self.url}")
