"""The heap keeper (`runtime.lifecycle.heap`): a quiet connect burst is frozen, churn or
a long freeze brings one thaw. The collector is a fake; time is the autojump clock's."""

from __future__ import annotations

import trio
import trio.testing

from iop_edge.core.gc_pause import freezes, gc_held
from iop_edge.runtime.lifecycle.heap import (
    BURST,
    QUIET_S,
    SWEEP_AT,
    SWEEP_S,
    THAW_AFTER_FREEZES,
    THAW_INTERVAL_S,
    HeapKeeper,
)


class FakeCollector:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.young_objects = 0

    def freeze(self) -> None:
        self.calls.append(("freeze", trio.current_time()))
        self.young_objects = 0  # frozen: nothing young is left

    def unfreeze(self) -> None:
        self.calls.append(("unfreeze", trio.current_time()))

    def collect(self) -> int:
        self.calls.append(("collect", trio.current_time()))
        return 7

    def young(self) -> int:
        return self.young_objects

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


async def connect(keeper: HeapKeeper, nodes: int, every_s: float = 0.01) -> None:
    for _ in range(nodes):
        keeper.node_connected()
        await trio.sleep(every_s)


async def test_a_burst_is_frozen_every_burst_and_its_tail_once_quiet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    collector = FakeCollector()
    keeper = HeapKeeper(collector)
    async with trio.open_nursery() as nursery:
        await nursery.start(keeper.run)
        await connect(keeper, BURST - 1)
        await trio.testing.wait_all_tasks_blocked()
        assert collector.calls == []  # fewer than a burst, still arriving
        await connect(keeper, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert collector.names() == ["freeze"]  # a whole burst: at once
        await connect(keeper, 3)
        last = trio.current_time() - 0.01
        await trio.sleep(QUIET_S * 3)
        assert collector.calls[1:] == [("freeze", last + QUIET_S)]  # the tail, once quiet
        nursery.cancel_scope.cancel()


async def test_churn_brings_one_thaw_and_the_survivors_are_frozen_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    collector = FakeCollector()
    keeper = HeapKeeper(collector)
    async with trio.open_nursery() as nursery:
        await nursery.start(keeper.run)
        await connect(keeper, 1000)
        await trio.sleep(QUIET_S * 2)
        collector.calls.clear()  # a freeze per burst of connects
        for _ in range(90):  # 90 ended, 910 connected: under a tenth of them
            keeper.node_disconnected()
        await trio.testing.wait_all_tasks_blocked()
        assert collector.calls == []
        keeper.node_disconnected()  # 91 ended, 909 connected: a tenth
        await trio.testing.wait_all_tasks_blocked()
        assert collector.names() == ["unfreeze", "collect", "freeze"]
        nursery.cancel_scope.cancel()


async def test_a_refresh_freeze_is_thawed_after_the_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    collector = FakeCollector()
    keeper = HeapKeeper(collector)
    async with trio.open_nursery() as nursery:
        await nursery.start(keeper.run)
        await trio.sleep(THAW_INTERVAL_S * 2)
        assert collector.calls == []  # nothing frozen since the start: nothing to thaw
        with gc_held():  # a refresh freezes the heap
            pass
        keeper.node_connected()  # any wake-up: the keeper looks again, the thaw is due
        await trio.testing.wait_all_tasks_blocked()
        assert collector.names() == ["unfreeze", "collect", "freeze"]
        thawed = trio.current_time()
        with gc_held():  # the next refresh: thawed an interval after the last thaw
            pass
        keeper.node_connected()
        await trio.sleep(THAW_INTERVAL_S * 2)
        thaws = [at for name, at in collector.calls if name == "unfreeze"]
        assert thaws == [thawed, thawed + THAW_INTERVAL_S]
        nursery.cancel_scope.cancel()


async def test_a_young_generation_grown_past_the_mark_is_frozen_at_the_next_look(
    autojump_clock: trio.testing.MockClock,
) -> None:
    collector = FakeCollector()
    keeper = HeapKeeper(collector)
    async with trio.open_nursery() as nursery:
        await nursery.start(keeper.run)
        collector.young_objects = SWEEP_AT
        await trio.sleep(SWEEP_S * 3.5)
        assert collector.calls == []  # not past the mark
        collector.young_objects = SWEEP_AT + 1
        await trio.sleep(SWEEP_S * 1.5)
        assert collector.names() == ["freeze"]
        nursery.cancel_scope.cancel()


async def test_many_refresh_freezes_bring_a_thaw_before_the_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    collector = FakeCollector()
    keeper = HeapKeeper(collector)
    async with trio.open_nursery() as nursery:
        await nursery.start(keeper.run)
        before = freezes()
        while freezes() - before < THAW_AFTER_FREEZES - 2:  # a hold freezes twice
            with gc_held():
                pass
        keeper.node_connected()  # a wake-up: the keeper looks
        await trio.testing.wait_all_tasks_blocked()
        assert "unfreeze" not in collector.names()
        with gc_held():
            pass
        keeper.node_connected()
        await trio.testing.wait_all_tasks_blocked()
        assert collector.names()[:3] == ["unfreeze", "collect", "freeze"]
        nursery.cancel_scope.cancel()
