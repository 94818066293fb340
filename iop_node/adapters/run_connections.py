"""The keep-alive connections of one HTTP adapter's runs: a stack of idle connections.

httpcore2's `AsyncConnectionPool` re-examines every connection it holds each time it
assigns a request and each time a response is closed: it polls every idle connection's
socket for a close by the server (one `poll()` each) and counts them against its limits,
and it wraps each response's body in one more stream layer. A busy provider has a
connection per run in flight, dozens, so that bookkeeping was about a quarter of a
Node's CPU per non-stream run in the closed-loop bench. A run needs much less: one idle
connection to reuse, else a new one.

So an adapter's runs keep their own idle connections, the most recently used on top:

1. *Taking one* first closes those idle longer than the keep-alive expiry (oldest first,
   by the time they came back: no syscall), then takes the newest that is still usable
   (available, and not closed by the server: one `poll()`, of that connection only).
   The others it meets are closed.
2. *None left*: a new one, made by the client's pool (`create_connection`), so it has
   exactly the client's settings: TLS verification, the environment's proxy (a forward
   or tunnel connection through it), keep-alive expiry.
   A *reused* connection that is lost before any of the response arrives (the server
   disconnected, or reset the socket) is closed and the request sent once more on a new
   one. The server closed an idle connection as the request went out (its keep-alive
   timeout racing ours, a restart of the server's workers); Go's transport, Envoy and
   HAProxy retry the same way. A new connection lost the same way is the server's
   failure, and raises.
3. *Giving one back* after its response is closed: a connection left idle (the exchange
   ended cleanly, keep-alive) goes back on the stack, up to `keep` of them; any other is
   closed. A connection whose request failed or was cancelled is closed.
4. After `aclose`, nothing is kept: the idle ones are closed at once, the busy ones as
   they come back.

Closing is shielded and bounded (`CLOSE_GRACE_S`): a TLS connection's goodbye cannot hold
a run. The client's own pool still serves the adapter's health probes.
"""

from __future__ import annotations

from collections import deque
from typing import Final

import httpcore2
import trio
from httpcore2 import AsyncConnectionInterface

__all__ = ["CLOSE_GRACE_S", "RunConnections"]

#: Bound on closing one connection, or a client's (a TLS close_notify to a peer that
#: does not read).
CLOSE_GRACE_S: Final = 5.0
#: How a reused connection fails when the server dropped it before answering: an empty
#: read ("Server disconnected without sending a response"), or a reset while writing or
#: reading. Timeouts are not among them: a slow server got the request.
_LOST_BEFORE_RESPONSE: Final = (
    httpcore2.RemoteProtocolError,
    httpcore2.ReadError,
    httpcore2.WriteError,
)


class RunConnections:
    """Connections for one adapter's runs to one origin (see the module docstring)."""

    def __init__(self, pool: httpcore2.AsyncConnectionPool, *, keep: int, expiry_s: float) -> None:
        self._pool = pool
        self._keep = keep
        self._expiry_s = expiry_s
        self._idle: deque[tuple[float, AsyncConnectionInterface]] = deque()
        """(when it came back, the connection), the newest on the right."""
        self._closed = False

    @property
    def idle(self) -> int:
        """How many idle connections are kept now."""
        return len(self._idle)

    async def send(
        self, request: httpcore2.Request
    ) -> tuple[AsyncConnectionInterface, httpcore2.Response]:
        """Send `request` on an idle connection or a new one (Rules 1-2); the response
        and its connection, which the caller gives back (`give_back`) once the response
        is closed. A failed or cancelled send closes its connection (Rule 3)."""
        reused = await self._take()
        if reused is not None:
            try:
                return reused, await reused.handle_async_request(request)
            except _LOST_BEFORE_RESPONSE:
                await _close(reused)  # dropped while idle: once more, on a new one
            except BaseException:
                await _close(reused)
                raise
        connection = self._pool.create_connection(request.url.origin)
        try:
            return connection, await connection.handle_async_request(request)
        except BaseException:
            await _close(connection)
            raise

    async def give_back(self, connection: AsyncConnectionInterface) -> None:
        """Keep `connection` for the next run if its exchange left it idle (Rule 3)."""
        if connection.is_idle() and not self._closed and len(self._idle) < self._keep:
            self._idle.append((trio.current_time(), connection))
        else:
            await _close(connection)

    async def aclose(self) -> None:
        """Close the idle connections; those in use are closed as they come back."""
        self._closed = True
        while self._idle:
            await _close(self._idle.pop()[1])

    async def _take(self) -> AsyncConnectionInterface | None:
        """The newest usable idle connection, or None (Rule 1)."""
        idle = self._idle
        stale = trio.current_time() - self._expiry_s
        while idle and idle[0][0] < stale:
            await _close(idle.popleft()[1])
        while idle:
            connection = idle.pop()[1]
            if connection.is_available() and not connection.has_expired():
                return connection
            await _close(connection)
        return None


async def _close(connection: AsyncConnectionInterface) -> None:
    with trio.move_on_after(CLOSE_GRACE_S, shield=True):
        await connection.aclose()
