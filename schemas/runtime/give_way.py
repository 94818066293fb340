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
5. The same holds for the last reference to any large graph (a fleet's config: 20 ms in
   one step): `free_graph_in_pieces` takes over the references, holds each part that
   only its parent holds, then lets go of parents before children, a piece at a time,
   so each deallocation frees one object and no cascade. A part something else holds
   too is left alone (it outlives the graph, or another holder frees it).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

__all__ = [
    "MAX_WAIT_S",
    "RELEASE_ITEMS",
    "Gate",
    "free_graph_in_pieces",
    "free_in_pieces",
    "give_way",
]

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


#: `sys.getrefcount` of a root that only the list held, once taken from it (the local
#: name and the call's own argument), and of a part that only its parent holds while the
#: walk looks at it (the parent, the list of its parts, the loop variable and the
#: argument). A count says only what is worth holding: holding a part that something
#: else holds too costs a walk, never a wrong free.
_ROOT_HELD_BY_LIST_ONLY: Final = 2
_HELD_BY_PARENT_ONLY: Final = 4


def free_graph_in_pieces(roots: list[Any]) -> None:
    """Let go of `roots` (the list is taken over and emptied; its items should be the last
    references to their graphs) without one long deallocation (Rule 5).

    The graph is walked from the roots, parents before children, through containers,
    msgspec Structs and dataclasses, holding every part that only its parent holds. The
    walk then lets go of parents first, `RELEASE_ITEMS` at a time: a parent's
    deallocation only drops its hold on parts the walk still holds, so each piece frees
    its own objects and nothing below them. A part that others held too during the walk
    is held aside and let go of last, one at a time: if only the graph held it after all
    (two of its parents), it is walked the same way first."""
    own: list[Any] = []
    shared: list[Any] = []
    for _ in range(len(roots)):
        root = roots.pop()
        (own if sys.getrefcount(root) <= _ROOT_HELD_BY_LIST_ONLY else shared).append(root)
        del root
    _free_own(own, shared)
    while shared:
        if len(shared) % RELEASE_ITEMS == 0:
            give_way()
        part = shared.pop()
        if sys.getrefcount(part) <= _ROOT_HELD_BY_LIST_ONLY:  # the graph held it after all
            own.append(part)
            del part
            _free_own(own, shared)
        else:
            del part


def _free_own(own: list[Any], shared: list[Any]) -> None:
    """Walk and free `own`, whose items only it holds; parts others hold go to `shared`."""
    _walk(own, shared)  # its names are gone when it returns: nothing but `own` holds
    own.reverse()  # parents last: `free_in_pieces` takes them first
    free_in_pieces(own)


def _walk(own: list[Any], shared: list[Any]) -> None:
    looked = walked = 0
    while walked < len(own):  # `own` grows as it goes: parts after their parents
        for part in _parts(own[walked]):
            looked += 1
            if looked % _WALK_PARTS == 0:
                give_way()
            walkable = _WALKABLE.get(type(part))
            if walkable or (walkable is None and _walkable(type(part))):
                (own if sys.getrefcount(part) <= _HELD_BY_PARENT_ONLY else shared).append(part)
        walked += 1


#: Whether a value of a type has parts to walk, by type (Rule 5).
_WALKABLE: Final[dict[type, bool]] = {}
#: Parts looked at between two `give_way()` calls while walking a graph.
_WALK_PARTS: Final = 256


def _walkable(kind: type) -> bool:
    walkable = (
        issubclass(kind, (dict, list, tuple, set, frozenset))
        or hasattr(kind, "__struct_fields__")
        or dataclasses.is_dataclass(kind)
    )
    _WALKABLE[kind] = walkable
    return walkable


def _parts(value: Any) -> list[Any]:
    """What `value` holds (a new list: the walk holds them while it looks)."""
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    fields: tuple[str, ...] | None = getattr(type(value), "__struct_fields__", None)
    if fields is not None:  # a msgspec Struct
        return [getattr(value, name, None) for name in fields]
    return [getattr(value, field.name, None) for field in dataclasses.fields(value)]
