"""Serving: the order in which the Edge's parts start, and the order in which they end.

Start:

1. The long-lived services, in order (the scheduler, the usage ledger, the stores, the
   heartbeat grid of the Node sessions).
2. The node listener; a successor then waits (bounded) for the old Edge's Nodes
   (`takeover`), so its first callers find the pool the old Edge had.
3. The HTTP listeners (the OpenAI API, then the admin API), then the replica roster.
4. The addresses are reported (`task_status`); a successor tells the old Edge it is ready.

End, once a stop was requested (`StopRequest`): drain (`drain`); the ledger writes what it
holds (bounded by the grace period); the node sessions close; the rest is cancelled.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio

from iop_edge.http.server import HttpServer
from iop_edge.procedures.drain import drain
from iop_edge.procedures.takeover import take_over_nodes
from iop_edge.runtime.lifecycle.handoff import HandoffSender, Windows, receive_handoff
from iop_edge.runtime.lifecycle.handover import Handover
from iop_edge.runtime.lifecycle.replicas import ReplicaRoster
from iop_edge.runtime.metering.usage_ledger.usage import UsageLedger
from iop_edge.runtime.nodes.hub import NodeHub
from iop_edge.runtime.nodes.node_server import NodeServer
from iop_edge.runtime.runs.dispatch import Dispatcher
from iop_edge.runtime.runs.scheduler import Scheduler

__all__ = ["EdgeAddresses", "EdgeParts", "StopRequest", "serve"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EdgeAddresses:
    """Where a serving Edge listens (its listeners may have been given port 0)."""

    openai_url: str
    node_url: str
    admin_url: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EdgeParts:
    """What `serve` starts and ends, built and wired by the composition root."""

    services: Sequence[Callable[..., Awaitable[object]]]
    """Startable services (`task_status`), started first, in order, cancelled last."""
    scheduler: Scheduler
    ledger: UsageLedger
    """Among `services`; told to write what it holds before the end."""
    hub: NodeHub
    dispatcher: Dispatcher
    roster: ReplicaRoster
    node_server: NodeServer
    openai: HttpServer
    admin: HttpServer
    carry_over: Callable[[Windows], None] = lambda windows: None
    """Takes the per-minute counters a restarting Edge handed over (`handoff`)."""


class StopRequest:
    """A graceful stop, asked for once (SIGTERM, a restart, `Edge.stop`); the first
    request's reason is the one told to the Nodes and logged."""

    def __init__(self) -> None:
        self._requested = trio.Event()
        self.reason = "stopping"
        self.handoff: HandoffSender | None = None
        """Where a restart hands this Edge's connections (its successor), if one does."""

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def request(self, reason: str, handoff: HandoffSender | None = None) -> None:
        if not self._requested.is_set():
            self.reason = reason
            self.handoff = handoff
            self._requested.set()
        elif handoff is not None:
            handoff.close()

    async def wait(self) -> None:
        await self._requested.wait()


async def serve(
    parts: EdgeParts,
    *,
    stop: StopRequest,
    grace_s: float,
    handover: Handover | None,
    on_listening: Callable[[EdgeAddresses], object],
    task_status: trio.TaskStatus[EdgeAddresses] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start the parts, serve until `stop` is requested, drain, end (module docstring).
    Startable: reports the addresses once every listener accepts (`on_listening` hears
    them first, before the roster publishes this replica)."""
    async with trio.open_nursery() as nursery:
        for service in parts.services:
            await nursery.start(service)
        node_url = await nursery.start(parts.node_server.serve)
        log.info("node websocket listening on %s", node_url)
        if handover is not None:
            await take_over_nodes(
                handover,
                catalog=parts.scheduler.catalog,
                connected_nodes=parts.hub.connected_nodes,
                wait_changed=parts.scheduler.wait_changed,
            )
        servers = (parts.openai, parts.admin)
        async with trio.open_nursery() as http:
            openai_url = await http.start(parts.openai.serve)
            admin_url = await http.start(parts.admin.serve)
            addresses = EdgeAddresses(openai_url=openai_url, node_url=node_url, admin_url=admin_url)
            on_listening(addresses)
            await nursery.start(parts.roster.run)
            log.info("OpenAI API listening on %s", addresses.openai_url)
            log.info("admin API listening on %s", addresses.admin_url)
            task_status.started(addresses)
            taking = trio.CancelScope()
            if handover is not None:
                handoff = handover.take_handoff()
                if handoff is not None:  # the old Edge's connections and counters
                    http.start_soon(_take_handoff, taking, handoff, parts)
                await handover.ready()
                await parts.roster.retire(handover.predecessor)  # it takes no new request
            await stop.wait()
            taking.cancel()
            try:
                await drain(
                    stop.reason,
                    grace_s,
                    node_server=parts.node_server,
                    servers=servers,
                    goaway_all=parts.hub.goaway_all,
                    publish_state=parts.roster.publish,
                    cut_all=parts.dispatcher.cut_all,
                    handoff=stop.handoff,
                )
            finally:
                if stop.handoff is not None:
                    stop.handoff.close()
        # The HTTP listeners drained: the ledger writes what it holds, then the node side
        # ends too.
        parts.ledger.close()
        with trio.move_on_after(grace_s):
            await parts.ledger.wait_stopped()
        parts.hub.abort_all()
        nursery.cancel_scope.cancel()


async def _take_handoff(scope: trio.CancelScope, handoff: socket.socket, parts: EdgeParts) -> None:
    """What the Edge this one replaces hands over (`handoff`), until it exits or this
    Edge stops (`scope`)."""
    servers = {"openai": parts.openai, "admin": parts.admin}

    def adopt(role: str, connection: socket.socket) -> None:
        server = servers.get(role)
        if server is None:
            connection.close()
        else:
            server.adopt(connection)

    with scope:
        await receive_handoff(handoff, adopt=adopt, carry_over=parts.carry_over)
