"""Bulk builds without the cyclic garbage collector: a fleet's config is a million objects.

Reading the config of ten thousand Nodes creates about a million Python objects (YAML
nodes, then plain data, then Structs), and none of them is garbage until the build is
done. CPython's cyclic collector does not know that: every few hundred allocations it
runs, and as the live heap grows its full collections walk every object the Edge holds
again (sessions, snapshots, the build so far) - two thirds of the time of composing a
large YAML document went there. Pausing the collector for the build removes that work;
whatever cyclic garbage the rest of the process makes meanwhile is collected when the
collector resumes, seconds later.

Rules:
1. `gc_paused()` is re-entrant and thread-safe: the collector is disabled while at least
   one pause is open (a refresh building in a worker thread and a catalog request on the
   event loop may overlap) and re-enabled when the last one closes.
2. A pause never enables a collector that was disabled before the first pause opened
   (an embedding program's choice stands).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]


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

    def exit(self) -> None:
        with self.lock:
            self.open -= 1
            if self.open == 0 and self.was_enabled:
                gc.enable()


_pauses = _Pauses()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector for the body (Rules 1, 2)."""
    _pauses.enter()
    try:
        yield
    finally:
        _pauses.exit()
