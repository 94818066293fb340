"""When a Node pings its Edge: at its own instant of a grid every Node shares.

A Node pings each Edge once per `heartbeat_s` (the interval the Edge announces in
`welcome`), and the Edge answers. An Edge with a thousand Nodes answers 200 pings a
second; spread at random over the interval, every one of them wakes the Edge on its own
and costs it whole scheduling passes. So every Node pings at an instant of one
wall-clock grid, `HEARTBEAT_SLOTS` instants per interval, its instant chosen by its node
id: the pings of about 1/HEARTBEAT_SLOTS of the fleet reach the Edge together and are
answered in the same passes. The Edge looks at its Node sessions on a grid of as many
instants (`iop_edge.runtime.nodes.heartbeat`). Clocks need not agree for this to be correct,
only for it to batch; a clock step makes one ping come early or late, nothing more.
"""

from __future__ import annotations

import zlib
from typing import Final

__all__ = ["HEARTBEAT_SLOTS", "seconds_to_next_ping"]

#: Instants per heartbeat interval, of the Nodes' ping grid and of the Edge's looks: at a
#: thousand Nodes, 20 pings (or looks) share one scheduling pass every 100 ms.
HEARTBEAT_SLOTS: Final = 50


def seconds_to_next_ping(node_id: str, interval_s: float, now_unix: float) -> float:
    """How long from `now_unix` (wall-clock seconds) until `node_id`'s next instant of
    the grid: in (0, interval_s]."""
    phase = (zlib.crc32(node_id.encode()) % HEARTBEAT_SLOTS) * interval_s / HEARTBEAT_SLOTS
    wait = interval_s - (now_unix - phase) % interval_s
    return wait if wait > 0 else interval_s
