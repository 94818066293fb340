"""Run the Edge as a process: logging, signals (SIGHUP = refresh apply, SIGTERM/SIGINT =
graceful stop, a second one = stop now), and the root nursery."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import trio

from iop_edge.core.config import load_config
from iop_edge.edge import Edge, EdgeAddresses
from schemas.refresh import RefreshRequest

log = logging.getLogger(__name__)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
    )
    # Hypercorn's own lines duplicate ours; keep its warnings only.
    logging.getLogger("hypercorn.error").setLevel(logging.WARNING)


async def _apply_from_file(edge: Edge) -> None:
    result = await edge.refresher.refresh(RefreshRequest(mode="apply"))
    report = result.report
    log.info(
        "SIGHUP refresh: %s, outcome %s, revision %s -> %s, %d change(s)",
        result.verdict,
        report.outcome,
        report.base_revision,
        report.revision,
        len(report.changes),
    )
    for error in report.errors:
        log.error("refresh rejected: %s: %s", error.path, error.message)


async def handle_signals(edge: Edge, cancel_scope: trio.CancelScope) -> None:
    stopping = False
    with trio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    nursery.start_soon(_apply_from_file, edge)
                elif not stopping:
                    stopping = True
                    log.info("stopping: draining in-flight requests (signal again to stop now)")
                    edge.stop()
                else:
                    cancel_scope.cancel()


async def serve_edge(
    config_path: Path, *, task_status: trio.TaskStatus[EdgeAddresses] = trio.TASK_STATUS_IGNORED
) -> None:
    """Load the config and serve until a stop signal drains the listeners."""
    parsed = load_config(config_path)
    for warning in parsed.warnings:
        log.warning("%s", warning)
    edge = Edge(parsed, config_path=config_path)
    async with trio.open_nursery() as nursery:

        async def run_edge(*, task_status: trio.TaskStatus[EdgeAddresses]) -> None:
            await edge.serve(task_status=task_status)
            nursery.cancel_scope.cancel()  # listeners drained: the signal watcher is done too

        nursery.start_soon(handle_signals, edge, nursery.cancel_scope)
        task_status.started(await nursery.start(run_edge))
