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
   freeze): any garbage among them is reclaimed there rather than frozen, where only a
   thaw would find it (Rule 4). While the heap is held (Rule 5) a burst is frozen
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
   object once either way), only cut finer. A sweep collects the young generation
   alone: the middle one holds what survived a young collection since the last freeze
   (a fleet's whole catalog being answered, say), and walking it too made a sweep 50 ms
   of the loop with ten thousand Nodes. What a sweep freezes is alive, and is freed by
   reference counting once it is not (Rule 4: nothing the Edge does leaves cycles).
4. Only cyclic garbage among frozen objects would wait, for a thaw (`gc.unfreeze`, a
   full collection, freeze again): a pause proportional to the whole heap, about 0.2 s of
   the loop with 1,000 Nodes and 2 s with 10,000, every caller waiting. So the Edge
   leaves none: a Node session that ends (however it ends) and a caller's connection
   that closes are freed by reference counting alone (`schemas.channel` Rule 7,
   `runtime.nodes.session` Rule 6, `http.connection`), and a thaw runs only on evidence
   that something did not. The hub tells the keeper of every session that ended
   (`session_ended`), and a `weakref.finalize` tells it when that session was freed. A
   session still alive `LEAK_GRACE_S` after it ended (its runs heard `lost()` at once,
   a push to it gives up within its own bound) is held by a reference cycle: it is
   counted as leaked (`HeapStatistics`, the `iop_heap_sessions_leaked_total` metric). Once
   `LEAKS_FOR_THAW` sessions leaked since the last thaw, a thaw runs and is logged as a
   warning naming them: it is a defect to fix, and the thaw bounds the memory it costs
   meanwhile. A leaked session the thaw did not free is held by a live reference,
   not a cycle; it is named once more and no longer counted (no collection frees it).
   Nothing else brings a thaw: not churn, not time. The keeper looks at each session's
   end and at the next moment one would count as leaked.
5. A refresh reads, checks and plans its candidate in a process of its own
   (`runtime.refresh.worker`); what it makes here is the new snapshot (its changed
   Nodes, its lookups) and a fleet's pushes. `held()` keeps the heap out of the
   collector's sight for such a bulk operation on the loop: a refresh's apply
   (reading the worker's plan, assembling the new snapshot, the swap, the pushes to
   every Node and their acks), opened before the worker answers.
   It opens by collecting the young and middle generations (`RECENT`) and freezing
   what is alive; while open only young collections run (what the operation and
   callers' requests make, cheap to look at: what survives them waits in the middle
   generation, unwalked), and a thaw that falls due waits; it closes by freezing what
   is alive (the new snapshot, never walked again) and restoring the thresholds. While
   it is open, the sweeps (Rule 3) run at their shortest period, from its opening on: a
   fleet's acks begin with the pushes, and a period learned while the fleet was idle, or
   while the operation had not begun to push, would let a second of them pile up for
   one sweep (20-50 ms of the loop with ten thousand Nodes). A
   fleet's apply makes hundreds of thousands of objects in a few seconds, and with
   the usual thresholds the middle and oldest generations' collections would walk
   them again and again: seconds of the loop's time in all, which callers wait
   behind. This is the one place the Edge changes the collector's thresholds.
   The operation may say sooner that what it made is alive (`keep`, which `held` gives
   it: a freeze, no walk): a new snapshot's hundreds of thousands of objects, assembled
   in steps, would otherwise be walked by the next sweeps, tens of milliseconds of the
   loop each with ten thousand Nodes.
6. Reading a config and building the Edge from it make only long-lived objects and next
   to no cyclic garbage, yet with the collector on every ten young collections bring a
   middle one, and the oldest generation is walked whenever it grew by a quarter: what
   was read so far, again and again as it grows. So `building()` pauses the collector
   for them: `runtime.refresh.config_file` reads every config under it (`serve`,
   `check-config`, the demo; the refresh worker keeps its collector off anyway), and
   `serve` builds the Edge under it up to and including `settle()` (Rule 1), whose
   collection is then the only one of what startup built. A config of 10,000 Nodes read
   and the Edge built from it: 7.3 s of CPU with the collector on, 3.3 s paused. Once the
   collector is on again, the next allocation brings a young collection of what the
   pause made, unless a collection ran inside it. Paused is the collector's state for
   the whole process, so `building()` is for a thread that has the process to itself
   meanwhile: startup, a command-line tool.

This module holds the rules, their numbers and what needs no event loop (`building`,
`settle`); the Edge's task that applies Rules 2-5 is `heap_keeper.HeapKeeper`. So a
process that only reads configs (the refresh worker) does not import Trio: 6 of the
30 MiB it would hold, and half the CPU of its start.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final, Protocol

__all__ = [
    "BURST",
    "LEAKS_FOR_THAW",
    "LEAK_GRACE_S",
    "QUIET_S",
    "RECENT",
    "SWEEP_FLEET",
    "SWEEP_MIN_S",
    "SWEEP_S",
    "SWEEP_STEP_S",
    "THRESHOLDS",
    "Collector",
    "HeapStatistics",
    "building",
    "settle",
    "sweep_period",
]

#: `gc.set_threshold` for the Edge process (CPython's defaults: 700, 10, 10).
THRESHOLDS: Final = (10_000, 20, 10)
#: Node connects that bring a freeze (Rule 2).
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
#: How long an ended session may stay alive before it counts as leaked (Rule 4).
LEAK_GRACE_S: Final = 30.0
#: Leaked sessions since the last thaw that bring one (Rule 4).
LEAKS_FOR_THAW: Final = 64
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


@dataclass(frozen=True, slots=True)
class HeapStatistics:
    """What the keeper saw (Rule 4), for the Edge's metrics."""

    sessions_leaked: int
    """Ended sessions still alive `LEAK_GRACE_S` later, since the Edge started."""
    thaws: int
    """Full collections the keeper ran (each after `LEAKS_FOR_THAW` leaks)."""


@contextmanager
def building() -> Iterator[None]:
    """Rule 6: the collector paused for the body, as it was after it. Nested, or in a
    process that keeps it off, it changes nothing."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def settle() -> None:
    """Rule 1: call once the Edge is built, before it serves."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
