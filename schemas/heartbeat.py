"""When a Node pings its Edge: at its own instant of a grid every Node shares.

A Node pings each Edge once per `heartbeat_s` (the interval the Edge announces in
`welcome`), and the Edge answers. An Edge with a thousand Nodes answers 200 pings a
second; spread at random over the interval, every one of them wakes the Edge on its own
and costs it whole scheduling passes. So every Node pings at an instant of one
wall-clock grid, an instant every `HEARTBEAT_STEP_S` (`heartbeat_slots` of them per
interval), its instant chosen by its node id: the pings of the Nodes sharing an instant
reach the Edge together and are answered in the same passes. The Edge looks at its Node
sessions on the same grid (`iop_edge.runtime.nodes.heartbeat`). Clocks need not agree
for this to be correct, only for it to batch; a clock step makes one ping come early or
late, nothing more.

The grid's step is fixed, not its number of instants: an Edge announces a longer
interval to a larger fleet, so that the whole fleet pings at most a few hundred times a
second, and with a fixed number of instants each one's batch would grow with the fleet
(two hundred pings at once every 0.4 s with ten thousand Nodes). While the Edge is busy
(a refresh reading a fleet's config beside its event loop), answering a batch that size
takes tens of milliseconds, and callers' requests wait behind it. With a fixed step a
batch stays the size of a second's pings times the step, whatever the fleet.
"""

from __future__ import annotations

import zlib
from typing import Final

__all__ = ["HEARTBEAT_STEP_S", "heartbeat_slots", "seconds_to_next_ping"]

#: Between two instants of the grid: at 500 pings a second, 20 share an instant.
HEARTBEAT_STEP_S: Final = 0.04


def heartbeat_slots(interval_s: float) -> int:
    """The grid's instants per interval of `interval_s` seconds (at least one)."""
    return max(1, round(interval_s / HEARTBEAT_STEP_S))


def seconds_to_next_ping(node_id: str, interval_s: float, now_unix: float) -> float:
    """How long from `now_unix` (wall-clock seconds) until `node_id`'s next instant of
    the grid: in (0, interval_s]."""
    slots = heartbeat_slots(interval_s)
    phase = (zlib.crc32(node_id.encode()) % slots) * interval_s / slots
    wait = interval_s - (now_unix - phase) % interval_s
    return wait if wait > 0 else interval_s
