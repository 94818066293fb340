"""Serving an ASGI app with Hypercorn on a socket the Edge owns, with a drain it controls.

`hypercorn.trio.serve` binds its own sockets and couples two things the Edge must keep
apart when it hands over to a successor process (a zero-downtime restart, design §13):
*stop accepting* and *close idle connections*. Its shutdown does both at once, and a
keep-alive connection closed while its client is sending the next request loses that
request. So this module runs Hypercorn's own connection handler (`TCPServer`), lifespan
and worker context, the way `hypercorn.trio.run.worker_serve` does, on a listening socket
the Edge bound (or inherited), and drains in three steps:

1. `stop_accepting(handoff)`: no new connections from this process (the socket stays
   open for the successor, which shares it: nothing queued in it is lost), and no new
   request on an old one: a draining server never starts a run it might have to cut
   when its grace period ends. A restart hands each idle keep-alive connection to the
   successor as it is (`runtime.lifecycle.handoff`): a request its client sends on it,
   however close to the drain, is read and served there, never lost. Otherwise (a stop,
   or a connection that cannot be handed over) idle keep-alive connections are closed
   at once, unless a request is on its way in on one (then it is read). The others
   close as soon as their response is done, which carries `Connection: close` when it
   begins after the drain; on a restart they go to the successor then instead (a
   response begun before the drain could not say it: its client keeps the connection). A
   request read here all the same is served when a successor takes the rest (a restart),
   and on a stop is answered, unread, with a 503 `shutting_down`, `Connection: close`
   and `Retry-After` (`DRAINING_REFUSAL`): the SDKs retry it, on a new connection, and
   no run starts here.
2. `wait_quiet(linger_s)`: until no request has been in progress for `linger_s`.
3. `terminate()`: Hypercorn closes the idle connections left and gives in-flight ones
   its graceful timeout, after which the ones a write to a caller still holds are
   closed (`_abort_at`); `serve` returns when they are gone.

The Hypercorn internals used here (`TCPServer`, `WorkerContext`, `Lifespan`) are those of
`worker_serve` in Hypercorn 0.18, named in `iop_edge.http.compat.hypercorn` and proved by
`tests/compat/test_hypercorn.py`; `tests/e2e/test_http_server.py` pins their behaviour.
Each connection is a `connection.Connection`: Hypercorn's handler with writes that skip
its per-piece task switches (see that module).

The Edge's HTTP ports take no websockets. A websocket upgrade there is almost always a
Node given the wrong port (the caller port is one digit away from the node listener in
most configs): it is refused with a 400 whose body says which port this is and where
Nodes connect (`websocket_refusal`), in one log line; a Node's websocket library reports
that body. The one exception is a caller asking for the Responses API's WebSocket mode
(an upgrade on `/v1/responses` of the caller port, `caller_port`): the app serves it
(`http.responses_socket`; Hypercorn's own WebSocket support, under the same connection
handler). A draining server refuses it (503 `shutting_down`: the client reconnects to the
successor); an open one is not a request in progress (`wait_quiet` does not wait for it)
and is closed with the others at the end of the graceful timeout.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.typing import (
    ASGIReceiveCallable,
    ASGISendCallable,
    ConnectionState,
    HTTPResponseBodyEvent,
    HTTPResponseStartEvent,
    HTTPScope,
    Scope,
    WebsocketResponseBodyEvent,
    WebsocketResponseStartEvent,
    WebsocketScope,
)

from iop_edge.http.compat.hypercorn import Lifespan, WorkerContext, repr_socket_addr, wrap_app
from iop_edge.http.connection import ChunkedBodyWriter, Connection, current_connection
from iop_edge.http.errors import ApiError
from iop_edge.http.protocols.protocol_registry import PROTOCOLS
from iop_edge.runtime.lifecycle.handoff import HandoffSender
from schemas.config import DEFAULT_SEND_TIMEOUT_S, DEFAULT_SHUTDOWN_GRACE_S
from schemas.limits import MAX_PAYLOAD_BYTES

__all__ = ["DRAINING_REFUSAL", "WRONG_PORT_CODE", "HttpServer", "hypercorn_config"]

log = logging.getLogger(__name__)

ASGIApp = Callable[[Scope, ASGIReceiveCallable, ASGISendCallable], Awaitable[None]]

_CONNECTION_CLOSE = (b"connection", b"close")
#: How soon a request refused by a draining server may be sent again (a new connection
#: reaches the successor, or another replica, at once).
DRAINING_RETRY_AFTER_S = 1
DRAINING_REFUSAL = ApiError(
    503,
    "This IOP Edge is stopping (a restart hands over to its successor) and takes no new "
    "request on this connection: send it again on a new connection",
    type="service_unavailable_error",
    code="shutting_down",
)
#: The error code of a websocket upgrade refused on an HTTP port.
WRONG_PORT_CODE = "not_a_node_port"
#: The paths a Responses WebSocket mode client upgrades on (`http.responses_socket`).
_RESPONSES_PATHS = frozenset({"/v1/responses", "/v1/responses/", "/responses"})


#: How far past `openai.max_request_bytes` a Responses WebSocket message is still read,
#: so that one just over the limit is told so (an `error` event) before the 1009 close.
WEBSOCKET_MARGIN_BYTES: Final = 64 * 1024


def hypercorn_config(listen: str, graceful_s: float = DEFAULT_SHUTDOWN_GRACE_S) -> HypercornConfig:
    """How the Edge configures Hypercorn for a listener (the bench's floors use it too):
    `graceful_s` is how long a stopping server lets its requests finish."""
    config = HypercornConfig()
    config.bind = [listen]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = graceful_s
    config.keep_alive_timeout = 75
    config.include_server_header = False
    return config


class HttpServer:
    """One ASGI app on one listening socket (see the module docstring).

    The socket stays the caller's: it is not closed here (accepting uses a duplicate of
    it), so the Edge can hand it to a successor and take accepting up again if that
    successor fails."""

    def __init__(
        self,
        app: ASGIApp,
        config: HypercornConfig,
        sock: socket.socket,
        *,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
        websocket_refusal: str = "this HTTP port takes no websocket connections",
        role: str = "openai",
        caller_port: bool = False,
        max_request_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        """`websocket_refusal` is what a websocket upgrade here is told: which port this
        is, and where Nodes connect; on the `caller_port`, an upgrade on `/v1/responses`
        is told the Responses WebSocket mode is not supported instead. `role` names the
        port to a successor that takes its connections over (`handoff`);
        `max_request_bytes` bounds a Responses WebSocket message there (`openai.
        max_request_bytes`)."""
        self.role = role
        if caller_port:
            # `responses_socket` refuses a message past the limit with an `error` event;
            # one that goes on past this margin is not read to its end (a bare 1009),
            # so a caller cannot make the Edge assemble a message of the wire's size.
            config.websocket_max_message_size = max_request_bytes + WEBSOCKET_MARGIN_BYTES
        self._config = config
        self._websocket_refusal = ApiError(400, websocket_refusal, code=WRONG_PORT_CODE).body()
        self._caller_port = caller_port
        self._send_timeout_s = send_timeout_s
        """A caller that takes no bytes of a response for this long is disconnected."""
        self._socket = sock
        self._url = "http://" + repr_socket_addr(sock.family, sock.getsockname())
        self._app = wrap_app(self._track, config.wsgi_max_body_size, "asgi")
        self._inner = app
        self._context = WorkerContext(None)
        self._connections: trio.Nursery | None = None
        self._accept_scope: trio.CancelScope | None = None
        self._accepting_on: trio.socket.SocketType | None = None
        """The descriptor of the listening socket the accept task uses (a duplicate: the
        original stays for a handover), closed with the original by `stop_listening`."""
        self._terminate = trio.Event()
        self._draining = False
        self._handed_over = False
        """A successor took this server's idle connections: what is read here is served."""
        self._in_flight = 0
        self._idle = trio.Event()
        self._next_request: trio.Event | None = None
        self._live: set[Connection] = set()

    @property
    def url(self) -> str:
        return self._url

    @property
    def in_flight(self) -> int:
        """Requests being handled right now."""
        return self._in_flight

    @property
    def open_connections(self) -> int:
        """Client connections open right now, idle keep-alive ones included."""
        return len(self._live)

    # --- lifecycle -----------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the app's lifespan and accept connections until `terminate()`; startable
        (reports the URL once accepting)."""
        lifespan = Lifespan(self._app, self._config, {})
        async with trio.open_nursery() as lifespan_nursery:
            await lifespan_nursery.start(lifespan.handle_lifespan)
            await lifespan.wait_for_startup()
            async with trio.open_nursery() as connections:
                self._connections = connections
                self.resume_accepting()
                task_status.started(self.url)
                await self._terminate.wait()
                self.stop_accepting()
                await self._context.terminated.set()  # idle keep-alive connections close
                deadline = trio.current_time() + self._config.graceful_timeout
                connections.cancel_scope.deadline = deadline
                lifespan_nursery.start_soon(self._abort_at, deadline)
            self._connections = None
            await lifespan.wait_for_shutdown()
            lifespan_nursery.cancel_scope.cancel()

    def stop_accepting(self, handoff: HandoffSender | None = None) -> None:
        """Accept nothing more here, no connection and no new request; hand the idle
        connections to `handoff`'s successor when there is one (step 1)."""
        self._draining = True
        self._handed_over = handoff is not None
        if self._accept_scope is not None:
            self._accept_scope.cancel()
            self._accept_scope = None
        send = None if handoff is None else partial(handoff.send_connection, self.role)
        for connection in list(self._live):
            if send is None or not connection.hand_off(send):
                connection.drain(send)  # a busy one goes over once idle, if it can

    def stop_listening(self) -> None:
        """Close the listening socket, once this process will never accept again (a
        drain): a new connection is then refused at once, or goes to the replicas that
        share the port (SO_REUSEPORT), instead of waiting in a queue no one accepts from
        until the process exits and resets it. Both of this process's descriptors of it
        close (the accept task's duplicate too: while one is open, the kernel still
        takes connections into the queue); a successor that inherited the socket keeps
        its own."""
        if self._accepting_on is not None:
            self._accepting_on.close()
            self._accepting_on = None
        self._socket.close()

    def adopt(self, sock: socket.socket) -> None:
        """Serve `sock`, a client connection a restarting Edge handed over (`handoff`),
        as if accepted here; closed at once if this server no longer serves."""
        if self._connections is None or self._draining:
            sock.close()
            return
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self._connections.start_soon(self._serve_connection, stream)

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        await self._handler()(stream)

    def _handler(self) -> Callable[[trio.SocketStream], Connection]:
        return partial(
            Connection,
            self._app,
            self._config,
            self._context,
            ConnectionState({}),
            live=self._live,
            send_timeout_s=self._send_timeout_s,
        )

    def resume_accepting(self) -> None:
        """Accept connections (again: a handover that failed gives the socket back)."""
        if self._connections is None or self._accept_scope is not None:
            return
        self._draining = False
        scope = self._accept_scope = trio.CancelScope()
        if self._accepting_on is not None:
            self._accepting_on.close()  # the descriptor of an accept task that ended
        self._accepting_on = trio.socket.from_stdlib_socket(self._socket.dup())
        listener = trio.SocketListener(self._accepting_on)
        handler = self._handler()
        connections = self._connections

        async def accept() -> None:
            with scope:
                await trio.serve_listeners(handler, [listener], handler_nursery=connections)

        connections.start_soon(accept, name=f"accept {self.url}")

    async def wait_quiet(self, linger_s: float) -> None:
        """Return once no request has been in progress for `linger_s` (step 2)."""
        while True:
            while self._in_flight:
                await self._idle.wait()
            request = self._next_request = trio.Event()
            with trio.move_on_after(linger_s) as quiet:
                await request.wait()
            self._next_request = None
            if quiet.cancelled_caught and not self._in_flight:
                return

    def terminate(self) -> None:
        """Close idle connections, give in-flight ones the graceful timeout (step 3)."""
        self._terminate.set()

    async def _abort_at(self, deadline: float) -> None:
        """At the end of the graceful timeout, close the connections still there: the
        cancellation ends everything but the shielded writes to callers that read
        nothing, and closing their sockets ends those (`Connection.abort`)."""
        await trio.sleep_until(deadline)
        for connection in list(self._live):
            connection.abort()

    # --- the app, wrapped -----------------------------------------------------------------

    async def _track(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        """Count requests in progress; while draining, refuse new ones and close each
        connection after its response (step 1); write chunked bodies directly
        (`ChunkedBodyWriter`); refuse websockets (module docstring)."""
        if scope["type"] == "websocket":
            if self._caller_port and scope["path"] in _RESPONSES_PATHS and not self._draining:
                await self._inner(scope, receive, send)  # `http.responses_socket`
            else:
                await self._refuse_websocket(scope, send)
            return
        if scope["type"] != "http":
            await self._inner(scope, receive, send)
            return
        if self._draining and not self._handed_over:
            await self._refuse_draining(scope, send)
            return
        self._in_flight += 1
        if self._next_request is not None:
            self._next_request.set()
        try:
            send = partial(self._close_if_draining, send)
            connection = current_connection()
            if connection is not None and connection.writes_directly:
                send = ChunkedBodyWriter(send, connection, scope)
            await self._inner(scope, receive, send)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()
                self._idle = trio.Event()

    async def _close_if_draining(self, send: ASGISendCallable, message: Any) -> None:
        """Forward `message`; a response that begins while draining says `Connection:
        close`, whenever its request came (its client then never sends another on this
        connection). Only a response's head and end pass here: a chunked body's pieces
        go straight to the connection (`ChunkedBodyWriter`)."""
        if self._draining:
            await _closing_send(send, message)
        else:
            await send(message)

    async def _refuse_draining(self, scope: HTTPScope, send: ASGISendCallable) -> None:
        """A request on an old connection while draining: a 503 that says to retry, the
        request unread, the connection closed after it (step 1)."""
        names = {name.decode("latin-1").lower() for name, _ in scope["headers"]}
        body = PROTOCOLS.of_request(scope["path"], names).error_body(DRAINING_REFUSAL)
        start: HTTPResponseStartEvent = {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
                (b"retry-after", b"%d" % DRAINING_RETRY_AFTER_S),
                _CONNECTION_CLOSE,
            ],
            "trailers": False,
        }
        end: HTTPResponseBodyEvent = {
            "type": "http.response.body",
            "body": body,
            "more_body": False,
        }
        await send(start)
        await send(end)

    async def _refuse_websocket(self, scope: WebsocketScope, send: ASGISendCallable) -> None:
        """Answer a websocket upgrade with a 400 saying where Nodes connect (ASGI's
        websocket denial response, which Hypercorn offers), or a Responses WebSocket
        upgrade to a draining server with a 503 `shutting_down`; log one line."""
        client = scope["client"]
        peer = f"{client[0]}:{client[1]}" if client else "a client"
        if self._caller_port and scope["path"] in _RESPONSES_PATHS:  # a draining server
            log.info("refused a Responses WebSocket upgrade from %s: shutting down", peer)
            status, body = DRAINING_REFUSAL.status, DRAINING_REFUSAL.body()
        else:
            log.warning(
                "refused a websocket upgrade from %s on %s (%r): is a Node pointed at this port?",
                peer,
                self.url,
                scope["path"][:200],
            )
            status, body = 400, self._websocket_refusal
        start: WebsocketResponseStartEvent = {
            "type": "websocket.http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
                _CONNECTION_CLOSE,
            ],
        }
        end: WebsocketResponseBodyEvent = {
            "type": "websocket.http.response.body",
            "body": body,
            "more_body": False,
        }
        await send(start)
        await send(end)


async def _closing_send(send: ASGISendCallable, message: Any) -> None:
    """Forward `message`, adding `Connection: close` to the response's headers."""
    if message["type"] == "http.response.start":
        headers = [*message.get("headers", ()), _CONNECTION_CLOSE]
        message = {**message, "headers": headers}
    await send(message)
