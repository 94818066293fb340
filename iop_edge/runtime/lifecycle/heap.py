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
2. Every `BURST` Nodes that connected since the last freeze, the heap is frozen again:
   a connect burst's sessions are never walked again, and at most `BURST` sessions'
   objects wait for a collection. A burst smaller than `BURST` is frozen once no Node
   connected for `QUIET_S`. The young and middle generations are collected first
   (`RECENT`, a pass over those sessions and the requests since the last
   freeze): the cyclic garbage of finished requests waits there, thousands of objects,
   and frozen with the sessions it would stay until a thaw (each Node that reconnects
   would leave megabytes behind). While the heap is held (Rule 5) a burst is frozen
   without that collection: the middle generation then holds the held operation's
   objects, and walking them is what the hold avoids.
3. With at least `SWEEP_FLEET` Nodes connected, the heap is also frozen periodically.
   CPython starts a young collection when allocations exceed deallocations by its
   threshold, and counts the deallocation of an old object too: a fleet's statuses
   replace its providers' lists (old ones freed, young ones made), so the young
   generation grows unwalked far past the threshold, and the collection that finally
   walks it held the loop for a quarter of a second with ten thousand Nodes. Collected
   and frozen every `SWEEP_S` at most, it never holds more than that period's worth.
   What a sweep walks is what the Edge made since the last one and still holds (the
   await chains of sessions that received a message, their statuses): a few milliseconds
   a second idle, but 60-80 ms a second while ten thousand Nodes ack a refresh, all of
   it in one step of the loop. So the period follows the cost: after a sweep that took
   `took` of a period `period`, the next comes after `period * SWEEP_STEP_S / took`,
   between `SWEEP_MIN_S` and `SWEEP_S`, and a sweep holds the loop about `SWEEP_STEP_S`
   however busy the fleet is. The total is the same (the collector walks each young
   object once either way), only cut finer.
4. Only cyclic garbage among frozen objects waits: a session that ended after it was
   frozen keeps its memory until a thaw. A thaw (`gc.unfreeze`, a full collection, freeze
   again) runs once sessions that ended since the last one reach `CHURN_SHARE` of those
   connected (at least `BURST`), or `THAW_INTERVAL_S` after the last one if anything was
   frozen since. It is the one pause left, proportional to the heap (the fleet bench's
   churn measures it: about 0.2 s of the loop's CPU with 1,000 Nodes, 2 s with 10,000,
   every caller waiting meanwhile), and it is logged with what it reclaimed. The keeper
   looks whether one is due at each connect and disconnect, and at the deadline.
5. A refresh reads, checks and plans its candidate in a process of its own
   (`runtime.refresh.worker`); what it makes here is the new snapshot (its changed
   Nodes, its lookups) and a fleet's pushes. `held()` keeps the heap out of the
   collector's sight for such a bulk operation on the loop: a refresh's apply
   (assembling the new snapshot, the swap, the pushes to every Node and their acks).
   It opens by collecting the young and middle generations (`RECENT`) and freezing
   what is alive; while open only young collections run (what the operation and
   callers' requests make, cheap to look at: what survives them waits in the middle
   generation, unwalked), and a thaw that falls due waits; it closes by freezing what
   is alive (the new snapshot, never walked again) and restoring the thresholds. As it
   opens, the sweeps (Rule 3) start over at their shortest period: a fleet's acks begin
   with the pushes, and a period learned while the fleet was idle would let a second of
   them pile up for one sweep (near 50 ms of the loop with ten thousand Nodes). A
   fleet's apply makes hundreds of thousands of objects in a few seconds, and with
   the usual thresholds the middle and oldest generations' collections would walk
   them again and again: seconds of the loop's time in all, which callers wait
   behind. This is the one place the Edge changes the collector's thresholds.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final, Protocol

import trio

__all__ = [
    "BURST",
    "CHURN_SHARE",
    "QUIET_S",
    "RECENT",
    "SWEEP_FLEET",
    "SWEEP_MIN_S",
    "SWEEP_S",
    "SWEEP_STEP_S",
    "THAW_INTERVAL_S",
    "THRESHOLDS",
    "Collector",
    "HeapKeeper",
    "settle",
    "sweep_period",
]

log = logging.getLogger(__name__)

#: `gc.set_threshold` for the Edge process (CPython's defaults: 700, 10, 10).
THRESHOLDS: Final = (10_000, 20, 10)
#: Node connects that bring a freeze (Rule 2), and the least churn worth a thaw (Rule 3).
BURST: Final = 64
#: How long no Node may have connected before fewer than `BURST` new sessions are frozen
#: (Rule 2).
QUIET_S: Final = 2.0
#: How often a large fleet's heap is frozen at most and at least (Rule 3), the loop time
#: a sweep aims at, and from how many Nodes on.
SWEEP_S: Final = 1.0
SWEEP_MIN_S: Final = 0.05
SWEEP_STEP_S: Final = 0.003
SWEEP_FLEET: Final = 1000
#: Ended sessions, as a share of the connected ones, that bring a thaw (Rule 4).
CHURN_SHARE: Final = 0.1
#: The longest the heap stays frozen without a thaw while things get frozen (Rule 4).
THAW_INTERVAL_S: Final = 600.0
#: The oldest generation collected before new sessions are frozen (Rule 2): the young
#: and the middle one, where the cyclic garbage of finished requests waits.
RECENT: Final = 1
#: The older generations' thresholds while the heap is held (Rule 5): never collected.
HELD_THRESHOLD: Final = 2**30


