"""The Node process: one Trio nursery around its links to the Edges.

`run_node` is the whole Node as a startable Trio function. The `iop-node run` command
uses it with signal handling (`serve_until_signalled`); the Edge's in-process demo and
the tests call it directly, with small timeouts and backoff values when they need them.
"""

from __future__ import annotations

import logging
import random
import signal
from collections.abc import Awaitable, Callable, Sequence
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import trio

from iop_node import __version__, heap
from iop_node.health import DEFAULT_PROBE_TIMEOUT_S
from iop_node.host import ProviderHost
from iop_node.registry import (
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_MAX_RETIRING,
    AdapterFactory,
    create_adapter,
)
from iop_node.tracing import NodeTracing
from iop_node.uplink.backoff import BackoffPolicy
from iop_node.uplink.edges import DEFAULT_DNS_INTERVAL_S, EdgeLinks, Resolver, resolve_addresses
from iop_node.uplink.link import EdgeRejected
from iop_node.uplink.link_settings import (
    GOAWAY_LINGER_S,
    LOAD_REPORT_INTERVAL_S,
    LOAD_REPORT_RELAXED_S,
    LinkSettings,
)
from schemas.runtime.stop_signal import StopSignal

if TYPE_CHECKING:  # the adapter's module is imported when a cli provider is built
    from iop_node.adapters.cli import AllowedCommands

log = logging.getLogger(__name__)


