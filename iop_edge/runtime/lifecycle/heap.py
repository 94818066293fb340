"""The Edge process's heap and CPython's cyclic collector: what it looks at, how often.

An Edge with thousands of Nodes holds millions of long-lived objects (its code, its
config, every Node's session), and CPython's cyclic collector traverses all of them at
every full collection - hundreds of milliseconds with a few thousand Nodes, on whichever
thread allocated last, usually the event loop's. With the default thresholds a full
collection follows whenever a quarter of the heap's size was promoted out of the young
generations since the last one, and a refresh of a fleet (messages out and acks in for
every Node) promotes that much in seconds: callers felt the refresh through the
collector. So:

1. `settle()`, once the Edge is built at startup, freezes everything alive then
   (`gc.freeze()`): the code and the config are not traversed by the collections before
   the first refresh (which unfreezes the heap when it ends, `core.gc_pause.gc_held`).
   Nothing is lost: frozen objects are still freed by reference counting.
2. The collector's thresholds are raised (`THRESHOLDS`): a young collection runs every
   `THRESHOLDS[0]` net allocations instead of 700, so the objects of a request or of a
   Node's message are gone before a collection could promote them, and promotion - what
   brings on a full collection - is rare. A young collection then looks at up to that
   many objects, a few milliseconds.
"""

from __future__ import annotations

import gc
from typing import Final

__all__ = ["THRESHOLDS", "settle"]

#: `gc.set_threshold` for the Edge process (CPython's defaults: 700, 10, 10).
THRESHOLDS: Final = (20_000, 20, 10)


def settle() -> None:
    """Rules 1 and 2: call once the Edge is built, before it serves."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
