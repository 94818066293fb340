"""Bulk work beside the event loop: a worker thread that steps aside while the loop is busy.

Reading and planning a fleet's config is seconds of pure Python. In a worker thread it
no longer holds the event loop, but it still holds the GIL, and the loop gives the GIL up
at every system call: without more, the loop would wait for the worker after each one,
tens of milliseconds on a caller's request. So `run_sync` gives the work a gate
(`schemas.runtime.give_way`): while the work runs, an instrument of the loop closes the gate when
the loop has tasks to run and opens it when the loop waits for I/O, and the work, which
calls `give_way()` every fraction of a millisecond, waits at a closed gate with the GIL
released. The loop runs first; the work runs while it idles.

What a gate cannot reach (a stretch of the work between two `give_way()` calls, one C
call such as encoding a report) is bounded by the GIL's switch interval instead, which is
shortened to `SWITCH_INTERVAL_S` while the work runs and restored when it ends. A C call
that makes a buffer of megabytes in memory the process has not used yet would also pay
a page fault per page inside it: the work says how much it takes (`fresh_bytes`), and
that much is written first where the GIL is released (`lifecycle.fresh_memory`).

Only the event loop's thread calls `run_sync`, so the interval and the instrument are set
and restored by one thread; runs that overlap share them until the last one ends.

Small work stays on the loop (`run_report_work`): a thread costs more than a small report.
A refresh report is large (`large_items`) past `LARGE_REPORT_ITEMS` paths and Nodes: a
fleet's is tens of thousands, tens of milliseconds to build or encode.

What a refresh leaves behind (the candidate a dry run read, the snapshot an apply
replaced) is let go of the same way (`let_go`): the last reference to a fleet's config,
dropped on the loop, would free it in one step of tens of milliseconds.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any, Final, TypeVar

import trio

from iop_edge.runtime.lifecycle import fresh_memory
from schemas.runtime.give_way import Gate, free_graph_in_pieces

__all__ = [
    "ENCODED_ITEM_BYTES",
    "LARGE_GRAPH_NODES",
    "LARGE_REPORT_ITEMS",
    "SWITCH_INTERVAL_S",
    "large_items",
    "let_go",
    "run_report_work",
    "run_sync",
]

#: The GIL switch interval while bulk work runs in a worker thread.
SWITCH_INTERVAL_S: Final = 0.0002
#: Paths and Nodes in a refresh report beyond which work on it goes to a worker thread.
LARGE_REPORT_ITEMS: Final = 2000
#: About what a path or a Node of a report takes in JSON, with room: a Node's line in a
#: fleet's report is about 70 bytes, a changed path's about 90.
ENCODED_ITEM_BYTES: Final = 128
#: Nodes in a config beyond which letting go of it goes to a worker thread: a thousand
#: Nodes' config takes a few milliseconds to free.
LARGE_GRAPH_NODES: Final = 1000

T = TypeVar("T")


class _LoopActivity(trio.abc.Instrument):
    """Tells the gates of the running work whether the loop is busy (module docstring)."""

    def __init__(self) -> None:
        self.gates: set[Gate] = set()

    def before_io_wait(self, timeout: float) -> None:
        if timeout > 0:  # nothing to run until I/O or a deadline: the loop idles
            for gate in self.gates:
                gate.loop_idle()

    def after_io_wait(self, timeout: float) -> None:
        for gate in self.gates:
            gate.loop_busy()


class _Runs:
    """The open runs, the instrument they share and the interval to restore."""

    activity: _LoopActivity | None = None
    saved_interval = 0.0


async def run_sync(work: Callable[[], T], *, fresh_bytes: int = 0) -> T:
    """`work()` in a worker thread that gives way to this loop (module docstring).
    `fresh_bytes`: what the work takes in large buffers made by single C calls, written
    first with the GIL released (`lifecycle.fresh_memory`)."""
    gate = Gate()

    def gated() -> T:
        with gate.entered():
            fresh_memory.touch(fresh_bytes)
            return work()

    activity = _Runs.activity
    if activity is None:
        _Runs.saved_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(SWITCH_INTERVAL_S, _Runs.saved_interval))
        activity = _Runs.activity = _LoopActivity()
        trio.lowlevel.add_instrument(activity)
    activity.gates.add(gate)
    try:
        return await trio.to_thread.run_sync(gated)
    finally:
        activity.gates.discard(gate)
        if not activity.gates:
            trio.lowlevel.remove_instrument(activity)
            _Runs.activity = None
            sys.setswitchinterval(_Runs.saved_interval)


def large_items(paths: int, nodes: int) -> bool:
    """Whether work on a report of `paths` changed paths and `nodes` Nodes (built or yet to
    be) goes to a worker thread (module docstring)."""
    return paths + nodes > LARGE_REPORT_ITEMS


async def run_report_work(paths: int, nodes: int, work: Callable[[], T]) -> T:
    """`work()`, which builds or encodes a report of `paths` changed paths and `nodes`
    Nodes: in a worker thread when that is large (`large_items`), with twice the JSON such
    a report makes written first (`fresh_bytes`: an encoder's buffer grows by copying);
    else here, where a small report costs less than a thread."""
    if not large_items(paths, nodes):
        return work()
    return await run_sync(work, fresh_bytes=2 * ENCODED_ITEM_BYTES * (paths + nodes))


async def let_go(leftovers: list[Any], *, large: bool) -> None:
    """Free what `leftovers` holds (it should hold the last references) and empty it:
    when `large`, in a worker thread and in pieces
    (`schemas.runtime.give_way.free_graph_in_pieces`),
    else here at once."""
    if large:
        await run_sync(partial(free_graph_in_pieces, leftovers))
    else:
        leftovers.clear()