async def run_node(
    edge_url: str | Sequence[str],
    node_id: str,
    token: str,
    *,
    edge_dns: Sequence[str] = (),
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
    load_report_interval_s: float = LOAD_REPORT_INTERVAL_S,
    load_report_relaxed_s: float = LOAD_REPORT_RELAXED_S,
    goaway_linger_s: float = GOAWAY_LINGER_S,
    dns_interval_s: float = DEFAULT_DNS_INTERVAL_S,
    resolver: Resolver = resolve_addresses,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    tracing: NodeTracing | None = None,
    task_status: trio.TaskStatus[EdgeLinks] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a Node against its Edges, reconnecting forever.

    `edge_url` is one Edge URL (`ws://` or `wss://`) or several; `edge_dns` names Edges by
    a DNS name, one link per address it resolves to (see `edges`). All links share the
    Node's providers.

    Startable: `links = await nursery.start(run_node, ...)` returns once an Edge has
    welcomed the Node, its providers are built and their status is on its way (so a
    demo can print "ready" truthfully). Until then the Node keeps retrying, and logs why
    (an unreachable Edge, a rejected token).

    It returns only when `shutdown_trigger` returns (or `links.stop()` is called) and the
    graceful stop completed: providers reported draining, active runs drained within
    `drain_timeout_s`, connections closed. Cancel it to stop at once. It raises
    `EdgeRejected` when an Edge refused this Node permanently a few times in a row (a bad
    token, an unknown node id, another protocol, or another Node with the same id).

    `ping_interval_s` defaults to the heartbeat the Edge announces, `ping_timeout_s` to
    three intervals; `backoff`, `rng` and `resolver` are injectable for tests.

    `tracing`: the Node's OpenTelemetry traces (`iop_node.tracing`), for every run of this
    Node; its creator closes it.
    """
    urls = [edge_url] if isinstance(edge_url, str) else list(edge_url)
    template = LinkSettings(
        edge_url=urls[0] if urls else _dns_url_for_template(edge_dns),
        node_id=node_id,
        token=token,
        agent_version=agent_version,
        backoff=backoff or BackoffPolicy(),
        handshake_timeout_s=handshake_timeout_s,
        ping_interval_s=ping_interval_s,
        ping_timeout_s=ping_timeout_s,
        load_report_interval_s=load_report_interval_s,
        load_report_relaxed_s=load_report_relaxed_s,
        goaway_linger_s=goaway_linger_s,
    )
    for url in [*urls, *edge_dns]:
        replace(template, edge_url=url)  # raises ValueError for a URL that is not ws(s)://

    def host_factory(nursery: trio.Nursery) -> ProviderHost:
        return ProviderHost(
            nursery,
            node_id,
            drain_timeout_s=drain_timeout_s,
            max_retiring=max_retiring,
            probe_timeout_s=probe_timeout_s,
            factory=adapter_factory,
        )

    links = EdgeLinks(
        template=template,
        host_factory=host_factory,
        urls=urls,
        dns_urls=list(edge_dns),
        dns_interval_s=dns_interval_s,
        resolver=resolver,
        rng=rng,
    )
    rejected: EdgeRejected | None = None
    try:
        with tracing.installed() if tracing is not None else nullcontext():
            await _run_links(links, shutdown_trigger, task_status)
    except* EdgeRejected as group:
        rejected = _first_rejection(group)
    if rejected is not None:
        raise rejected  # bare, not wrapped in the nurseries' groups


async def _run_links(
    links: EdgeLinks,
    shutdown_trigger: Callable[[], Awaitable[object]] | None,
    task_status: trio.TaskStatus[EdgeLinks],
) -> None:
    async with trio.open_nursery() as nursery:
        if shutdown_trigger is not None:
            trigger = shutdown_trigger

            async def stop_when_triggered() -> None:
                await trigger()
                links.stop()

            nursery.start_soon(stop_when_triggered, name="node shutdown trigger")
        await links.run(task_status=task_status)
        nursery.cancel_scope.cancel()


def _first_rejection(group: BaseExceptionGroup[EdgeRejected]) -> EdgeRejected:
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, EdgeRejected)
    return error


def _dns_url_for_template(edge_dns: Sequence[str]) -> str:
    if not edge_dns:
        raise ValueError("a node needs at least one edge url or edge dns name")
    return edge_dns[0]


async def serve_until_signalled(
    edge_urls: Sequence[str],
    node_id: str,
    token: str,
    *,
    edge_dns: Sequence[str] = (),
    tracing: NodeTracing | None = None,
    allowed_commands: AllowedCommands = frozenset(),
) -> int:
    """Run a Node until SIGINT/SIGTERM: the first signal drains and stops gracefully, a
    second one stops at once. Returns the process's exit status: 130 after Ctrl-C, 0
    after SIGTERM (`schemas.runtime.stop_signal`). `tracing` is closed at the end (its last spans
    sent). `allowed_commands`: what the Edge's `cli` providers may run here.

    The process is this Node's own (`iop-node run`): its heap is settled as its providers
    are built (`heap` Rule 3)."""
    heap.manage()
    try:
        return await _serve_until_signalled(
            edge_urls,
            node_id,
            token,
            edge_dns=edge_dns,
            tracing=tracing,
            adapter_factory=partial(create_adapter, allowed_commands=allowed_commands),
        )
    finally:
        if tracing is not None:
            await tracing.aclose()


async def _serve_until_signalled(
    edge_urls: Sequence[str],
    node_id: str,
    token: str,
    *,
    edge_dns: Sequence[str],
    tracing: NodeTracing | None,
    adapter_factory: AdapterFactory,
) -> int:
    stop = trio.Event()
    stopped_by = StopSignal()
    rejected: EdgeRejected | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(_watch_signals, stop, nursery.cancel_scope, stopped_by)
        edges = ", ".join([*edge_urls, *(f"{url} (every address)" for url in edge_dns)])
        log.info("iop-node %s: node %s, edges %s", __version__, node_id, edges)
        try:
            await run_node(
                edge_urls,
                node_id,
                token,
                edge_dns=edge_dns,
                shutdown_trigger=stop.wait,
                tracing=tracing,
                adapter_factory=adapter_factory,
            )
        except EdgeRejected as exc:
            rejected = exc
        nursery.cancel_scope.cancel()
    if rejected is not None:
        raise rejected
    return stopped_by.exit_status


async def _watch_signals(
    stop: trio.Event,
    hard_stop: trio.CancelScope,
    stopped_by: StopSignal,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            stopped_by.received(signum)
            name = signal.Signals(signum).name
            if not stop.is_set():
                log.info("%s: draining active runs, then stopping (repeat to stop now)", name)
                stop.set()
            else:
                log.warning("%s again: stopping now", name)
                hard_stop.cancel()
                return
