"""`core.gc_pause`: a hold freezes the live heap, never the garbage waiting for the
collector.

A frozen object is out of the cyclic collector's sight until the heap keeper thaws the
heap; garbage frozen with the live heap stays in memory as long. The Edge's thresholds
let cyclic garbage wait for tens of thousands of allocations, so a hold that froze it
(every refresh opens one) kept megabytes of finished requests each time.

The collector is real here: each test disables its automatic runs, so what is garbage
when the hold opens is decided by the test alone, and gives the process its heap back
unfrozen.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from iop_edge.core.gc_pause import freezes, gc_held


@pytest.fixture
def manual_collector() -> Iterator[None]:
    """No automatic collection during the test; the collector's state restored after."""
    enabled, thresholds = gc.isenabled(), gc.get_threshold()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        if enabled:
            gc.enable()


class Cycle:
    """An object that references itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.itself = self


def finished_request() -> weakref.ref[Cycle]:
    """Cyclic garbage, as a finished request leaves it (a task and its exception, a
    stream and its cancel scope): nothing refers to it, reference counting cannot free
    it."""
    return weakref.ref(Cycle())


def watched(obj: object) -> bool:
    """Whether the collector walks `obj` (frozen objects are not in its generations)."""
    return any(candidate is obj for candidate in gc.get_objects())


def test_a_hold_does_not_freeze_the_garbage_waiting_for_the_collector(
    manual_collector: None,
) -> None:
    garbage = finished_request()
    assert garbage() is not None  # waiting for a collection
    with gc_held():
        pass
    gc.collect()
    assert garbage() is None


def test_a_hold_freezes_what_is_alive(manual_collector: None) -> None:
    alive = Cycle()
    before = freezes()
    with gc_held():
        pass
    assert freezes() > before
    assert not watched(alive)  # frozen: still alive, out of the collector's sight
    assert alive.itself is alive
