"""Draining: how every stop ends, and every restart once the successor serves.

1. Accept nothing more: no Nodes, no callers, no admin requests on this process. The
   caller and admin listeners close: a new connection is refused at once (or reaches a
   replica sharing the port, or the successor, which keeps its own descriptor of the
   socket) instead of waiting, unanswered, for this process to exit. A restart hands the
   idle keep-alive connections to the successor, as they are, and then the per-minute
   counters (`handoff`); a stop closes them (their clients reconnect, to another
   replica). The others close once their response is done (`HttpServer.stop_accepting`).
   So no run starts here that the grace period might cut.
2. Send `goaway` to the Nodes (bounded by `GOAWAY_TIMEOUT_S`): each links again, to the
   successor if there is one, and keeps this link for the runs on it.
3. Publish this replica's state (the roster shows it draining).
4. Wait until no request has been in progress for `DRAIN_LINGER_S` on any server,
   within the grace period.
5. When the grace period is over, cut the runs still open (each caller gets an error
   event and `[DONE]`, or a 503; each run its record) and give those exchanges
   `CUT_WRITE_S` to write their last bytes.
6. Terminate the servers: Hypercorn closes what is left.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import trio

from iop_edge.http.server import HttpServer
from iop_edge.runtime.lifecycle.handoff import HandoffSender
from iop_edge.runtime.nodes.node_server import NodeServer

__all__ = ["CUT_WRITE_S", "DRAIN_LINGER_S", "GOAWAY_TIMEOUT_S", "drain", "wait_quiet"]

log = logging.getLogger(__name__)

#: After the grace period, how long the cut exchanges have to write their last bytes (an
#: error event and `[DONE]`, or a 503) before what is left is closed.
CUT_WRITE_S: Final = 2.0
#: While draining, how long no request may have been in progress before the servers are
#: terminated (the exchanges that just ended write their last bytes meanwhile).
DRAIN_LINGER_S: Final = 0.5
#: Bound on queueing `goaway` to every node (a node with a full outbox is slow).
GOAWAY_TIMEOUT_S: Final = 2.0


async def drain(
    reason: str,
    grace_s: float,
    *,
    node_server: NodeServer,
    servers: Sequence[HttpServer],
    goaway_all: Callable[[str], Awaitable[None]],
    publish_state: Callable[[], Awaitable[object]],
    cut_all: Callable[[str], int],
    handoff: HandoffSender | None = None,
) -> None:
    """Drain this Edge (the module docstring's steps); `reason` is told to the Nodes.
    Returns once the servers were told to terminate."""
    node_server.stop_accepting()
    for server in servers:
        server.stop_accepting(handoff)
        server.stop_listening()
    log.info("%s: listeners closed; draining in-flight requests", reason)
    if handoff is not None:
        # No request is admitted here any more (step 1): the counters are final.
        handoff.send_windows()
        log.info("%s: %d connection(s) handed to the successor", reason, handoff.connections)
    with trio.move_on_after(GOAWAY_TIMEOUT_S):
        await goaway_all(reason)
    await publish_state()
    with trio.move_on_after(grace_s) as grace:
        await wait_quiet(servers)
    if grace.cancelled_caught:
        left = sum(server.in_flight for server in servers)
        cut = cut_all("the Edge is shutting down")
        log.warning(
            "grace period over with %d request(s) still in progress: %d run(s) cut", left, cut
        )
        with trio.move_on_after(CUT_WRITE_S):  # the cut exchanges write their ends
            await wait_quiet(servers)
    for server in servers:
        server.terminate()


async def wait_quiet(servers: Sequence[HttpServer]) -> None:
    """Return once no request has been in progress on any of `servers` for
    `DRAIN_LINGER_S` (step 4)."""
    async with trio.open_nursery() as nursery:
        for server in servers:
            nursery.start_soon(server.wait_quiet, DRAIN_LINGER_S)
