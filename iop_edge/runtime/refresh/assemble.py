"""The snapshot a refresh swaps in, assembled on the event loop from the worker's delta.

The worker (`refresh.worker`) sends what would run as a per-Node delta: an unchanged
Node by its id alone, a changed one encoded alone in a frame (`worker_protocol`, Rule
3). Here the Edge keeps the very objects it runs for the unchanged Nodes, decodes the
changed ones one at a time, and builds the snapshot's lookups
(`core.snapshot.Snapshot.building`), yielding to the loop every `STEP_NODES` Nodes or
`STEP_DECODED` decoded ones: no step holds the loop for more than a fraction of a
millisecond, where decoding a fleet's config in one call would hold it for tens of
milliseconds. Before each yield it says that what it made is alive (`keep`: the heap
keeper freezes it, and its sweeps meanwhile do not walk a snapshot's worth of objects;
`lifecycle.heap` Rule 5).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import msgspec
import trio

from iop_edge.core.snapshot import STEP_NODES, Snapshot
from iop_edge.runtime.refresh.worker_protocol import Built
from schemas.config import EdgeConfig, NodeEntry

__all__ = ["assemble"]

#: Changed Nodes decoded in one step (each is its providers' configs made anew).
STEP_DECODED: Final = 32

_DECODE_REST: Final = msgspec.msgpack.Decoder(EdgeConfig)
_DECODE_NODE: Final = msgspec.msgpack.Decoder(NodeEntry)


async def assemble(
    built: Built, base: Snapshot, *, config_sha256: str, keep: Callable[[], None] = lambda: None
) -> Snapshot:
    """The snapshot `built` describes over `base`, at `base.revision + 1`; `keep()` before
    each yield to the loop."""
    changed = dict(zip(built.changed, built.nodes, strict=True))
    nodes: list[NodeEntry] = []
    decoded = 0
    for index, node_id in enumerate(built.ids):
        if index % STEP_NODES == 0 or decoded == STEP_DECODED:
            keep()
            await trio.lowlevel.checkpoint()
            decoded = 0
        encoded = changed.get(index)
        if encoded is None:
            nodes.append(base.nodes[node_id])
        else:
            nodes.append(_DECODE_NODE.decode(encoded))
            decoded += 1
    config = msgspec.structs.replace(_DECODE_REST.decode(built.rest), nodes=nodes)
    steps = Snapshot.building(config, revision=base.revision + 1, config_sha256=config_sha256)
    while True:
        keep()
        await trio.lowlevel.checkpoint()
        try:
            next(steps)
        except StopIteration as done:
            snapshot: Snapshot = done.value
            return snapshot
