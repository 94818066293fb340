"""Run the Edge as a process: logging, signals (SIGHUP = refresh apply, SIGUSR2 =
zero-downtime restart, SIGTERM/SIGINT = graceful stop, a second one = stop now), and the
root nursery.

A stop by Ctrl-C exits with 130, by SIGTERM with 0 (`schemas.runtime.stop_signal`).

A process started by a restarting Edge (see `runtime.handover`) finds its handover in
the environment; when it cannot start (an invalid config, a port it cannot bind) it says
why to the old Edge, which then serves on. Under systemd, the process that serves says so
(`runtime.lifecycle.service_manager`), a successor included."""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from pathlib import Path

import trio

from iop_edge import __version__
from iop_edge.core.configuration.config import ConfigInvalid, ParsedConfig, format_errors
from iop_edge.core.configuration.exposure import exposure_warnings
from iop_edge.edge import Edge, EdgeAddresses, EdgeStartupError
from iop_edge.procedures.drain import CUT_WRITE_S
from iop_edge.runtime.lifecycle import heap, service_manager
from iop_edge.runtime.lifecycle.handover import Handover
from iop_edge.runtime.lifecycle.listeners import Listeners
from iop_edge.runtime.refresh.config_file import load_config
from schemas.refresh import RefreshRequest
from schemas.runtime.log_lines import LogFormat, configure_logging
from schemas.runtime.stop_signal import StopSignal

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


async def _restart(edge: Edge) -> None:
    report = await edge.restart()
    if report.outcome == "handed_over":
        log.info("SIGUSR2 restart: handed over to pid %s", report.successor_pid)
    else:
        log.error("SIGUSR2 restart %s: %s", report.outcome, report.detail)


async def handle_signals(
    edge: Edge,
    cancel_scope: trio.CancelScope,
    stopped_by: StopSignal | None = None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """SIGHUP refreshes, SIGUSR2 restarts; SIGTERM/SIGINT drains and stops, and a second
    one stops now: the runs still open are cut as the Edge's (`shutting_down`), not left
    to end as callers who went away, their callers are told so (within `CUT_WRITE_S`),
    then `cancel_scope` is cancelled. `stopped_by` notes the stop signals (the exit
    status follows from them). Started (`nursery.start`) once the signals are caught: a
    signal sent after that is this task's."""
    stopping = False
    signums = (signal.SIGHUP, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
    with trio.open_signal_receiver(*signums) as signals:
        task_status.started()
        async with trio.open_nursery() as nursery:
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGHUP:
                    log.info("SIGHUP: refreshing from the config file")
                    nursery.start_soon(_apply_from_file, edge)
                elif signum == signal.SIGUSR2:
                    nursery.start_soon(_restart, edge)
                elif not stopping:
                    stopping = True
                    if stopped_by is not None:
                        stopped_by.received(signum)
                    log.info(
                        "%s: stopping; draining in-flight requests (signal again to stop now)",
                        name,
                    )
                    service_manager.notify_stopping()
                    edge.stop()
                else:
                    if stopped_by is not None:
                        stopped_by.received(signum)
                    cut = edge.stop_now(f"the Edge was stopped at once ({name} again)")
                    log.warning("%s again: stopping now (%d run(s) cut)", name, cut)
                    with trio.move_on_after(CUT_WRITE_S):
                        await edge.answered()  # each cut caller hears why, not a bare 500
                    cancel_scope.cancel()


async def serve_edge(
    config_path: Path,
    *,
    node_listen: str | None = None,
    admin_listen: str | None = None,
    successor_argv: Sequence[str] | None = None,
    task_status: trio.TaskStatus[EdgeAddresses] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Load the config and serve until a stop signal drains the listeners; returns the
    process's exit status (130 after Ctrl-C, `schemas.runtime.stop_signal`).

    `successor_argv` is how to start this Edge again (`iop-edge restart`, SIGUSR2)."""
    handover = Handover.from_environ()
    with heap.building():  # Rule 6: what startup builds lives as long as the process
        try:  # a restart's predecessor hears why not, whichever step fails
            edge = _build_edge(config_path, node_listen, admin_listen, successor_argv, handover)
            await edge.check_ledger()
            edge.open_listeners()
        except ConfigInvalid as exc:
            if handover is not None:
                handover.failed(f"{config_path}: invalid config\n{format_errors(exc.errors)}")
            raise
        except EdgeStartupError as exc:
            if handover is not None:
                handover.failed(f"cannot start: {exc}")
            raise
        heap.settle()  # its one collection, before the collector runs again
    return await _serve(edge, task_status)


def _build_edge(
    config_path: Path,
    node_listen: str | None,
    admin_listen: str | None,
    successor_argv: Sequence[str] | None,
    handover: Handover | None,
) -> Edge:
    """The Edge of the config at `config_path` (raises `ConfigInvalid`, `EdgeStartupError`)."""
    parsed = load_config(config_path)
    for warning in [*parsed.warnings, *exposure_warnings(parsed.config)]:
        log.warning("%s", warning)
    log_start(parsed, config_path)
    return Edge(
        parsed,
        config_path=config_path,
        listeners=Listeners(node=node_listen, admin=admin_listen),
        successor_argv=successor_argv,
        handover=handover,
    )


async def _serve(edge: Edge, task_status: trio.TaskStatus[EdgeAddresses]) -> int:
    stopped_by = StopSignal()
    async with trio.open_nursery() as nursery:

        async def run_edge(*, task_status: trio.TaskStatus[EdgeAddresses]) -> None:
            await edge.serve(task_status=task_status)
            nursery.cancel_scope.cancel()  # listeners drained: the signal watcher is done too

        await nursery.start(handle_signals, edge, nursery.cancel_scope, stopped_by)
        addresses = await nursery.start(run_edge)
        # Under systemd (Type=notify): serving now, and this is the process to supervise,
        # a restart's successor included (`service_manager`).
        service_manager.notify_serving()
        task_status.started(addresses)
    log.info("IOP Edge stopped")
    return stopped_by.exit_status
