"""The Node process's heap and CPython's cyclic collector (design §3, per-request work).

A Node's long-lived heap is its code, its config and its providers' adapters; what a run
makes is short-lived and freed by reference counting as the run ends. With CPython's
default thresholds (700, 10, 10) the collector still walks that long-lived heap again and
again: a young collection every 700 net allocations (a few runs), and a full collection
of every object the process holds (some 20-30 ms on a 2-core machine) every few seconds
under load, each holding the event loop and every run's relay with it. So, as the Edge
does with its own heap (`iop_edge.runtime.lifecycle.heap`), the Node keeps its
long-lived heap out of the collector's sight:

1. `providers_built()` settles the heap each time the Node's providers are built (the
   first config from an Edge, and every config that changes them): it collects once
   (the cyclic garbage of the providers a refresh retired included), freezes what is
   left (`gc.freeze`: frozen objects are never walked again, and are still freed by
   reference counting as soon as nothing uses them), and raises the young threshold
   (`THRESHOLDS`), so a run's objects are gone before a collection could promote them.
2. Only cyclic garbage among frozen objects waits for the next settling: a retired
   provider's adapter that a refresh froze while its last runs drained. Refreshes that
   change a Node's providers are rare, and each one brings the collection that frees
   the previous one's.
3. The collector is the process's, so only a process that is a Node and nothing else
   settles its heap: `iop-node run` says so (`manage`) as it starts serving. A Node run
   inside another program (the demo, the tests) leaves that program's collector alone.
"""

from __future__ import annotations

import gc
from typing import Final

__all__ = ["THRESHOLDS", "manage", "managed", "providers_built"]

#: `gc.set_threshold` for the Node process, as the Edge's (CPython's defaults: 700, 10, 10).
THRESHOLDS: Final = (10_000, 20, 10)


class _Process:
    managed = False


def manage() -> None:
    """Rule 3: this process is a Node's own; its heap is settled from now on."""
    _Process.managed = True


def managed() -> bool:
    return _Process.managed


def providers_built() -> None:
    """Rule 1: the providers were just built (a Node's own process only, Rule 3):
    collect, freeze, raise the young threshold."""
    if not _Process.managed:
        return
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
