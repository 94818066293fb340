"""Bulk work and CPython's cyclic collector: a fleet's config is a million objects, and a
fleet's Edge holds millions more.

Reading the config of ten thousand Nodes creates about a million Python objects (YAML
nodes, then plain data, then Structs), and none of them is garbage until the build is
done. CPython's cyclic collector does not know that: every few hundred allocations it
runs, and as the live heap grows its full collections walk every object the Edge holds
again (the sessions of every Node, the snapshot, the build so far) - two thirds of the
time of composing a large YAML document went there, and each full collection holds the
GIL, so the event loop waits too.

Rules:
1. `gc_paused()` disables the collector for its body. It is re-entrant and thread-safe:
   the collector is disabled while at least one pause is open (a refresh building in a
   worker thread, a catalog request on the event loop) and re-enabled when the last one
   closes. A pause never enables a collector that was disabled before it opened.
2. `gc_paused(freeze=True)` also freezes (`gc.freeze`) what is alive when it closes,
   before the collector resumes: the build's result, long-lived, is not walked by the
   next collections, nor is anything else alive then. Only inside `gc_held()`, whose end
   puts frozen objects back in the collector's sight.
3. `gc_held()` keeps the live heap out of the collector's sight while a bulk operation
   runs (a refresh: its build, the swap, a push to every Node): when it opens it
   collects the young and middle generations (the recent cyclic garbage of requests, so
   that it is not frozen; a full collection would walk every Node's session) and freezes
   everything alive; while open only young collections run (what the operation and the
   callers' requests allocate, cheap to look at; what survives them waits, unwalked);
   when it closes it freezes what is alive. The heap stays frozen after the hold: frozen
   objects are still freed by reference counting, and the process's heap keeper
   (`runtime.lifecycle.heap`) thaws it now and then to collect the cyclic garbage among
   them (`freezes()` tells it how often something was frozen). Holds are re-entrant;
   only the event loop's thread opens them.
4. While a pause is open (`paused()`), everything the bulk work made so far is young: a
   collection of the young generation would walk all of it, holding the GIL (half a
   second into a fleet's config). Whoever collects on its own schedule (the heap
   keeper) leaves the collector alone meanwhile, and hears when the last hold closes
   (`watch_holds`) to catch up, and when the first one opens.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

__all__ = ["RECENT", "freezes", "gc_held", "gc_paused", "held", "paused", "watch_holds"]

#: The older generations' thresholds while held: no collection of them (Rule 3).
_NEVER: Final = 2**30
#: The oldest generation collected before the heap is frozen (`gc_held` when it opens,
#: Rule 3; the heap keeper's freezes of new sessions): the young and the middle one, where
#: the cyclic garbage of finished requests waits. Frozen with the live heap, it would
#: stay until a thaw.
RECENT: Final = 1


class _Pauses:
    """The open pauses of this process (Rule 1)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = 0
        self.was_enabled = False

    def enter(self) -> None:
        with self.lock:
            if self.open == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.open += 1

    def exit(self, *, freeze: bool) -> None:
        with self.lock:
            if freeze:
                _freeze()
            self.open -= 1
            if self.open == 0 and self.was_enabled:
                gc.enable()


_pauses = _Pauses()


def paused() -> bool:
    """Whether a pause is open: bulk work is building, the collector off (Rule 4)."""
    return _pauses.open > 0


@contextmanager
def gc_paused(*, freeze: bool = False) -> Iterator[None]:
    """Disable the cyclic collector for the body (Rule 1); with `freeze`, freeze what is
    alive at its end (Rule 2: inside `gc_held` only)."""
    _pauses.enter()
    try:
        yield
    finally:
        _pauses.exit(freeze=freeze)


class _Freezes:
    count = 0


def _freeze() -> None:
    gc.freeze()
    _Freezes.count += 1


def freezes() -> int:
    """How many times this module froze the heap (Rules 2, 3), for the heap keeper."""
    return _Freezes.count


class _Holds:
    """The open holds and the thresholds to restore when the last one closes (Rule 3),
    and who hears of it (Rule 4)."""

    open = 0
    thresholds: tuple[int, int, int] = (700, 10, 10)
    watchers: list[Callable[[], None]] = []
    openers: list[Callable[[], None]] = []


def held() -> bool:
    """Whether a hold is open: a bulk operation runs, the heap frozen as it began (Rule 3)."""
    return _Holds.open > 0


@contextmanager
def watch_holds(
    closed: Callable[[], None], opened: Callable[[], None] | None = None
) -> Iterator[None]:
    """Call `closed()` each time the last open hold closes, and `opened()` each time the
    first one opens, while the body runs (Rule 4). Both are called on the event loop's
    thread, right after the heap was frozen."""
    _Holds.watchers.append(closed)
    if opened is not None:
        _Holds.openers.append(opened)
    try:
        yield
    finally:
        _Holds.watchers.remove(closed)
        if opened is not None:
            _Holds.openers.remove(opened)


@contextmanager
def gc_held() -> Iterator[None]:
    """Keep the live heap out of the collector's sight for the body (Rule 3)."""
    first = _Holds.open == 0
    if first:
        _Holds.thresholds = gc.get_threshold()
        gc.collect(RECENT)
        _freeze()
        gc.set_threshold(_Holds.thresholds[0], _NEVER, _NEVER)
    _Holds.open += 1
    if first:
        for opened in list(_Holds.openers):
            opened()
    try:
        yield
    finally:
        _Holds.open -= 1
        if _Holds.open == 0:
            _freeze()
            gc.set_threshold(*_Holds.thresholds)
            for closed in list(_Holds.watchers):
                closed()
