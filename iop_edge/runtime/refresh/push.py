"""Pushing a refresh to a fleet, and catching up the Nodes that missed it (design §5).

An apply pushes each affected connected Node its own config and waits for the Node's
`refresh_ack`. With thousands of Nodes that is thousands of messages out and acks in, on
the Edge's one event loop, so:

1. At most `PushPolicy.fanout` pushes are in flight at once (sent and not answered),
   and they start at most `rate_per_s` a second, evenly spaced (those whose turns fall
   within `TURN_GRAIN_S` together): a Node's ack wait starts when its push is sent, not
   when the refresh began, and the fleet's acks and status reports, each work for the
   event loop (and, on the Nodes' side, a registry rebuilt), come as a steady stream
   the loop serves between callers' requests rather than as bursts a fan-out's worth
   deep. The fan-out keeps a fleet across slow links busy; the rate keeps a fleet on
   fast ones from taking the loop (and the machine) from callers. No task waits for an
   ack: the Node's session tells the push (`AckListener`), and one timer fails the
   late ones, so a Node costs the loop its frame out and its ack in, and a handful of
   senders (`PUSH_SENDERS`) keep a Node whose outbox is full from holding up any push
   but those handed out with it.
2. A Node has `timeout_s` to ack once its push is sent; the whole push has
   `deadline_s(nodes)`: `timeout_s` plus, for each Node pushed, `per_node_s` or the
   rate's spacing, whichever is longer, since the pushes queue behind the fan-out and
   the rate. A Node that misses either is reported `failed`, saying it was not acked
   in time and that the Edge pushes again.
3. A connected Node that did not apply the new revision (no ack in time, a refused
   config, a broken push) is never left behind silently: besides the report, the
   `CatchUp` pushes it the running config again, after `first_retry_s` and then at
   doubling intervals up to `max_retry_s`, until it acks the running revision or its
   session ends (a Node that links again is welcomed with the running config).
4. A Node that is not connected, or whose session ends during the push, is reported
   `not_connected`: its next `welcome` carries the running config.

The catch-up keeps one timer for every Node it waits on (the earliest retry), not one
per Node: a fleet that missed a refresh costs one task.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol

import msgspec
import trio

from iop_edge.core.snapshot import Snapshot
from schemas.config import NodeConfig
from schemas.refresh import NodeResult
from schemas.wire import RefreshAck

__all__ = ["RETRY_NOTE", "AckListener", "CatchUp", "PushPolicy", "PushTarget", "push_all"]

log = logging.getLogger(__name__)

#: Pushes in flight at once (Rule 1).
PUSH_FANOUT: Final = 64
#: What each pushed Node adds to the whole push's deadline (Rule 2): about the Edge's
#: own cost of one push and its ack, with room for a busy machine.
PUSH_BUDGET_PER_NODE_S: Final = 0.002
#: Pushes started a second at most (Rule 1): ten thousand Nodes in ten seconds. Twice the
#: rate keeps a small Edge's event loop four-fifths busy with the fleet's acks and status
#: reports, and callers' requests wait in line with them.
PUSH_RATE_PER_S: Final = 1000.0


@dataclass(frozen=True, slots=True)
class PushPolicy:
    """How a refresh reaches the fleet (module Rules 1-3)."""

    timeout_s: float = 10.0
    """A Node's time to ack once its push is sent."""
    per_node_s: float = PUSH_BUDGET_PER_NODE_S
    fanout: int = PUSH_FANOUT
    rate_per_s: float = PUSH_RATE_PER_S
    first_retry_s: float = 2.0
    max_retry_s: float = 60.0

    def __post_init__(self) -> None:
        if self.fanout < 1:
            raise ValueError("the push fan-out must be >= 1")
        if not self.rate_per_s > 0:
            raise ValueError("the push rate must be > 0")

    def deadline_s(self, nodes: int) -> float:
        """The whole push's deadline for `nodes` Nodes (Rule 2)."""
        return self.timeout_s + max(self.per_node_s, 1 / self.rate_per_s) * nodes


class AckListener(Protocol):
    """Told a pushed Node's answer, once: its ack, or None when the Node is not connected
    or its session ends first. Called from the session's reader: it never waits."""

    def __call__(self, ack: RefreshAck | None, /) -> None: ...


