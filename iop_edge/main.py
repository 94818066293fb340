"""Run the Edge as a process: logging, signals (SIGHUP = refresh apply, SIGTERM/SIGINT =
graceful stop, a second one = stop now), and the root nursery."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import trio

from iop_edge import __version__
from iop_edge.core.config import ParsedConfig, load_config
from iop_edge.edge import Edge, EdgeAddresses
from schemas.log_lines import LogFormat, configure_logging
from schemas.refresh import RefreshRequest

log = logging.getLogger(__name__)

#: Libraries whose own lines duplicate ours: their warnings and errors only.
QUIET_LOGGERS = {"hypercorn.error": logging.WARNING, "trio-websocket": logging.INFO}


def setup_logging(level: str = "info", log_format: LogFormat = "text") -> None:
    configure_logging(level, log_format, QUIET_LOGGERS)


async def _apply_from_file(edge: Edge) -> None:
    """SIGHUP: apply the config file (the Refresher logs the attempt and its reasons)."""
    await edge.refresher.refresh(RefreshRequest(mode="apply"), source="SIGHUP")


def log_start(parsed: ParsedConfig, config_path: Path | None) -> None:
    config = parsed.config
    providers = sum(len(node.providers) for node in config.nodes)
    log.info(
        "IOP Edge %s starting: edge id %s, config %s (sha256 %s), %d model(s), %d node(s), "
        "%d provider(s)",
        __version__,
        config.edge.id,
        "in memory" if config_path is None else config_path.resolve(),
        parsed.sha256[:12],
        len(config.models),
        len(config.nodes),
        providers,
    )


async def handle_signals(edge: Edge, cancel_scope: trio.CancelScope) -> None:
    stopping = False
    with trio.open_signal_receiver(signal.SIGHUP, signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGHUP:
                    log.info("SIGHUP: refreshing from the config file")
                    nursery.start_soon(_apply_from_file, edge)
                elif not stopping:
                    stopping = True
                    log.info(
                        "%s: stopping; draining in-flight requests (signal again to stop now)",
                        name,
                    )
                    edge.stop()
                else:
                    log.warning("%s again: stopping now", name)
                    cancel_scope.cancel()


async def serve_edge(
    config_path: Path, *, task_status: trio.TaskStatus[EdgeAddresses] = trio.TASK_STATUS_IGNORED
) -> None:
    """Load the config and serve until a stop signal drains the listeners.

    Raises `ConfigInvalid` or `ListenerUnavailable` when it cannot."""
    parsed = load_config(config_path)  # validation includes what serve needs of the host
    for warning in parsed.warnings:
        log.warning("%s", warning)
    log_start(parsed, config_path)
    edge = Edge(parsed, config_path=config_path)
    async with trio.open_nursery() as nursery:

        async def run_edge(*, task_status: trio.TaskStatus[EdgeAddresses]) -> None:
            await edge.serve(task_status=task_status)
            nursery.cancel_scope.cancel()  # listeners drained: the signal watcher is done too

        nursery.start_soon(handle_signals, edge, nursery.cancel_scope)
        task_status.started(await nursery.start(run_edge))
    log.info("IOP Edge stopped")
