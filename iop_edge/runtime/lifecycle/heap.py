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
   (`gc_pause.RECENT`, a pass over those sessions and the requests since the last
   freeze): the cyclic garbage of finished requests waits there, thousands of objects,
   and frozen with the sessions it would stay until a thaw (each Node that reconnects
   would leave megabytes behind).
   A refresh freezes the heap when it starts and what it built when that is done
   (`core.gc_pause`), and leaves it so.
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
   connected (at least `BURST`), after `THAW_AFTER_FREEZES` freezes by refreshes, or
   `THAW_INTERVAL_S` after the last one if anything was frozen since. It is the one
   pause left, proportional to the heap, and it is logged with what it reclaimed. The
   keeper looks whether one is due at each connect and disconnect, at the deadline, and
   each time a refresh lets go of the heap (`gc_pause.watch_holds`).
5. While bulk work in a worker thread has the collector paused (`gc_pause.paused()`,
   a refresh reading a candidate), what it built so far is all young: the keeper does
   not collect then (a young collection would walk the build, half a second of the
   loop with ten thousand Nodes) and does not thaw. The sweep skips its turn and looks
   again every `SWEEP_MIN_S`, so the first sweep after the pause comes at once and walks
   only what the loop made meanwhile (kept at a longer period, it would walk a second of
   a fleet's acks at once when an apply's pushes begin); a burst is frozen without its
   collection (the refresh freezes its build anyway); a thaw that is due waits until the
   refresh lets go of the heap, or a sweep period.
6. While a refresh holds the heap (`gc_pause.held()`: its build, its swap, its pushes),
   a sweep comes every `SWEEP_HELD_S` at most. An apply's pushes begin right after its
   swap, and a fleet's acks and statuses with them: a period learned before (a second,
   the fleet idle), or after a build too short for the sweep to see its pause, let a
   second of them pile up, walked in one step of 30-40 ms with ten thousand Nodes. The
   hold's opening wakes the sweep (`gc_pause.watch_holds`); it froze the heap itself.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Final, Protocol

import trio

from iop_edge.core.gc_pause import RECENT, freezes, held, paused, watch_holds

__all__ = [
    "BURST",
    "CHURN_SHARE",
    "QUIET_S",
    "SWEEP_FLEET",
    "SWEEP_HELD_S",
    "SWEEP_MIN_S",
    "SWEEP_S",
    "SWEEP_STEP_S",
    "THAW_AFTER_FREEZES",
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
#: The longest period while a refresh holds the heap (Rule 6).
SWEEP_HELD_S: Final = 0.1
#: Ended sessions, as a share of the connected ones, that bring a thaw (Rule 4).
CHURN_SHARE: Final = 0.1
#: The longest the heap stays frozen without a thaw while things get frozen (Rule 4).
THAW_INTERVAL_S: Final = 600.0
#: Freezes by bulk operations (`core.gc_pause.freezes`: two or three a refresh) that bring
#: a thaw sooner (Rule 4): what was frozen with them may hold garbage.
THAW_AFTER_FREEZES: Final = 64


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


class _Gc:
    def freeze(self) -> None:
        gc.freeze()

    def unfreeze(self) -> None:
        gc.unfreeze()

    def collect(self, generation: int = 2) -> int:
        return gc.collect(generation)


def settle() -> None:
    """Rule 1: call once the Edge is built, before it serves."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)


class HeapKeeper:
    """Freezes the heap after connect bursts and, for a large fleet, every second; thaws
    it after churn or a long freeze (Rules 2-4).

    The hub reports connects and disconnects (`node_connected`, `node_disconnected`);
    `run` is a service of the Edge that acts on them, and on the end of each refresh.
    `paused` says whether bulk work has the collector paused (Rule 5)."""

    def __init__(
        self,
        collector: Collector | None = None,
        *,
        paused: Callable[[], bool] = paused,
        held: Callable[[], bool] = held,
        timer: Callable[[], float] = time.thread_time,
    ) -> None:
        """`timer` measures what a sweep cost the loop's thread (Rule 3): its CPU time,
        so a machine that preempts the Edge does not make the sweeps come faster."""
        self._gc = collector or _Gc()
        self._paused = paused
        self._held = held
        self._hold_opened = trio.Event()
        """Set when a refresh's hold opens (Rule 6), replaced once the sweep saw it."""
        self._timer = timer
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

    def _hold_began(self) -> None:
        self._hold_opened.set()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _frozen_since_thaw(self) -> bool:
        return self._froze or freezes() != self._freezes_at_thaw

    def _thaw_due(self, now: float) -> bool:
        churn = self._ended >= max(BURST, CHURN_SHARE * self._connected)
        stale = self._frozen_since_thaw() and now - self._last_thaw >= THAW_INTERVAL_S
        bulk = freezes() - self._freezes_at_thaw >= THAW_AFTER_FREEZES
        return churn or stale or bulk

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Freeze and thaw as Rules 2-6 say, until cancelled."""
        # A refresh let go of the heap: look again (Rule 4); it took hold of it: sweep
        # sooner (Rule 6).
        with watch_holds(self._wake, opened=self._hold_began):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._sweep)
                task_status.started()
                await self._watch()

    async def _sweep(self) -> None:
        """Rules 3 and 6: a period that follows what a sweep costs, not a wait for a
        condition, and kept short while a refresh holds the heap."""
        period = SWEEP_S
        while True:
            with trio.move_on_after(period):
                await self._hold_opened.wait()
            if self._hold_opened.is_set():  # Rule 6: the hold froze the heap as it opened
                self._hold_opened = trio.Event()
                period = min(period, SWEEP_HELD_S)
                continue
            if self._connected < SWEEP_FLEET:
                period = SWEEP_S
                continue
            if self._paused():  # Rule 5: skipped, looked at again soon
                period = SWEEP_MIN_S
                continue
            began = self._timer()
            self._gc.collect(0)  # the period's young garbage: not frozen (Rule 2's why)
            self._gc.freeze()
            self._froze = True
            period = sweep_period(period, self._timer() - began)
            if self._held():  # Rule 6
                period = min(period, SWEEP_HELD_S)

    async def _watch(self) -> None:
        """Rules 2, 4 and 5, as connects, disconnects and refreshes come."""
        while True:
            now = trio.current_time()
            deferred = False
            if self._thaw_due(now):
                if not self._paused():
                    self._thaw()
                    continue
                deferred = True  # Rule 5: tried again when the refresh is done
            deadline = self._last_thaw + THAW_INTERVAL_S if self._frozen_since_thaw() else None
            if deferred:
                deadline = now + SWEEP_S
            if self._arrived:
                quiet_at = self._last_arrival + QUIET_S
                if self._arrived >= BURST or now >= quiet_at:
                    if not self._paused():  # Rule 5: the freeze alone, during a build
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
        self._freezes_at_thaw = freezes()
        self._last_thaw = trio.current_time()