class PushTarget(Protocol):
    """What pushing needs from the Edge (a part of the Refresher's `RefreshTarget`)."""

    @property
    def snapshot(self) -> Snapshot: ...

    def connected_nodes(self) -> frozenset[str]: ...

    def applied_revisions(self) -> Mapping[str, int]: ...

    async def push_node_config(
        self, node_id: str, revision: int, node_config: NodeConfig, answer: AckListener
    ) -> None:
        """Send `node_config` to the Node; `answer` is told its ack later (or now). Not a
        checkpoint when the frame goes out at once; waits while the Node's outbox is
        full."""
        ...


#: How a refresh report tells that the Edge pushes again to a Node that did not apply.
RETRY_NOTE: Final = "the Edge pushes the config again until the node applies it"
#: Tasks handing out the pushes (Rule 1): one suffices while every Node takes its frame at
#: once; more keep a Node whose outbox is full from holding up any push but those of its
#: own turn.
PUSH_SENDERS: Final = 4
#: Turns handed out at once (Rule 1): the Nodes whose turns fall within this are pushed
#: together, one wake-up of the loop for several pushes.
TURN_GRAIN_S: Final = 0.008


def _late(node_id: str, within_s: float) -> NodeResult:
    return NodeResult(id=node_id, status="failed", detail=f"no refresh_ack within {within_s:g}s")


async def push_all(
    target: PushTarget, node_ids: Iterable[str], snapshot: Snapshot, policy: PushPolicy
) -> list[NodeResult]:
    """Push `snapshot`'s config to every connected Node of `node_ids` (Rules 1, 2, 4);
    one result per Node, in the order given. The caller bounds nothing: the deadline is
    the policy's."""
    ids = list(node_ids)
    connected = target.connected_nodes()
    pushed = [node_id for node_id in ids if node_id in connected]
    deadline_s = policy.deadline_s(len(pushed))
    push = _Push(target, snapshot, policy, pushed)
    with trio.move_on_after(deadline_s):
        await push.run()
    await trio.lowlevel.checkpoint()  # a fleet's results are collected in a step of their own
    results = push.results
    return [
        results.get(node_id)
        or (
            _late(node_id, deadline_s)
            if node_id in connected
            else NodeResult(id=node_id, status="not_connected")
        )
        for node_id in ids
    ]


