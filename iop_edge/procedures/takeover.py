"""Taking over: a successor Edge waits for the Nodes of the Edge it replaces.

Once the successor listens for Nodes it says so to the old Edge (`Handover.listening`),
which stops accepting Nodes, sends them `goaway` and names the Nodes it had linked. Each
Node links again, now to the successor. The successor accepts callers only once those
Nodes linked and reported their providers' health, so the first callers it serves find
the pool the old Edge had; a Node that does not link within `HANDOVER_NODES_TIMEOUT_S`
is left behind (logged), as a Node that is down would be.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Final

import trio

from iop_edge.runtime.lifecycle.handover import Handover
from schemas.catalog import Catalog

__all__ = ["HANDOVER_NODES_TIMEOUT_S", "nodes_reporting", "take_over_nodes"]

log = logging.getLogger(__name__)

#: A successor must have the old Edge's Nodes linked within this, else it goes on without.
HANDOVER_NODES_TIMEOUT_S: Final = 15.0


async def take_over_nodes(
    handover: Handover,
    *,
    catalog: Callable[[], Catalog],
    connected_nodes: Callable[[], Iterable[str]],
    wait_changed: Callable[[], Awaitable[None]],
) -> None:
    """Tell the old Edge this one takes Nodes, then wait (bounded) until the Nodes it had
    linked here and reported their providers' health (module docstring)."""
    expected = set(await handover.listening())
    if not expected:
        return

    def missing() -> set[str]:
        return expected - nodes_reporting(catalog(), connected_nodes())

    with trio.move_on_after(HANDOVER_NODES_TIMEOUT_S):
        while waiting := missing():
            log.debug("restart: waiting for node(s) %s", ", ".join(sorted(waiting)))
            await wait_changed()
    if left := missing():
        log.warning(
            "restart: node(s) %s did not link within %gs; going on without them",
            ", ".join(sorted(left)),
            HANDOVER_NODES_TIMEOUT_S,
        )
    else:
        log.info("restart: node(s) %s linked", ", ".join(sorted(expected)))


def nodes_reporting(catalog: Catalog, connected: Iterable[str]) -> set[str]:
    """The `connected` nodes whose every provider has reported a health."""
    waiting = {provider.node_id for provider in catalog.providers if provider.health == "unknown"}
    return {node for node in connected if node not in waiting}
