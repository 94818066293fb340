"""Bulk work beside the event loop: a worker thread that hands the GIL back often.

Reading and planning a fleet's config is seconds of pure Python. In a worker thread it
no longer holds the event loop, but it still holds the GIL, and CPython hands the GIL to
a waiting thread only every `sys.getswitchinterval()` (5 ms by default). The event loop
gives the GIL up at every socket call and every wait for I/O, and a caller's request
makes a dozen of them: each one could cost up to an interval, tens of milliseconds a
request. While such work runs, the interval is shortened to `SWITCH_INTERVAL_S`: the
loop waits at most that long for the GIL, the worker loses a little to the extra
switches, and the interval is restored when the work ends.

Only the event loop's thread calls `run_sync`, so the interval is set and restored by one
thread; runs that overlap keep the short interval until the last one ends.

Small work stays on the loop (`run_sync_if`): a thread costs more than a small report.
A refresh report is large (`large_report`) past `LARGE_REPORT_ITEMS` paths and Nodes: a
fleet's is tens of thousands, tens of milliseconds to build or encode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Final, TypeVar

import trio

from schemas.refresh import RefreshReport

__all__ = ["LARGE_REPORT_ITEMS", "SWITCH_INTERVAL_S", "large_report", "run_sync", "run_sync_if"]

#: The GIL switch interval while bulk work runs in a worker thread.
SWITCH_INTERVAL_S: Final = 0.0005
#: Paths and Nodes in a refresh report beyond which work on it goes to a worker thread.
LARGE_REPORT_ITEMS: Final = 2000

T = TypeVar("T")


class _Interval:
    """The open runs and the interval to restore when the last one ends."""

    running = 0
    saved = 0.0


async def run_sync(work: Callable[[], T]) -> T:
    """`work()` in a worker thread, the GIL switch interval short meanwhile."""
    if _Interval.running == 0:
        _Interval.saved = sys.getswitchinterval()
        sys.setswitchinterval(min(SWITCH_INTERVAL_S, _Interval.saved))
    _Interval.running += 1
    try:
        return await trio.to_thread.run_sync(work)
    finally:
        _Interval.running -= 1
        if _Interval.running == 0:
            sys.setswitchinterval(_Interval.saved)


async def run_sync_if(large: bool, work: Callable[[], T]) -> T:
    """`work()` in a worker thread (`run_sync`) when `large`, else here."""
    return await run_sync(work) if large else work()


def large_report(report: RefreshReport) -> bool:
    """Whether work on `report` goes to a worker thread (module docstring)."""
    return len(report.changes) + len(report.nodes) > LARGE_REPORT_ITEMS
