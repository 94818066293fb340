"""The Edge's heap keeper: the task that applies `heap` Rules 2-5 on the event loop.

It freezes the heap after connect bursts and, for a large fleet, periodically; thaws it
only on evidence of leaked sessions; and holds it for a bulk operation such as a
refresh's apply. The rules, and why, are `heap`'s.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final

import trio

from iop_edge.runtime.lifecycle.heap import (
    BURST,
    HELD_THRESHOLD,
    LEAK_GRACE_S,
    LEAKS_FOR_THAW,
    QUIET_S,
    RECENT,
    SWEEP_FLEET,
    SWEEP_MIN_S,
    SWEEP_S,
    THRESHOLDS,
    Collector,
    HeapStatistics,
    sweep_period,
)

__all__ = ["HeapKeeper"]

log = logging.getLogger(__name__)

#: Leaked sessions a warning names (the rest are counted).
_NAMED: Final = 5


class _Gc:
    def freeze(self) -> None:
        gc.freeze()

    def unfreeze(self) -> None:
        gc.unfreeze()

    def collect(self, generation: int = 2) -> int:
        return gc.collect(generation)

    def get_threshold(self) -> tuple[int, int, int]:
        return gc.get_threshold()

    def set_threshold(self, young: int, middle: int, old: int) -> None:
        gc.set_threshold(young, middle, old)


class HeapKeeper:
    """Freezes the heap after connect bursts and, for a large fleet, every second; thaws
    it only once ended sessions leaked (Rules 2-4); holds it for a bulk operation (Rule 5).

    The hub reports connects, disconnects and every session's end (`node_connected`,
    `node_disconnected`, `session_ended`); `run` is a service of the Edge that acts on
    them."""

    def __init__(
        self,
        collector: Collector | None = None,
        *,
        timer: Callable[[], float] = time.thread_time,
    ) -> None:
        """`timer` measures what a sweep cost the loop's thread (Rule 3): its CPU time,
        so a machine that preempts the Edge does not make the sweeps come faster."""
        self._gc = collector or _Gc()
        self._timer = timer
        self._connected = 0
        self._arrived = 0
        """Nodes connected since the last freeze."""
        self._last_arrival = -float("inf")
        self._ending: dict[int, tuple[str, float]] = {}
        """Ended sessions not freed yet: their names and when they ended (Rule 4). Each
        one's finalizer takes it out."""
        self._keys = itertools.count()
        self._leaked: list[int] = []
        """Keys in `_ending` past `LEAK_GRACE_S` since the last thaw."""
        self._leaked_total = 0
        self._thaws = 0
        self._changed = trio.Event()
        self._holds = 0
        """Open `held()` bodies (Rule 5)."""
        self._hold_opened = trio.Event()
        self._thresholds: tuple[int, int, int] = THRESHOLDS

    @contextmanager
    def held(self) -> Iterator[Callable[[], None]]:
        """Keep the heap out of the collector's sight for the body (Rule 5), which gets
        `keep`: what it made so far is alive, frozen without a walk. Re-entrant; on the
        event loop's thread only."""
        if self._holds == 0:
            self._thresholds = self._gc.get_threshold()
            self._gc.collect(RECENT)
            self._gc.freeze()
            self._gc.set_threshold(self._thresholds[0], HELD_THRESHOLD, HELD_THRESHOLD)
            self._hold_opened.set()  # the sweeps start over at their shortest period
            self._hold_opened = trio.Event()
        self._holds += 1
        try:
            yield self._gc.freeze
        finally:
            self._holds -= 1
            if self._holds == 0:
                self._gc.freeze()
                self._gc.set_threshold(*self._thresholds)
                self._wake()  # a thaw that fell due meanwhile (Rule 4)

    def node_connected(self) -> None:
        self._connected += 1
        self._arrived += 1
        self._last_arrival = trio.current_time()
        self._wake()

    def node_disconnected(self) -> None:
        self._connected = max(self._connected - 1, 0)

    def session_ended(self, session: object, name: str) -> None:
        """`session` (a warning calls it `name`) ended: reference counting should free it
        within `LEAK_GRACE_S` (Rule 4)."""
        key = next(self._keys)
        self._ending[key] = (name, trio.current_time())
        weakref.finalize(session, self._ending.pop, key, None)
        self._wake()

    def watching(self) -> int:
        """Ended sessions not freed yet (Rule 4)."""
        return len(self._ending)

    def statistics(self) -> HeapStatistics:
        return HeapStatistics(sessions_leaked=self._leaked_total, thaws=self._thaws)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _count_leaks(self, now: float) -> float | None:
        """Count the sessions alive `LEAK_GRACE_S` after they ended (Rule 4); when the
        next one would count, if any."""
        self._leaked = [key for key in self._leaked if key in self._ending]  # freed late
        counted = set(self._leaked)
        nearest: float | None = None
        for key, (_name, ended_at) in list(self._ending.items()):
            if key in counted:
                continue
            due = ended_at + LEAK_GRACE_S
            if due <= now:
                self._leaked.append(key)
                self._leaked_total += 1
            elif nearest is None or due < nearest:
                nearest = due
        return nearest

    def _thaw_due(self) -> bool:
        # Rule 5: it waits for the hold's end
        return not self._holds and len(self._leaked) >= LEAKS_FOR_THAW

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Freeze and thaw as Rules 2-4 say, until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sweep)
            task_status.started()
            await self._watch()

    async def _sweep(self) -> None:
        """Rule 3: a period that follows what a sweep costs, not a wait for a condition."""
        period = SWEEP_S
        while True:
            opened = self._hold_opened
            with trio.move_on_after(period):
                await opened.wait()  # Rule 5: the hold froze the heap; look again soon
                period = SWEEP_MIN_S
                continue
            if self._connected < SWEEP_FLEET:
                period = SWEEP_S
                continue
            began = self._timer()
            self._gc.collect(0)  # the period's young garbage: not frozen (Rule 3)
            self._gc.freeze()
            took = self._timer() - began
            period = SWEEP_MIN_S if self._holds else sweep_period(period, took)  # Rule 5

    async def _watch(self) -> None:
        """Rules 2, 4 and 5, as connects and session ends come and holds end."""
        while True:
            now = trio.current_time()
            deadline = self._count_leaks(now)
            if self._thaw_due():
                self._thaw()
                continue
            if self._arrived:
                quiet_at = self._last_arrival + QUIET_S
                if self._arrived >= BURST or now >= quiet_at:
                    if not self._holds:  # held, the middle generation is the hold's
                        self._gc.collect(RECENT)
                    self._gc.freeze()
                    self._arrived = 0
                    continue
                deadline = quiet_at if deadline is None else min(deadline, quiet_at)
            changed = self._changed
            if deadline is None:
                await changed.wait()
            else:
                with trio.move_on_at(deadline):
                    await changed.wait()

    def _thaw(self) -> None:
        """Rule 4: unfreeze, collect everything once, freeze the survivors; name what
        leaked, and what the collection did not free."""
        leaked, self._leaked = self._leaked, []
        names = [self._ending[key][0] for key in leaked if key in self._ending]
        began = time.perf_counter()
        self._gc.unfreeze()
        reclaimed = self._gc.collect()
        self._gc.freeze()
        took_ms = (time.perf_counter() - began) * 1000
        self._thaws += 1
        self._arrived = 0  # frozen too
        log.warning(
            "heap: %d ended session(s) were still alive %gs after they ended, held by "
            "reference cycles (a defect; %s): a full collection reclaimed %d object(s) in "
            "%.0f ms, callers waiting",
            len(leaked),
            LEAK_GRACE_S,
            _named(names),
            reclaimed,
            took_ms,
        )
        held = [self._ending.pop(key)[0] for key in leaked if key in self._ending]
        if held:
            log.warning(
                "heap: %d leaked session(s) outlived a full collection: held by a live "
                "reference, not a cycle (%s); no longer counted",
                len(held),
                _named(held),
            )


def _named(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMED])
    return f"{shown} and {len(names) - _NAMED} more" if len(names) > _NAMED else shown