class _Push:
    """One push to a fleet (Rules 1 and 2). Senders hand the Nodes out at their turns
    and send each its config; no task waits for an ack: each comes back through the
    Node's session (`_listener`), and one timer fails the Nodes whose ack is late
    (`_expire`). A Node thus costs the loop its send and its ack, not a task's wake-ups."""

    def __init__(
        self, target: PushTarget, snapshot: Snapshot, policy: PushPolicy, node_ids: list[str]
    ) -> None:
        self.results: dict[str, NodeResult] = {}
        self._target = target
        self._snapshot = snapshot
        self._timeout_s = policy.timeout_s
        self._turns = _Turns(node_ids, policy.rate_per_s)
        self._room = trio.Semaphore(policy.fanout)
        """A push in flight holds one until its Node answers or is late."""
        self._awaiting: set[str] = set()
        self._deadlines: deque[tuple[float, str]] = deque()
        """When each sent push is late, in the order sent (one timeout for all)."""
        self._unsettled = len(node_ids)
        self._settled = trio.Event()

    async def run(self) -> None:
        """Push to every Node; returns once each has a result."""
        if not self._unsettled:
            return
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(min(PUSH_SENDERS, self._unsettled)):
                    nursery.start_soon(self._send)
                nursery.start_soon(self._expire)
        finally:
            self._awaiting.clear()  # an answer after the push's deadline is not counted

    async def _send(self) -> None:
        revision, snapshot = self._snapshot.revision, self._snapshot
        while True:
            # The room first, then the turn: a turn is not taken while there is no room
            # for it, so no turns pile up to go in a burst when room comes.
            try:
                self._room.acquire_nowait()
            except trio.WouldBlock:
                await self._room.acquire()
            batch, turn = self._turns.take(1 + self._room.value)
            if not batch:
                self._room.release()
                return
            for _ in batch[1:]:
                self._room.acquire_nowait()  # there was room for them: nothing awaited
            if turn > trio.current_time():
                await trio.sleep_until(turn)
            for node_id in batch:
                await self._push(node_id, revision, snapshot.node_config(node_id))

    async def _push(self, node_id: str, revision: int, node_config: NodeConfig) -> None:
        self._awaiting.add(node_id)
        try:
            await self._target.push_node_config(
                node_id, revision, node_config, self._listener(node_id)
            )
        except Exception as exc:
            # The snapshot is already swapped: one node's broken push must not cost the
            # operator the report on every other node.
            log.exception("refresh push to node %s failed", node_id)
            failed = f"push failed: {type(exc).__name__}"
            self._settle(node_id, NodeResult(id=node_id, status="failed", detail=failed))
            return
        if node_id in self._awaiting:  # not answered yet: its time starts now
            self._deadlines.append((trio.current_time() + self._timeout_s, node_id))

    def _listener(self, node_id: str) -> AckListener:
        revision = self._snapshot.revision

        def answered(ack: RefreshAck | None) -> None:
            if node_id in self._awaiting:  # else late, or answered once already
                self._settle(node_id, _push_result(node_id, revision, ack))

        return answered

    def _settle(self, node_id: str, result: NodeResult) -> None:
        self._awaiting.discard(node_id)
        self.results[node_id] = result
        self._room.release()
        self._unsettled -= 1
        if not self._unsettled:
            self._settled.set()

    async def _expire(self) -> None:
        """Fail each Node not answered `timeout_s` after its push was sent (Rule 2). It
        wakes when the oldest push still waiting is late, not once a push."""
        deadlines = self._deadlines
        while not self._settled.is_set():
            while deadlines and deadlines[0][1] not in self._awaiting:
                deadlines.popleft()  # answered
            # a push sent from now on is late `timeout_s` from now at the earliest
            wake = deadlines[0][0] if deadlines else trio.current_time() + self._timeout_s
            with trio.move_on_at(wake):
                await self._settled.wait()
            now = trio.current_time()
            while deadlines and deadlines[0][0] <= now:
                _, node_id = deadlines.popleft()
                if node_id in self._awaiting:
                    self._settle(node_id, _late(node_id, self._timeout_s))


class _Turns:
    """The Nodes still to push and their turns: `rate` a second, evenly spaced, those
    whose turns fall within `TURN_GRAIN_S` together (Rule 1). The first turn is now; a
    turn taken late (no room for it came sooner) is not made up in a burst, and one
    whose time has come already (a busy loop woke its sender late) needs no wait."""

    def __init__(self, node_ids: Iterable[str], rate: float) -> None:
        self._queue = deque(node_ids)
        self._spacing = 1 / rate
        self._together = max(1, int(TURN_GRAIN_S * rate))
        self._next = trio.current_time()

    def take(self, most: int) -> tuple[list[str], float]:
        """The next Nodes to push, at most `most`, and when: empty when every Node was
        handed out."""
        queue = self._queue
        batch = [queue.popleft() for _ in range(min(self._together, most, len(queue)))]
        turn = max(self._next, trio.current_time())
        if batch:
            self._next = turn + len(batch) * self._spacing
        return batch, turn


def _push_result(node_id: str, revision: int, ack: RefreshAck | None) -> NodeResult:
    if ack is None:
        return NodeResult(id=node_id, status="not_connected", detail="disconnected during the push")
    if ack.revision != revision:
        return NodeResult(
            id=node_id,
            status="failed",
            revision=ack.revision,
            detail=f"acked revision {ack.revision}, expected {revision}",
        )
    if not ack.ok:
        return NodeResult(
            id=node_id,
            status="failed",
            revision=ack.revision,
            detail=ack.error or "the node refused the new config",
        )
    return NodeResult(id=node_id, status="applied", revision=ack.revision)


@dataclass(frozen=True, slots=True)
class CatchUpStatistics:
    waiting: int
    """Nodes the catch-up will push the running config to again."""


