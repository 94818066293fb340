"""The real cyclic collector, driven by the test alone (the heap keeper), or settled as the
Edge keeps it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from iop_edge.runtime.lifecycle import heap


@pytest.fixture
def manual_collector() -> Iterator[None]:
    """No automatic collection during the test, so what is garbage when the test freezes
    the heap is decided by the test alone; the collector's state restored after (the heap
    unfrozen, the thresholds, enabled)."""
    enabled, thresholds = gc.isenabled(), gc.get_threshold()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        if enabled:
            gc.enable()


class _Cycle:
    """An object that references itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.itself = self


@pytest.fixture
def garbage(manual_collector: None) -> weakref.ref[object]:
    """A weak reference to cyclic garbage waiting for the collector, as a finished request
    leaves it (a task and its exception, a stream and its cancel scope): nothing refers to
    it, and reference counting cannot free it."""
    return weakref.ref(_Cycle())


@pytest.fixture
def settled_heap() -> Iterator[None]:
    """The heap settled as the Edge's once built (`runtime.lifecycle.heap.settle`:
    collected, frozen, the Edge's thresholds, as tests/conftest.py keeps them); thawed
    after."""
    heap.settle()
    try:
        yield
    finally:
        gc.unfreeze()
