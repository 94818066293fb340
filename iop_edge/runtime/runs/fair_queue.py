"""One model's waiting requests, shared fairly between principals (design §15).

A saturated model's queue is where one caller's batch job would otherwise make everyone
else wait behind it. `FairQueue` keeps one FIFO lane per principal and decides whose
request a freed slot goes to by start-time fair queueing (SFQ), the virtual-time form of
deficit round robin over principals.

Rules:

1. Each waiting principal has a *tag*: the weighted service it has had so far, in
   virtual time. A freed slot goes to the eligible principal with the smallest tag, and
   within a principal to its oldest request (FIFO); equal tags go to the older request.
2. Serving a principal advances its tag by `1 / weight`: with weights 3 and 1, the first
   is served three times for each time of the second while both wait.
3. The queue's virtual time is the tag of the request served last. A principal that
   starts waiting gets `max(its tag, virtual time)`: no credit for the time it did not
   wait (a newcomer is not owed a burst), and no debt either (it does not queue behind
   the backlog of the others: it waits about one service at most).
4. When the queue empties, the virtual time and every tag are forgotten: fairness is
   between requests that wait together, so memory stays bounded by what waits.
5. A principal the caller marks ineligible (at its `max_concurrent`) is passed over in
   that walk, its place kept: its tag does not move while it is not served.
6. With a single principal the order is exactly arrival order (FIFO), so a pool without
   `principals:` behaves as a plain FIFO queue.

The queue knows nothing of slots or providers: the scheduler walks it (`walk`) and says,
for each waiter it is offered, whether it was served (`served`), dropped (`remove`) or
left waiting. The walk reflects those answers as it goes.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar

__all__ = ["FairQueue", "FairWalk", "Queued"]


class Queued(Protocol):
    """What the queue needs of a waiter."""

    @property
    def principal(self) -> str: ...

    @property
    def seq(self) -> int:
        """Arrival order (unique, increasing): FIFO within a lane, ties between lanes."""
        ...


W = TypeVar("W", bound=Queued)


class FairQueue(Generic[W]):
    """Waiters of one model in per-principal FIFO lanes (see the module rules)."""

    __slots__ = ("_lanes", "_size", "_tags", "_vtime")

    def __init__(self) -> None:
        self._lanes: dict[str, deque[W]] = {}
        """Principals with waiters, each with its waiters in arrival order."""
        self._tags: dict[str, float] = {}
        self._vtime = 0.0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[W]:
        """Every waiter, lane by lane (no particular order across lanes)."""
        for lane in self._lanes.values():
            yield from lane

    def __contains__(self, waiter: object) -> bool:
        principal = getattr(waiter, "principal", None)
        lane = self._lanes.get(principal) if isinstance(principal, str) else None
        return lane is not None and waiter in lane

    def waiting(self, principal: str) -> int:
        """How many requests of `principal` wait here."""
        lane = self._lanes.get(principal)
        return len(lane) if lane is not None else 0

    def principals(self) -> Iterator[tuple[str, int]]:
        """Each waiting principal with its number of waiters."""
        for principal, lane in self._lanes.items():
            yield principal, len(lane)

    def tag(self, principal: str) -> float:
        """The principal's weighted service so far (Rule 1), for tests and diagnostics."""
        return self._tags.get(principal, self._vtime)

    def append(self, waiter: W) -> None:
        """Queue `waiter` at the end of its principal's lane (Rule 3)."""
        principal = waiter.principal
        lane = self._lanes.get(principal)
        if lane is None:
            lane = self._lanes[principal] = deque()
            self._tags[principal] = max(self._tags.get(principal, 0.0), self._vtime)
        lane.append(waiter)
        self._size += 1

    def remove(self, waiter: W) -> None:
        """Take `waiter` out (served, refused, timed out, cancelled); absent is a no-op."""
        principal = waiter.principal
        lane = self._lanes.get(principal)
        if lane is None:
            return
        try:
            lane.remove(waiter)
        except ValueError:
            return
        self._size -= 1
        if not lane:
            del self._lanes[principal]
            if self._tags.get(principal, 0.0) <= self._vtime:
                self._tags.pop(principal, None)  # it would restart at vtime anyway
        if not self._size:  # Rule 4
            self._tags.clear()
            self._vtime = 0.0

    def served(self, waiter: W, weight: float) -> None:
        """`waiter` got a slot: out of the queue, its principal charged (Rule 2)."""
        principal = waiter.principal
        start = self._tags.get(principal, self._vtime)
        self._vtime = max(self._vtime, start)
        self._tags[principal] = start + 1.0 / weight
        self.remove(waiter)

    def walk(self, eligible: Callable[[str], bool]) -> FairWalk[W]:
        """The waiters in the order a freed slot should be offered to them (Rules 1, 5)."""
        return FairWalk(self, eligible)


class FairWalk(Generic[W]):
    """One pass over a `FairQueue` in fair order, following the answers given as it goes.

    `peek()` names the waiter to offer a slot to next (None when none is left) and keeps
    naming it until `advance()`; whatever the caller did to that waiter meanwhile through
    the queue (`served`, `remove`, or nothing: it keeps waiting) decides what comes
    next. Each waiter is offered at most once per walk, and never while its principal is
    ineligible (eligibility is asked again at every `peek()`: a grant elsewhere may have
    taken the principal to its limit)."""

    __slots__ = ("_current", "_eligible", "_heap", "_queue")

    def __init__(self, queue: FairQueue[W], eligible: Callable[[str], bool]) -> None:
        self._queue = queue
        self._eligible = eligible
        self._heap: list[tuple[float, int, str, int]] = [
            (queue.tag(principal), lane[0].seq, principal, 0)
            for principal, lane in queue._lanes.items()
        ]
        heapq.heapify(self._heap)
        self._current: tuple[str, int, W] | None = None
        """The lane, position and waiter at the top of the heap, once `peek()` found it."""

    def peek(self) -> W | None:
        heap = self._heap
        lanes = self._queue._lanes
        while heap:
            _tag, _seq, principal, position = heap[0]
            lane = lanes.get(principal)
            if lane is None or position >= len(lane) or not self._eligible(principal):
                heapq.heappop(heap)  # nothing more to offer from this lane in this walk
                self._current = None
                continue
            waiter = lane[position]
            self._current = (principal, position, waiter)
            return waiter
        self._current = None
        return None

    def advance(self) -> None:
        """The waiter `peek()` named has had its answer: move past it (its lane goes back
        in the heap at its new tag, with its next waiter when it was left waiting)."""
        current, self._current = self._current, None
        if current is None:
            return
        principal, position, waiter = current
        queue = self._queue
        lane = queue._lanes.get(principal)
        if lane is not None and position < len(lane) and lane[position] is waiter:
            position += 1  # left waiting: offer the lane's next one (no head-of-line block)
        heapq.heappop(self._heap)
        if lane is not None and position < len(lane):
            entry = (queue.tag(principal), lane[position].seq, principal, position)
            heapq.heappush(self._heap, entry)
