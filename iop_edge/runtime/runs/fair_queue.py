"""One model's waiting requests, shared fairly between principals (design §15).

A saturated model's queue is where one caller's batch job would otherwise make everyone
else wait behind it. `FairQueue` keeps one FIFO lane per principal and decides whose
request a freed slot goes to by start-time fair queueing (SFQ), the virtual-time form of
deficit round robin over principals. Service is counted in work, not requests: each
waiter says how much it will take (`Queued.work`, its estimated tokens: `core.routing.run_work`),
so a principal with a few huge requests and one with many small ones share slot time,
not turns.

Rules:

1. Each waiting principal has a *tag*: the weighted service it has had so far, in
   virtual time. A freed slot goes to the eligible principal with the smallest tag, and
   within a principal to its oldest request (FIFO); equal tags go to the older request.
2. Serving a request advances its principal's tag by `work / weight`: with weights 3
   and 1, the first is served three times the work of the second while both wait; at
   equal weights, one 8,000-token request moves a tag as far as eight 1,000-token ones.
3. The queue's virtual time is the tag of the request served last. A principal that
   starts waiting gets `max(its tag, virtual time)`: no credit for the time it did not
   wait (a newcomer is not owed a burst), and no debt either (it does not queue behind
   the backlog of the others: it waits about one request's service at most).
4. When the queue empties, the virtual time and every tag are forgotten: fairness is
   between requests that wait together, so memory stays bounded by what waits.
5. A principal the caller marks ineligible (at its `max_concurrent`) is passed over in
   that walk, its place kept: its tag does not move while it is not served.
6. With a single principal the order is exactly arrival order (FIFO), so a pool without
   `principals:` behaves as a plain FIFO queue.

The queue knows nothing of slots or providers: the scheduler walks it (`walk`) and says,
for each waiter it is offered, whether it was served (`served`), dropped (`remove`) or
left waiting. The walk reflects those answers as it goes.

Cost: the lanes sit in a heap by (tag, oldest waiter) that outlives walks, so a walk
that grants one slot and then finds the next request must wait touches two lanes,
however many principals wait (`O(log P)`); the scheduler ends a walk as soon as every
kind of request waiting has been told to wait (`kinds`).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, KeysView
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

    @property
    def work(self) -> int:
        """The service it will take (estimated tokens; at least 1): Rule 2."""
        ...

    @property
    def kind(self) -> Hashable:
        """What the waiter asks for: waiters of one kind get one answer (they all wait,
        or one is granted), so a walk that found every kind waiting can stop."""
        ...


W = TypeVar("W", bound=Queued)


class FairQueue(Generic[W]):
    """Waiters of one model in per-principal FIFO lanes (see the module rules)."""

    __slots__ = ("_entry", "_heap", "_kinds", "_lanes", "_out", "_size", "_tags", "_vtime")

    def __init__(self) -> None:
        self._lanes: dict[str, deque[W]] = {}
        """Principals with waiters, each with its waiters in arrival order."""
        self._tags: dict[str, float] = {}
        self._vtime = 0.0
        self._size = 0
        self._kinds: dict[Hashable, int] = {}
        """How many waiters of each kind wait here."""
        self._heap: list[tuple[float, int, str]] = []
        """(tag, oldest waiter's seq, principal) per lane; entries that no longer match
        `_entry` are stale and skipped."""
        self._entry: dict[str, tuple[float, int, str]] = {}
        """Each lane's current heap entry."""
        self._out: set[str] = set()
        """Lanes a walk has taken out of the heap; it puts them back when it closes."""

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

    def kinds(self) -> KeysView[Hashable]:
        """The kinds of request waiting here (see `Queued.kind`)."""
        return self._kinds.keys()

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
            self._place(principal)
        else:
            lane.append(waiter)
        self._size += 1
        kind = waiter.kind
        self._kinds[kind] = self._kinds.get(kind, 0) + 1

    def remove(self, waiter: W) -> None:
        """Take `waiter` out (served, refused, timed out, cancelled); absent is a no-op."""
        principal = waiter.principal
        lane = self._lanes.get(principal)
        if lane is None:
            return
        was_oldest = lane[0] is waiter
        try:
            lane.remove(waiter)
        except ValueError:
            return
        self._size -= 1
        kind = waiter.kind
        left = self._kinds[kind] - 1
        if left:
            self._kinds[kind] = left
        else:
            del self._kinds[kind]
        if not lane:
            del self._lanes[principal]
            self._entry.pop(principal, None)
            if self._tags.get(principal, 0.0) <= self._vtime:
                self._tags.pop(principal, None)  # it would restart at vtime anyway
        elif was_oldest:
            self._place(principal)
        if not self._size:  # Rule 4
            self._tags.clear()
            self._vtime = 0.0
            self._heap.clear()
            self._entry.clear()

    def served(self, waiter: W, weight: float) -> None:
        """`waiter` got a slot: out of the queue, its principal charged its work (Rule 2)."""
        principal = waiter.principal
        start = self._tags.get(principal, self._vtime)
        self._vtime = max(self._vtime, start)
        self._tags[principal] = start + waiter.work / weight
        self.remove(waiter)
        if principal in self._lanes:
            self._place(principal)  # its tag moved

    def walk(self, eligible: Callable[[str], bool]) -> FairWalk[W]:
        """The waiters in the order a freed slot should be offered to them (Rules 1, 5).
        Close the walk (`with`) before the queue is walked again."""
        return FairWalk(self, eligible)

    def _place(self, principal: str) -> None:
        """(Re)enter a lane in the heap at its current tag and oldest waiter."""
        if principal in self._out:
            return  # a walk holds it: it puts it back when it closes
        entry = (self._tags[principal], self._lanes[principal][0].seq, principal)
        self._entry[principal] = entry
        heap = self._heap
        heapq.heappush(heap, entry)
        if len(heap) > 2 * len(self._lanes) + 64:  # mostly stale: rebuild
            self._heap = list(self._entry.values())
            heapq.heapify(self._heap)

    def _take_next(self) -> str | None:
        """Take the lane at the top of the heap out of it (for a walk), or None."""
        heap, entries = self._heap, self._entry
        while heap:
            entry = heapq.heappop(heap)
            principal = entry[2]
            if entries.get(principal) == entry:
                del entries[principal]
                self._out.add(principal)
                return principal
        return None

    def _peek_key(self) -> tuple[float, int] | None:
        """(tag, seq) of the lane at the top of the heap, stale entries dropped."""
        heap, entries = self._heap, self._entry
        while heap:
            entry = heap[0]
            if entries.get(entry[2]) == entry:
                return entry[0], entry[1]
            heapq.heappop(heap)
        return None

    def _put_back(self, principals: Iterable[str]) -> None:
        for principal in principals:
            self._out.discard(principal)
            if principal in self._lanes:
                self._place(principal)


class FairWalk(Generic[W]):
    """One pass over a `FairQueue` in fair order, following the answers given as it goes.

    `peek()` names the waiter to offer a slot to next (None when none is left) and keeps
    naming it until `advance()`; whatever the caller did to that waiter meanwhile through
    the queue (`served`, `remove`, or nothing: it keeps waiting) decides what comes
    next. Each waiter is offered at most once per walk, and never while its principal is
    ineligible (eligibility is asked again at every `peek()`: a grant elsewhere may have
    taken the principal to its limit). Lanes the walk visits leave the queue's heap for
    the walk's own and go back when it closes (`close`, or `with`)."""

    __slots__ = ("_current", "_eligible", "_local", "_taken", "queue")

    def __init__(self, queue: FairQueue[W], eligible: Callable[[str], bool]) -> None:
        self.queue = queue
        self._eligible = eligible
        self._local: list[tuple[float, int, str, int]] = []
        """(tag, seq of the next waiter to offer, principal, its position) per visited lane."""
        self._taken: list[str] = []
        self._current: tuple[str, int, W] | None = None
        """The lane, position and waiter at the top of `_local`, once `peek()` found it."""

    def __enter__(self) -> FairWalk[W]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Put the visited lanes back in the queue's heap; the walk is over."""
        taken, self._taken = self._taken, []
        self._local.clear()
        self._current = None
        self.queue._put_back(taken)

    def peek(self) -> W | None:
        queue = self.queue
        local = self._local
        lanes = queue._lanes
        while True:
            top = queue._peek_key()
            if top is not None and (not local or top < (local[0][0], local[0][1])):
                principal = queue._take_next()
                assert principal is not None
                self._taken.append(principal)
                oldest = lanes[principal][0]
                heapq.heappush(local, (queue.tag(principal), oldest.seq, principal, 0))
                continue
            if not local:
                self._current = None
                return None
            _tag, _seq, principal, position = local[0]
            lane = lanes.get(principal)
            if lane is None or position >= len(lane) or not self._eligible(principal):
                heapq.heappop(local)  # nothing more to offer from this lane in this walk
                self._current = None
                continue
            waiter = lane[position]
            self._current = (principal, position, waiter)
            return waiter

    def advance(self) -> None:
        """The waiter `peek()` named has had its answer: move past it (its lane goes back
        in the walk's heap at its new tag, with its next waiter when it was left waiting)."""
        current, self._current = self._current, None
        if current is None:
            return
        principal, position, waiter = current
        queue = self.queue
        lane = queue._lanes.get(principal)
        if lane is not None and position < len(lane) and lane[position] is waiter:
            position += 1  # left waiting: offer the lane's next one (no head-of-line block)
        heapq.heappop(self._local)
        if lane is not None and position < len(lane):
            entry = (queue.tag(principal), lane[position].seq, principal, position)
            heapq.heappush(self._local, entry)
