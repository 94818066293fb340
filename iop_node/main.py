"""The Node process: one Trio nursery around the link to the Edge.

`run_node` is the whole Node as a startable Trio function. The `iop-node run` command
uses it with signal handling (`serve_until_signalled`); the Edge's in-process demo and
the tests call it directly, with small timeouts and backoff values when they need them.
"""

from __future__ import annotations

import logging
import random
import signal
from collections.abc import Awaitable, Callable

import trio

from iop_node import __version__
from iop_node.backoff import BackoffPolicy
from iop_node.health import DEFAULT_PROBE_TIMEOUT_S
from iop_node.link import EdgeRejected, LinkSettings, NodeLink
from iop_node.registry import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_RETIRING,
    AdapterFactory,
    create_adapter,
)

log = logging.getLogger(__name__)


async def run_node(
    edge_url: str,
    node_id: str,
    token: str,
    *,
    agent_version: str = f"iop-node/{__version__}",
    backoff: BackoffPolicy | None = None,
    rng: random.Random | None = None,
    handshake_timeout_s: float = 10.0,
    ping_interval_s: float | None = None,
    ping_timeout_s: float | None = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    max_retiring: int = DEFAULT_MAX_RETIRING,
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
    adapter_factory: AdapterFactory = create_adapter,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    task_status: trio.TaskStatus[NodeLink] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a Node against the Edge at `edge_url` (`ws://` or `wss://`), reconnecting forever.

    Startable: `link = await nursery.start(run_node, ...)` returns once the Edge has
    welcomed the Node, its providers are built and their first `status` is on its way
    (so a demo can print "ready" truthfully). Until then the Node keeps retrying, and
    logs why (an unreachable Edge, a rejected token).

    It returns only when `shutdown_trigger` returns (or `link.stop()` is called) and the
    graceful stop completed: providers reported draining, active runs drained within
    `drain_timeout_s`, connection closed. Cancel it to stop at once. It raises
    `EdgeRejected` when the Edge refused this Node permanently a few times in a row (a
    bad token, an unknown node id, another protocol, or another Node with the same id).

    `ping_interval_s` defaults to the heartbeat the Edge announces, `ping_timeout_s` to
    three intervals; `backoff` and `rng` make reconnect timing injectable for tests.
    """
    settings = LinkSettings(
        edge_url=edge_url,
        node_id=node_id,
        token=token,
        agent_version=agent_version,
        backoff=backoff or BackoffPolicy(),
        handshake_timeout_s=handshake_timeout_s,
        ping_interval_s=ping_interval_s,
        ping_timeout_s=ping_timeout_s,
        drain_timeout_s=drain_timeout_s,
        max_retiring=max_retiring,
        probe_timeout_s=probe_timeout_s,
        adapter_factory=adapter_factory,
    )
    link = NodeLink(settings, rng=rng)
    rejected: EdgeRejected | None = None
    async with trio.open_nursery() as nursery:
        if shutdown_trigger is not None:
            trigger = shutdown_trigger

            async def stop_when_triggered() -> None:
                await trigger()
                link.stop()

            nursery.start_soon(stop_when_triggered, name="node shutdown trigger")
        try:
            await link.run(task_status=task_status)
        except EdgeRejected as exc:
            rejected = exc  # raised bare below, not wrapped in the nursery's group
        nursery.cancel_scope.cancel()
    if rejected is not None:
        raise rejected


async def serve_until_signalled(edge_url: str, node_id: str, token: str) -> None:
    """Run a Node until SIGINT/SIGTERM: the first signal drains and stops gracefully, a
    second one stops at once."""
    stop = trio.Event()
    rejected: EdgeRejected | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(_watch_signals, stop, nursery.cancel_scope)
        log.info("iop-node %s: node %s, edge %s", __version__, node_id, edge_url)
        try:
            await run_node(edge_url, node_id, token, shutdown_trigger=stop.wait)
        except EdgeRejected as exc:
            rejected = exc
        nursery.cancel_scope.cancel()
    if rejected is not None:
        raise rejected


async def _watch_signals(
    stop: trio.Event,
    hard_stop: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if not stop.is_set():
                log.info("%s: draining active runs, then stopping (repeat to stop now)", name)
                stop.set()
            else:
                log.warning("%s again: stopping now", name)
                hard_stop.cancel()
                return
