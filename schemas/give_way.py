"""Long pure work in a worker thread lets an event loop's thread go first.

A worker thread takes pure work (reading a fleet's config, seconds of Python) off an
event loop, but not off the GIL. CPython hands the GIL to a waiting thread only when the
holder has run for a switch interval, and a loop gives the GIL up at every system call
(each send, receive and poll), so while the worker runs, the loop waits about an
interval after each one: a caller's request, a few dozen system calls, is tens of
milliseconds late. Shortening the interval only shrinks each wait.

Here the worker steps aside instead. The code that runs the work (the Edge's
`runtime.refresh.off_loop`) tells a `Gate` when its loop is busy (it has tasks to run)
and when it is idle (it waits for I/O); the work calls `give_way()` often, between
steps of a fraction of a millisecond, and `give_way()` returns at once while the loop
is idle, and otherwise waits, the GIL released, until the loop is idle again. The loop
so runs its steps without waiting for the worker at each system call, and the worker
runs while the loop has nothing to do.

Rules:
1. `give_way()` costs one attribute lookup outside a gated thread: code that calls it
   needs no idea of where it runs.
2. A loop that never idles does not stop the work: after waiting `MAX_WAIT_S` in vain,
   the worker runs as long again before it next steps aside, half of the time at least.
3. A gate belongs to one worker thread at a time (`Gate.entered`), and the thread that
   runs the loop is the only one that opens and closes it.
4. Letting go of a long list at once is one deallocation in C that keeps the GIL until
   it is done, out of reach of any `give_way()`: `free_in_pieces` empties it
   `RELEASE_ITEMS` items at a time, giving way between pieces.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

__all__ = ["MAX_WAIT_S", "RELEASE_ITEMS", "Gate", "free_in_pieces", "give_way"]

#: The longest the work waits for a busy loop before it runs anyway (Rule 2).
MAX_WAIT_S: Final = 0.005
#: Items of a long list freed at once (Rule 4): an item of a fleet's config list is a few
#: dozen objects, so a piece is a fraction of a millisecond of deallocation.
RELEASE_ITEMS: Final = 32


class Gate:
    """Open while the loop waits for I/O, closed while it has tasks to run."""

    __slots__ = ("_clock", "_idle", "_run_until")

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._idle = threading.Event()
        self._idle.set()
        self._run_until = 0.0
        """After a wait in vain: when the work next steps aside (Rule 2)."""

    def loop_idle(self) -> None:
        """The loop is about to wait for I/O: the work may run."""
        self._idle.set()

    def loop_busy(self) -> None:
        """The loop has tasks to run: the work steps aside at its next `give_way()`."""
        self._idle.clear()

    @property
    def open(self) -> bool:
        """Whether the work may run now (the loop idles)."""
        return self._idle.is_set()

    @contextmanager
    def entered(self) -> Iterator[None]:
        """`give_way()` in the current thread answers to this gate meanwhile."""
        _thread.gate = self
        try:
            yield
        finally:
            _thread.gate = None

    def _pass(self) -> None:
        if self._idle.is_set() or self._clock() < self._run_until:
            return
        if not self._idle.wait(MAX_WAIT_S):
            self._run_until = self._clock() + MAX_WAIT_S


class _Thread(threading.local):
    gate: Gate | None = None


_thread: Final = _Thread()


def give_way() -> None:
    """Wait, bounded, while the event loop this thread runs beside is busy; return at
    once while it is idle, or outside a gated thread (Rule 1)."""
    gate = _thread.gate
    if gate is not None:
        gate._pass()


def free_in_pieces(items: list[Any]) -> None:
    """Empty `items` from the end, `RELEASE_ITEMS` at a time, giving way between pieces
    (Rule 4)."""
    while items:
        give_way()
        del items[-RELEASE_ITEMS:]
