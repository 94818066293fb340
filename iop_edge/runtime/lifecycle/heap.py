"""The Edge process's heap and CPython's cyclic collector: what it looks at, and when.

An Edge with thousands of Nodes holds millions of long-lived objects (its code, its
config, each Node's session: its tasks, channels, websocket and buffers). CPython's
cyclic collector walks objects while holding the GIL, so each collection holds the event
loop: a pass over one connect burst's new sessions took 0.4 s with 3,000 Nodes, a full
collection seconds with 10,000, and with the default thresholds such passes follow every
burst and every refresh. Callers felt them. The Edge therefore keeps its long-lived heap
out of the collector's sight (`gc.freeze`: frozen objects are never walked, and are still
freed by reference counting as soon as nothing uses them), and lets the collector look
at it again only at moments it chooses:

1. `settle()`, once the Edge is built at startup: collect, freeze, and raise the young
   threshold (`THRESHOLDS`): a young collection runs every `THRESHOLDS[0]` net
   allocations instead of 700, so a request's or a message's objects are gone before a
   collection could promote them.
2. After a connect burst (at least `BURST` Nodes connected since the last freeze) has been
   quiet for `QUIET_S`, the heap is frozen again: the new sessions are never walked.
   A refresh freezes the heap when it starts and what it built when that is done
   (`core.gc_pause`), and leaves it so.
3. Only cyclic garbage among frozen objects waits: a session that ended after it was
   frozen keeps its memory until a thaw. A thaw (`gc.unfreeze`, a full collection, freeze
   again) runs once sessions that ended since the last one reach `CHURN_SHARE` of those
   connected (at least `BURST`), or `THAW_INTERVAL_S` after the last one if anything was
   frozen since. It is the one pause left, proportional to the heap, and it is logged
   with what it reclaimed.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Final, Protocol

import trio

from iop_edge.core.gc_pause import freezes

__all__ = [
    "BURST",
    "CHURN_SHARE",
    "QUIET_S",
    "THAW_INTERVAL_S",
    "THRESHOLDS",
    "Collector",
    "HeapKeeper",
    "settle",
]

log = logging.getLogger(__name__)

#: `gc.set_threshold` for the Edge process (CPython's defaults: 700, 10, 10).
THRESHOLDS: Final = (10_000, 20, 10)
#: Node connects since the last freeze that make a burst worth freezing (Rule 2), and the
#: least churn worth a thaw (Rule 3).
BURST: Final = 64
#: How long no Node may have connected before a burst's sessions are frozen (Rule 2).
QUIET_S: Final = 2.0
#: Ended sessions, as a share of the connected ones, that bring a thaw (Rule 3).
CHURN_SHARE: Final = 0.1
#: The longest the heap stays frozen without a thaw while things get frozen (Rule 3).
THAW_INTERVAL_S: Final = 3600.0


class Collector(Protocol):
    """CPython's collector as the keeper drives it (a fake in tests)."""

    def freeze(self) -> None: ...

    def unfreeze(self) -> None: ...

    def collect(self) -> int: ...


class _Gc:
    def freeze(self) -> None:
        gc.freeze()

    def unfreeze(self) -> None:
        gc.unfreeze()

    def collect(self) -> int:
        return gc.collect()


def settle() -> None:
    """Rule 1: call once the Edge is built, before it serves."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)


class HeapKeeper:
    """Freezes the heap after connect bursts, thaws it after churn (Rules 2, 3).

    The hub reports connects and disconnects (`node_connected`, `node_disconnected`);
    `run` is a service of the Edge that acts on them."""

    def __init__(self, collector: Collector | None = None) -> None:
        self._gc = collector or _Gc()
        self._connected = 0
        self._arrived = 0
        """Nodes connected since the last freeze."""
        self._ended = 0
        """Sessions ended since the last thaw."""
        self._froze = False
        """The keeper froze the heap since the last thaw (a refresh counts too:
        `gc_pause.freezes()` moved)."""
        self._freezes_at_thaw = freezes()
        self._last_arrival = -float("inf")
        self._last_thaw = trio.current_time()
        self._changed = trio.Event()

    def node_connected(self) -> None:
        self._connected += 1
        self._arrived += 1
        self._last_arrival = trio.current_time()
        self._wake()

    def node_disconnected(self) -> None:
        self._connected = max(self._connected - 1, 0)
        self._ended += 1
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _frozen_since_thaw(self) -> bool:
        return self._froze or freezes() != self._freezes_at_thaw

    def _thaw_due(self, now: float) -> bool:
        churn = self._ended >= max(BURST, CHURN_SHARE * self._connected)
        stale = self._frozen_since_thaw() and now - self._last_thaw >= THAW_INTERVAL_S
        return churn or stale

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Freeze after quiet bursts, thaw after churn or a long freeze, until cancelled."""
        task_status.started()
        while True:
            now = trio.current_time()
            if self._thaw_due(now):
                self._thaw()
                continue
            deadline = self._last_thaw + THAW_INTERVAL_S if self._frozen_since_thaw() else None
            if self._arrived >= BURST:
                quiet_at = self._last_arrival + QUIET_S
                if now >= quiet_at:
                    self._gc.freeze()
                    self._arrived = 0
                    self._froze = True
                    continue
                deadline = quiet_at if deadline is None else min(deadline, quiet_at)
            changed = self._changed
            if deadline is None:
                await changed.wait()
            else:
                with trio.move_on_at(deadline):
                    await changed.wait()

    def _thaw(self) -> None:
        """Rule 3: unfreeze, collect everything once, freeze the survivors."""
        began = time.perf_counter()
        self._gc.unfreeze()
        reclaimed = self._gc.collect()
        self._gc.freeze()
        log.info(
            "heap: a full collection after %d ended session(s) reclaimed %d object(s) in "
            "%.0f ms",
            self._ended,
            reclaimed,
            (time.perf_counter() - began) * 1000,
        )
        self._ended = 0
        self._arrived = 0
        self._froze = False
        self._freezes_at_thaw = freezes()
        self._last_thaw = trio.current_time()
