"""A dispatcher over a pool no Node ever joins, in process: for tests of what happens to a
request before it could reach one (parsing, admission, limits)."""

from __future__ import annotations

from collections.abc import Callable

from iop_edge.runtime.metering.metering import RunRecord
from iop_edge.runtime.nodes.hub import NodeDirectory, NodeHub
from iop_edge.runtime.runs.dispatch import Dispatcher
from iop_edge.runtime.runs.limits import PrincipalLimiter
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas.config import NodeConfig


def nodeless_dispatcher(
    scheduler: Scheduler,
    *,
    meter: Callable[[RunRecord], None] = lambda _: None,
    limits: PrincipalLimiter | None = None,
) -> Dispatcher:
    """A dispatcher whose hub no Node can join (every token hash is unknown)."""
    directory = NodeDirectory(
        edge_id="e",
        revision=1,
        token_hash=lambda _: None,
        node_config=lambda node: NodeConfig(node_id=node),
    )
    hub = NodeHub(
        lambda: directory,
        on_connect=lambda _: None,
        on_disconnect=lambda _: None,
        on_status=lambda *_: None,
    )
    return Dispatcher(
        scheduler,
        hub,
        meter=meter,
        on_failover=lambda *_: None,
        on_busy_answer=lambda *_: None,
        retries_before_first_byte=lambda: 1,
        limits=limits,
    )