class CatchUp:
    """Pushes the running config again to connected Nodes that missed a refresh (Rule 3).

    `behind()` schedules Nodes; `run()` (a service the Edge's nursery owns) pushes to
    each when its retry is due, with doubling intervals, until it acks the running
    revision or is gone. One refresh's own push takes its Nodes out (`forget`) first, so
    a Node never gets two pushes of the same revision at once."""

    def __init__(self, target: PushTarget, policy: PushPolicy) -> None:
        self._target = target
        self._policy = policy
        self._due: dict[str, float] = {}
        self._interval: dict[str, float] = {}
        self._timers: list[tuple[float, str]] = []
        self._scheduled = trio.Event()

    def statistics(self) -> CatchUpStatistics:
        return CatchUpStatistics(waiting=len(self._due))

    def waiting(self) -> frozenset[str]:
        """The Nodes waiting for a retry."""
        return frozenset(self._due)

    def behind(self, node_ids: Iterable[str]) -> None:
        """These connected Nodes did not apply the running revision: push again."""
        now, interval = trio.current_time(), self._policy.first_retry_s
        for node_id in node_ids:
            self._schedule(node_id, now + interval, interval)

    def take_failures(self, results: list[NodeResult]) -> list[NodeResult]:
        """A refresh's push results, the `failed` Nodes scheduled for a retry (`behind`)
        and their detail saying so."""
        failed = [result.id for result in results if result.status == "failed"]
        self.behind(failed)
        return [
            msgspec.structs.replace(result, detail=f"{result.detail}; {RETRY_NOTE}")
            if result.status == "failed"
            else result
            for result in results
        ]

    def forget(self, node_ids: Iterable[str]) -> None:
        """No retry for these Nodes (a refresh pushes to them right now)."""
        if not self._due:  # nothing waits: a fleet's pushes need no pass
            return
        for node_id in node_ids:
            self._due.pop(node_id, None)
            self._interval.pop(node_id, None)

    def _schedule(self, node_id: str, due: float, interval: float) -> None:
        self._due[node_id] = due
        self._interval[node_id] = interval
        heapq.heappush(self._timers, (due, node_id))
        self._scheduled.set()
        self._scheduled = trio.Event()

    def _take_due(self, now: float) -> list[str]:
        """Pop the Nodes whose retry is due (stale timers are dropped on the way)."""
        due: list[str] = []
        while self._timers and self._timers[0][0] <= now:
            at, node_id = heapq.heappop(self._timers)
            if self._due.get(node_id) == at:
                del self._due[node_id]
                due.append(node_id)
        return due

    async def _wait_for_due(self) -> None:
        while True:
            while self._timers and self._due.get(self._timers[0][1]) != self._timers[0][0]:
                heapq.heappop(self._timers)  # a forgotten or rescheduled Node
            scheduled = self._scheduled
            if not self._timers:
                await scheduled.wait()
                continue
            with trio.move_on_at(self._timers[0][0]):
                await scheduled.wait()  # an earlier retry was scheduled: look again
                continue
            return

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Retry the due Nodes, forever (Rule 3)."""
        task_status.started()
        while True:
            await self._wait_for_due()
            await self._retry(self._take_due(trio.current_time()))

    async def _retry(self, node_ids: list[str]) -> None:
        snapshot = self._target.snapshot
        connected = self._target.connected_nodes()
        applied = self._target.applied_revisions()
        stale = [
            node_id
            for node_id in node_ids
            if node_id in connected and applied.get(node_id, 0) < snapshot.revision
        ]
        for node_id in node_ids:
            if node_id not in stale:
                self._interval.pop(node_id, None)  # gone (welcomed anew) or caught up
        results = await push_all(self._target, stale, snapshot, self._policy)
        now = trio.current_time()
        for result in results:
            interval = self._interval.pop(result.id, self._policy.first_retry_s)
            if result.status == "applied":
                log.info("node %s caught up with config revision %d", result.id, result.revision)
            elif result.status == "failed" and result.id not in self._due:
                longer = min(interval * 2, self._policy.max_retry_s)
                log.warning(
                    "node %s still runs an older config (%s); pushing again in %gs",
                    result.id,
                    result.detail,
                    longer,
                )
                self._schedule(result.id, now + longer, longer)
