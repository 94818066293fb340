"""Pushing a refresh to a fleet (`runtime.refresh.push`): bounded fan-out, a deadline that
grows with the Nodes pushed, and the catch-up of the Nodes that missed it. Time is the
autojump clock's."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.refresh.push import AckListener, CatchUp, PushPolicy, _Turns, push_all
from schemas.config import EdgeConfig, NodeConfig, NodeEntry, ProviderConfig
from schemas.refresh import NodeResult
from schemas.wire import RefreshAck


def snapshot(nodes: int, revision: int = 2) -> Snapshot:
    config = EdgeConfig(
        nodes=[
            NodeEntry(
                id=f"n{i}",
                token_hash_sha256="0" * 64,
                providers=[ProviderConfig(id=f"n{i}-p", type="sim", models=["m"], capacity=1)],
            )
            for i in range(nodes)
        ]
    )
    return Snapshot.build(config, revision=revision, config_sha256="0" * 64)


class Fleet:
    """A `PushTarget`: each Node acks after `ack_after_s`, or never (`silent`), or is
    gone (`gone`); it records when each push began and how many were in flight. Its acks
    come from tasks of its own nursery (`acking`), as a Node's come from its session."""

    def __init__(self, current: Snapshot, *, ack_after_s: float = 1.0) -> None:
        self.snapshot = current
        self.connected = set(current.nodes)
        self.applied = dict.fromkeys(current.nodes, current.revision - 1)
        self.ack_after_s = ack_after_s
        self.silent: set[str] = set()
        self.ack_after: dict[str, float] = {}
        """A Node's own time to ack, where it is not `ack_after_s`."""
        self.pushes: list[tuple[str, float]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.blocked: set[str] = set()
        """Nodes whose outbox is full: their push waits until `unblocked` is set."""
        self.unblocked = trio.Event()

    @asynccontextmanager
    async def acking(self) -> AsyncIterator[None]:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            yield
            nursery.cancel_scope.cancel()

    def _change(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Return once `condition()` holds, looking again after each push and each ack."""
        while not condition():
            await self._changed.wait()

    def connected_nodes(self) -> frozenset[str]:
        return frozenset(self.connected)

    def applied_revisions(self) -> Mapping[str, int]:
        return self.applied

    async def push_node_config(
        self, node_id: str, revision: int, node_config: NodeConfig, answer: AckListener
    ) -> None:
        if node_id not in self.connected:
            answer(None)
            return
        if node_id in self.blocked:
            await self.unblocked.wait()
        self.pushes.append((node_id, trio.current_time()))
        self._change()
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        if node_id not in self.silent:
            assert self._nursery is not None, "push within `acking()`"
            self._nursery.start_soon(self._ack, node_id, revision, answer)

    async def _ack(self, node_id: str, revision: int, answer: AckListener) -> None:
        await trio.sleep(self.ack_after.get(node_id, self.ack_after_s))
        self.in_flight -= 1
        self.applied[node_id] = revision
        answer(RefreshAck(revision=revision, ok=True))
        self._change()


async def push(fleet: Fleet, current: Snapshot, policy: PushPolicy) -> list[NodeResult]:
    async with fleet.acking():
        results = await push_all(fleet, sorted(current.nodes), current, policy)
    return results


async def test_pushes_stay_within_the_fan_out_and_the_deadline_grows_with_the_fleet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    current = snapshot(12)
    fleet = Fleet(current, ack_after_s=4.0)
    # Each Node acks within its own 5 s, but 12 Nodes two at a time take 24 s: the whole
    # push's deadline (5 s + 2 s a Node = 29 s) leaves room for every one of them.
    policy = PushPolicy(timeout_s=5.0, per_node_s=2.0, fanout=2)
    began = trio.current_time()
    results = await push(fleet, current, policy)
    assert [r.status for r in results] == ["applied"] * 12
    assert fleet.most_in_flight == 2
    # Six rounds of 4 s; the pushes of a round start half a millisecond apart (the rate).
    assert trio.current_time() - began == pytest.approx(24.0, abs=0.01)


async def test_pushes_start_evenly_at_the_rate_and_the_deadline_makes_room_for_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    current = snapshot(30)
    fleet = Fleet(current, ack_after_s=0.0)  # a fleet on a fast link: the rate decides
    # 30 pushes at 10 a second take 2.9 s; the per-Node budget alone (0 s) would leave
    # the whole push 1 s, the Node's own timeout: the rate's spacing counts instead.
    policy = PushPolicy(timeout_s=1.0, per_node_s=0.0, fanout=64, rate_per_s=10.0)
    assert policy.deadline_s(30) == pytest.approx(4.0)
    began = trio.current_time()
    results = await push(fleet, current, policy)
    assert [r.status for r in results] == ["applied"] * 30
    starts = [at - began for _, at in fleet.pushes]
    assert starts == pytest.approx([i / 10 for i in range(30)])


async def test_a_slow_ack_does_not_let_the_pushes_after_it_burst(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A worker whose Node acked late has missed its turns; the pushes that follow still
    start a spacing apart, not all at once to catch up."""
    current = snapshot(4)
    fleet = Fleet(current, ack_after_s=0.0)
    fleet.ack_after = {"n0": 1.0, "n1": 0.9}  # both workers busy until 1 s
    policy = PushPolicy(timeout_s=5.0, fanout=2, rate_per_s=10.0)
    began = trio.current_time()
    await push(fleet, current, policy)
    starts = sorted(at - began for _, at in fleet.pushes)
    assert starts == pytest.approx([0.0, 0.1, 1.0, 1.1])  # the turns missed are not made up


async def test_a_node_whose_outbox_is_full_holds_up_only_the_pushes_of_its_turn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A sender waits while its Node's outbox is full; the other senders push every
    other Node meanwhile. Only the Nodes handed out with it (its turn's) wait with it."""
    current = snapshot(40)
    fleet = Fleet(current, ack_after_s=0.001)
    order = sorted(current.nodes)  # as `push` hands them out
    fleet.blocked.add(order[0])
    policy = PushPolicy(timeout_s=5.0, per_node_s=1.0)  # 1,000 a second: turns of 8

    async def unblock_later() -> None:
        await trio.sleep(10.0)
        fleet.unblocked.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(unblock_later)
        results = await push(fleet, current, policy)
    assert [r.status for r in results] == ["applied"] * 40
    pushed_at = dict(fleet.pushes)
    turn = set(order[:8])
    assert all(at < 1.0 for node, at in pushed_at.items() if node not in turn)
    assert all(at >= 10.0 for node, at in pushed_at.items() if node in turn)


def test_a_push_policy_needs_a_positive_fan_out_and_rate() -> None:
    with pytest.raises(ValueError, match="fan-out"):
        PushPolicy(fanout=0)
    with pytest.raises(ValueError, match="rate"):
        PushPolicy(rate_per_s=0.0)


async def test_nodes_still_queued_at_the_deadline_are_failed_not_forgotten(
    autojump_clock: trio.testing.MockClock,
) -> None:
    current = snapshot(6)
    fleet = Fleet(current, ack_after_s=4.0)
    policy = PushPolicy(timeout_s=5.0, per_node_s=0.6, fanout=2)  # 8.6 s: two rounds of 4 s
    results = await push(fleet, current, policy)
    assert [(r.id, r.status) for r in results] == [
        ("n0", "applied"),
        ("n1", "applied"),
        ("n2", "applied"),
        ("n3", "applied"),
        ("n4", "failed"),
        ("n5", "failed"),
    ]
    assert results[4].detail == "no refresh_ack within 8.6s"


async def test_a_silent_node_fails_after_its_own_timeout_and_does_not_hold_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    current = snapshot(4)
    fleet = Fleet(current)
    fleet.silent.add("n0")
    fleet.connected.discard("n3")
    policy = PushPolicy(timeout_s=3.0, per_node_s=1.0, fanout=1)
    results = await push(fleet, current, policy)
    assert [(r.id, r.status, r.detail) for r in results] == [
        ("n0", "failed", "no refresh_ack within 3s"),
        ("n1", "applied", None),
        ("n2", "applied", None),
        ("n3", "not_connected", None),
    ]


async def test_the_catch_up_pushes_again_with_doubling_intervals_until_the_node_applies(
    autojump_clock: trio.testing.MockClock,
) -> None:
    current = snapshot(3)
    fleet = Fleet(current, ack_after_s=0.5)
    fleet.silent.add("n1")
    policy = PushPolicy(timeout_s=1.0, per_node_s=0.0, first_retry_s=2.0, max_retry_s=5.0)
    catch_up = CatchUp(fleet, policy)
    results = await push(fleet, current, policy)
    noted = catch_up.take_failures(results)
    assert [r.status for r in noted] == ["applied", "failed", "applied"]
    assert noted[1].detail is not None and "pushes the config again" in noted[1].detail
    assert catch_up.waiting() == {"n1"}
    start = trio.current_time()
    fleet.pushes.clear()

    async with fleet.acking(), trio.open_nursery() as nursery:
        await nursery.start(catch_up.run)
        # Three more misses: retries 2 s, then 4 s, then 5 s (capped) after each miss.
        await fleet.wait_until(lambda: len(fleet.pushes) == 3)
        fleet.silent.clear()  # the third push is already waiting: it misses too
        await fleet.wait_until(lambda: fleet.applied["n1"] == current.revision)
        nursery.cancel_scope.cancel()

    times = [round(at - start, 1) for _, at in fleet.pushes]
    # Each push is 1 s of waiting for an ack that does not come, then the interval.
    assert times == [2.0, 7.0, 13.0, 19.0]
    assert [node for node, _ in fleet.pushes] == ["n1"] * 4
    assert catch_up.waiting() == frozenset()


async def test_the_catch_up_leaves_a_node_that_left_or_was_welcomed_with_the_revision(
    autojump_clock: trio.testing.MockClock,
) -> None:
    current = snapshot(2)
    fleet = Fleet(current)
    catch_up = CatchUp(fleet, PushPolicy(first_retry_s=1.0))
    catch_up.behind(["n0", "n1"])
    fleet.connected.discard("n0")  # gone: its next welcome carries the running config
    fleet.applied["n1"] = current.revision  # linked again and welcomed with it
    async with fleet.acking(), trio.open_nursery() as nursery:
        await nursery.start(catch_up.run)
        await trio.sleep(2.0)
        nursery.cancel_scope.cancel()
    assert fleet.pushes == [] and catch_up.waiting() == frozenset()


async def test_a_refresh_takes_its_nodes_out_of_the_catch_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    current = snapshot(2)
    catch_up = CatchUp(Fleet(current), PushPolicy())
    catch_up.behind(["n0", "n1"])
    catch_up.forget(["n0"])
    assert catch_up.waiting() == {"n1"}


async def test_turns_are_spaced_at_the_rate_and_a_late_one_is_not_made_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A turn taken after its time (a busy loop, or no room) is now, not in the past; the
    turns after it keep their spacing, not made up in a burst."""
    turns = _Turns(["a", "b", "c"], rate=10.0)
    began = trio.current_time()
    assert turns.take(8) == (["a"], began)  # the first turn is now
    await trio.sleep(1.0)  # b's turn passed long ago
    now = trio.current_time()
    assert turns.take(8) == (["b"], now)
    assert turns.take(8) == (["c"], pytest.approx(now + 0.1))
    assert turns.take(8)[0] == []


async def test_turns_within_the_grain_are_handed_out_together(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """At 1,000 a second, the 8 turns of each 8 ms go together (one wake-up, 8 pushes);
    as many as there is room for."""
    turns = _Turns([f"n{i}" for i in range(20)], rate=1000.0)
    began = trio.current_time()
    taken = [turns.take(most) for most in (64, 3, 64, 64)]
    assert [(len(batch), round(at - began, 3)) for batch, at in taken] == [
        (8, 0.0),
        (3, 0.008),
        (8, 0.011),
        (1, 0.019),
    ]


async def test_no_task_waits_for_an_ack_the_nodes_answer_the_push() -> None:
    """The Nodes' answers settle the push from their sessions: a fleet that acks as its
    frames go out costs the push its senders' turns, no task step per Node."""
    current = snapshot(64)

    class Immediate(Fleet):
        async def push_node_config(
            self, node_id: str, revision: int, node_config: NodeConfig, answer: AckListener
        ) -> None:
            self.pushes.append((node_id, trio.current_time()))
            answer(RefreshAck(revision=revision, ok=True))

    fleet = Immediate(current)
    steps = _Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        results = await push_all(fleet, sorted(current.nodes), current, PushPolicy())
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert [r.status for r in results] == ["applied"] * 64
    # 8 batches of 8 turns, a wake-up each for one of the senders, and the tasks' own
    # start and end: far fewer steps than the 64 Nodes pushed.
    assert steps.by_push < 32, steps.by_push


class _Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.by_push = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.startswith("iop_edge.runtime.refresh.push."):
            self.by_push += 1
