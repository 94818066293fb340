"""Restarting: this Edge hands its sockets and Nodes over to a new process of itself.

The protocol between the two processes is `iop_edge.runtime.lifecycle.handover`'s; this
is the old Edge's procedure (design §13):

1. Start the successor with the listening sockets; it must listen for Nodes within
   `HANDOVER_START_TIMEOUT_S`.
2. Stop accepting Nodes and send each a `goaway` (bounded): they link again, now to the
   successor, and keep their link here for the runs on it.
3. Tell the successor which Nodes to expect; it must say it is ready within
   `HANDOVER_READY_TIMEOUT_S` (its wait for the Nodes, `takeover`, included).
4. Ready: this Edge stops ("restarting") and drains, handing its idle client connections
   and its per-minute counters to the successor as the drain begins (`handoff`). Any
   failure before, or a restart cut meanwhile (the admin caller left): the successor is
   killed, this Edge accepts Nodes again and serves on as if nothing happened.

At most one restart runs at a time, none while the Edge stops or a config refresh runs,
and no refresh while it runs (`Refresher`'s `blocked`): the successor reads the config
file as it starts, so a refresh applied meanwhile would be answered "applied" by a
process about to hand over to one that never ran it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Final

import trio

from iop_edge.procedures.drain import GOAWAY_TIMEOUT_S
from iop_edge.procedures.takeover import HANDOVER_NODES_TIMEOUT_S
from iop_edge.runtime.lifecycle.handoff import HandoffSender, Windows
from iop_edge.runtime.lifecycle.handover import HandoverFailed, Successor
from iop_edge.runtime.lifecycle.listeners import Listener
from iop_edge.runtime.nodes.node_server import NodeServer
from schemas.restart import RestartReport

__all__ = ["HANDOVER_READY_TIMEOUT_S", "HANDOVER_START_TIMEOUT_S", "Restarter"]

log = logging.getLogger(__name__)

#: A successor must be listening for Nodes within this (imports, config, ledger) ...
HANDOVER_START_TIMEOUT_S: Final = 60.0
#: ... and must say it is ready within this (its Nodes linked), or the restart fails.
HANDOVER_READY_TIMEOUT_S: Final = HANDOVER_NODES_TIMEOUT_S + 30.0


class Restarter:
    """One Edge's restarts (module docstring). `successor_argv` is how to start this Edge
    again (None: it cannot restart itself)."""

    def __init__(
        self,
        successor_argv: Sequence[str] | None,
        *,
        goaway_all: Callable[[str], Awaitable[None]],
        connected_nodes: Callable[[], Iterable[str]],
        windows: Callable[[], Windows] = dict,
        refreshing: Callable[[], bool] = lambda: False,
    ) -> None:
        """`windows`: what the per-minute limits used, per principal, carried over;
        `refreshing`: a config refresh runs (a restart waits for none: it refuses)."""
        self._successor_argv = list(successor_argv) if successor_argv is not None else None
        self._goaway_all = goaway_all
        self._connected_nodes = connected_nodes
        self._windows = windows
        self._refreshing = refreshing
        self._restarting = False

    @property
    def in_progress(self) -> bool:
        """A restart runs now (its successor may have read the config file already)."""
        return self._restarting

    async def restart(
        self,
        *,
        node_server: NodeServer | None,
        listeners: Sequence[Listener],
        revision: int,
        instance: str,
        stopping: bool,
        stop: Callable[[str, HandoffSender | None], object],
    ) -> RestartReport:
        """Hand over to a successor that continues with `revision`. Returns once the
        successor serves (then `stop("restarting")` was called: this Edge drains) or the
        restart failed or was refused (this Edge serves on, unchanged). `node_server` is
        None until the Edge serves; `instance` is this Edge's row in the replica roster
        (the successor counts it gone once it serves); `stopping` says whether a stop
        began."""
        pid = os.getpid()
        if self._successor_argv is None:
            detail = (
                "this Edge was not started by `iop-edge serve`, so it cannot start itself again"
            )
            return RestartReport(outcome="refused", pid=pid, detail=detail)
        if self._restarting or stopping or node_server is None:
            detail = "a restart or stop is already in progress"
            return RestartReport(outcome="refused", pid=pid, detail=detail)
        if self._refreshing():
            detail = "a config refresh is in progress; retry when it has finished"
            return RestartReport(outcome="refused", pid=pid, detail=detail)
        self._restarting = True
        successor = Successor(
            self._successor_argv, list(listeners), revision=revision, predecessor=instance
        )
        try:
            successor_pid = await self._hand_over(successor, node_server)
        except Exception as exc:  # `HandoverFailed`, or the successor's pipe broke
            detail = str(exc) if isinstance(exc, HandoverFailed) else f"the handover broke: {exc!r}"
            log.error("restart failed, serving on: %s", detail)
            await _roll_back(successor, node_server)
            return RestartReport(outcome="failed", pid=pid, detail=detail)
        except BaseException:
            # Cut (the admin caller left, the Edge stops now): serve on, as after a failure.
            log.warning("restart cut before the successor was ready: serving on")
            await _roll_back(successor, node_server)
            raise
        finally:
            self._restarting = False
            with trio.move_on_after(1, shield=True):
                await successor.close()
        log.info(
            "restart: the successor (pid %d) serves; this Edge drains and exits", successor_pid
        )
        handoff = successor.handoff
        stop("restarting", None if handoff is None else HandoffSender(handoff, self._windows))
        return RestartReport(
            outcome="handed_over",
            pid=pid,
            successor_pid=successor_pid,
            revision=revision,
            detail="the successor serves; this process finishes its in-flight runs and exits",
        )

    async def _hand_over(self, successor: Successor, node_server: NodeServer) -> int:
        """Steps 1-3; the successor's pid once it is ready. Raises `HandoverFailed`."""
        try:
            with trio.fail_after(HANDOVER_START_TIMEOUT_S):
                await successor.start()
                moved = await successor.wait_listening()
        except trio.TooSlowError:
            raise HandoverFailed(
                f"the successor was not listening within {HANDOVER_START_TIMEOUT_S:g}s"
            ) from None
        linked = sorted(self._connected_nodes())
        if moved is not None and linked:
            # Sent `goaway`, they would dial the old address, where nobody listens.
            was, now = moved
            raise HandoverFailed(
                f"the successor listens for Nodes on {now}, not on {was}, where node(s) "
                f"{', '.join(linked)} dial: they would be left without an Edge. Keep "
                "edge.listen (or --node-listen) as it is for the restart, or stop this "
                "Edge and start one on the new address once the Nodes dial it (their "
                "--edge)"
            )
        node_server.stop_accepting()
        with trio.move_on_after(GOAWAY_TIMEOUT_S):
            await self._goaway_all("restarting")
        try:
            with trio.fail_after(HANDOVER_READY_TIMEOUT_S):
                await successor.expect_nodes(sorted(self._connected_nodes()))
                return await successor.wait_ready()
        except trio.TooSlowError:
            raise HandoverFailed(
                f"the successor was not ready within {HANDOVER_READY_TIMEOUT_S:g}s"
            ) from None


async def _roll_back(successor: Successor, node_server: NodeServer) -> None:
    """Step 4's "any failure before": this Edge accepts Nodes again at once, and the
    successor is killed (shielded, so a cut restart cleans up too; `abort` waits at most
    5 s for the process)."""
    node_server.resume_accepting()
    with trio.CancelScope(shield=True):
        await trio.to_thread.run_sync(successor.abort)
