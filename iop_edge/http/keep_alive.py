"""The keep-alive timeout of one HTTP connection: one task for the connection's life.

Hypercorn 0.18 (`TrioSingleTask`, its `TCPServer.idle_task`) starts a task each time a
connection goes idle and cancels it when the next request begins, each step under a
lock: about five task switches and a new task per request, on every request the Edge
serves. And when the client closes an idle connection, nothing stops that task: the
connection's task, its socket (left in CLOSE_WAIT) and its state stayed until the
keep-alive timeout was up (75 s on the Edge). A client opening a connection per request
(a health checker, a script without a pool) held a descriptor per request for that long;
at a few hundred requests a second that is the process's descriptor limit.

`KeepAliveTimer` implements the same `SingleTask` interface with one task for the whole
connection, waiting for the server to stop under a cancel scope whose deadline is the
timeout:

1. `restart` (the connection went idle: Hypercorn's `Updated(idle=True)`) moves the
   deadline to `timeout_s` from now; `stop` (a request began) moves it to never. Neither
   switches tasks; the first `restart` starts the task.
2. When the deadline passes, or the server stops (`terminated`) while the connection is
   idle, the connection is closed as Hypercorn closes it (`close`, shielded). A server
   that stops while a request is in progress leaves the connection to Hypercorn, which
   closes it after the response.
3. `end` (the connection stopped reading: the client closed it, or it was closed) ends
   the task without closing anything, so the connection is released at once.
4. `drain` (the server drains) closes the connection as soon as it is idle: at once if
   it is, else when its response is done. A draining server takes no new request on an
   old connection; a client whose pooled connection is closed while idle opens a new one
   (to the server's successor) before it sends, and no run starts here that the drain
   might have to cut. Unless bytes are already waiting on it (`pending`): a request on
   its way in is read and answered (the server refuses it, saying to retry, and closes)
   rather than reset unanswered. (A restart hands idle connections to the successor
   instead, `Connection.hand_off`.)
5. `drain(hand_over)` (a restart): a connection busy at the drain goes to the successor
   once idle (`hand_over()`, True when it went) instead of closing. Its response may have
   begun before the drain, its head without `Connection: close`: its client keeps the
   connection and may send the next request on it at once, which a close would cross.
   When `hand_over` cannot pass it (bytes of a next request already read here, the
   channel gone), Rule 4 applies.

Hypercorn's `TCPServer` is the one caller: `iop_edge.http.connection.Connection` sets
its `idle_task` to a `KeepAliveTimer` and calls `end` once its reading loop returns;
`tests/e2e/test_http_connection.py` pins the behaviour.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.typing import Event, TaskGroup

__all__ = ["KeepAliveTimer"]

#: Bound on closing an idle connection (Hypercorn's close, shielded).
CLOSE_TIMEOUT_S = 5.0


class KeepAliveTimer:
    """One connection's keep-alive timeout (see the module docstring)."""

    def __init__(
        self,
        timeout_s: float,
        terminated: Event,
        close: Callable[[], Awaitable[None]],
        pending: Callable[[], bool] = lambda: False,
    ) -> None:
        """`close` closes the connection; `pending` says whether bytes wait to be read."""
        self._timeout_s = timeout_s
        self._terminated = terminated
        self._close = close
        self._pending = pending
        self._scope = trio.CancelScope(deadline=math.inf)
        self._started = False
        self._idle = False
        self._ended = False
        self._draining = False
        self._hand_over: Callable[[], bool] | None = None

    async def restart(self, task_group: TaskGroup, action: Callable[..., Any]) -> None:
        """The connection is idle: close it `timeout_s` from now (Rule 1). `action` is
        Hypercorn's own timeout task, which this replaces."""
        self._idle = True
        if self._draining and self._hand_over is not None and self._hand_over():
            return  # the successor serves it from now on (Rule 5)
        self._scope.deadline = (
            -math.inf if self._draining else trio.current_time() + self._timeout_s
        )
        if not self._started:
            self._started = True
            task_group.spawn(self._wait)

    async def stop(self) -> None:
        """A request began: no timeout until the connection is idle again (Rule 1)."""
        self._idle = False
        self._scope.deadline = math.inf

    @property
    def idle(self) -> bool:
        """Between requests: no request began since the last response ended (Rule 1)."""
        return self._idle and not self._ended

    def drain(self, hand_over: Callable[[], bool] | None = None) -> None:
        """The server drains: close the connection once idle, now if it is (Rule 4), or
        on a restart (`hand_over`) pass it to the successor once idle (Rule 5)."""
        self._draining = True
        self._hand_over = hand_over
        if self._idle:
            self._scope.deadline = -math.inf

    def end(self) -> None:
        """The connection stopped reading: the task ends, closing nothing (Rule 3). The
        connection's callbacks are dropped: they refer to the connection, which refers to
        this timer, a cycle only the cyclic collector would free."""
        self._ended = True
        self._scope.cancel()
        self._close = _closed
        self._pending = _nothing_pending
        self._hand_over = None

    async def _wait(self) -> None:
        with self._scope:
            await self._terminated.wait()
        if self._idle and not self._ended:  # Rule 2
            if self._draining and self._pending():
                return  # Rule 4: a request on its way in is answered, not reset
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await self._close()


async def _closed() -> None:
    """An ended timer's `close`: never called (Rule 3)."""


def _nothing_pending() -> bool:
    return False