def sweep_period(period: float, took: float) -> float:
    """The period after a sweep that took `took` of loop time, `period` after the last
    one (Rule 3): the young generation grows with time, so the next sweep aims at
    `SWEEP_STEP_S`."""
    if took <= 0:
        return SWEEP_S
    return min(SWEEP_S, max(SWEEP_MIN_S, period * SWEEP_STEP_S / took))


class Collector(Protocol):
    """CPython's collector as the keeper drives it (a fake in tests)."""

    def freeze(self) -> None: ...

    def unfreeze(self) -> None: ...

    def collect(self, generation: int = 2) -> int:
        """Collect `generation` and the younger ones; the objects it reclaimed."""
        ...

    def get_threshold(self) -> tuple[int, int, int]: ...

    def set_threshold(self, young: int, middle: int, old: int) -> None: ...


class _Gc:
    def freeze(self) -> None:
        gc.freeze()

    def unfreeze(self) -> None:
        gc.unfreeze()

    def collect(self, generation: int = 2) -> int:
        return gc.collect(generation)

    def get_threshold(self) -> tuple[int, int, int]:
        return gc.get_threshold()

    def set_threshold(self, young: int, middle: int, old: int) -> None:
        gc.set_threshold(young, middle, old)


def settle() -> None:
    """Rule 1: call once the Edge is built, before it serves."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)


class HeapKeeper:
    """Freezes the heap after connect bursts and, for a large fleet, every second; thaws
    it after churn or a long freeze (Rules 2-4); holds it for a bulk operation (Rule 5).

    The hub reports connects and disconnects (`node_connected`, `node_disconnected`);
    `run` is a service of the Edge that acts on them."""

    def __init__(
        self,
        collector: Collector | None = None,
        *,
        timer: Callable[[], float] = time.thread_time,
    ) -> None:
        """`timer` measures what a sweep cost the loop's thread (Rule 3): its CPU time,
        so a machine that preempts the Edge does not make the sweeps come faster."""
        self._gc = collector or _Gc()
        self._timer = timer
        self._connected = 0
        self._arrived = 0
        """Nodes connected since the last freeze."""
        self._ended = 0
        """Sessions ended since the last thaw."""
        self._froze = False
        """The keeper froze the heap since the last thaw."""
        self._last_arrival = -float("inf")
        self._last_thaw = trio.current_time()
        self._changed = trio.Event()
        self._holds = 0
        """Open `held()` bodies (Rule 5)."""
        self._hold_opened = trio.Event()
        self._thresholds: tuple[int, int, int] = THRESHOLDS

    @contextmanager
    def held(self) -> Iterator[None]:
        """Keep the heap out of the collector's sight for the body (Rule 5). Re-entrant;
        on the event loop's thread only."""
        if self._holds == 0:
            self._thresholds = self._gc.get_threshold()
            self._gc.collect(RECENT)
            self._gc.freeze()
            self._froze = True
            self._gc.set_threshold(self._thresholds[0], HELD_THRESHOLD, HELD_THRESHOLD)
            self._hold_opened.set()  # the sweeps start over at their shortest period
            self._hold_opened = trio.Event()
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1
            if self._holds == 0:
                self._gc.freeze()
                self._gc.set_threshold(*self._thresholds)
                self._wake()  # a thaw that fell due meanwhile

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

    def _thaw_due(self, now: float) -> bool:
        if self._holds:  # Rule 5: it waits for the hold's end
            return False
        churn = self._ended >= max(BURST, CHURN_SHARE * self._connected)
        stale = self._froze and now - self._last_thaw >= THAW_INTERVAL_S
        return churn or stale

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Freeze and thaw as Rules 2-4 say, until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sweep)
            task_status.started()
            await self._watch()

    async def _sweep(self) -> None:
        """Rule 3: a period that follows what a sweep costs, not a wait for a condition."""
        period = SWEEP_S
        while True:
            opened = self._hold_opened
            with trio.move_on_after(period):
                await opened.wait()  # Rule 5: the hold froze the heap; look again soon
                period = SWEEP_MIN_S
                continue
            if self._connected < SWEEP_FLEET:
                period = SWEEP_S
                continue
            began = self._timer()
            self._gc.collect(0)  # the period's young garbage: not frozen (Rule 2's why)
            self._gc.freeze()
            self._froze = True
            period = sweep_period(period, self._timer() - began)

    async def _watch(self) -> None:
        """Rules 2, 4 and 5, as connects and disconnects come and holds end."""
        while True:
            now = trio.current_time()
            if self._thaw_due(now):
                self._thaw()
                continue
            stale_at = self._froze and not self._holds  # Rule 5: held, the end wakes it
            deadline = self._last_thaw + THAW_INTERVAL_S if stale_at else None
            if self._arrived:
                quiet_at = self._last_arrival + QUIET_S
                if self._arrived >= BURST or now >= quiet_at:
                    if not self._holds:  # held, the middle generation is the hold's
                        self._gc.collect(RECENT)
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
        """Rule 4: unfreeze, collect everything once, freeze the survivors."""
        began = time.perf_counter()
        self._gc.unfreeze()
        reclaimed = self._gc.collect()
        self._gc.freeze()
        log.info(
            "heap: a full collection after %d ended session(s) reclaimed %d object(s) in %.0f ms",
            self._ended,
            reclaimed,
            (time.perf_counter() - began) * 1000,
        )
        self._ended = 0
        self._arrived = 0
        self._froze = False
        self._last_thaw = trio.current_time()
