"""The heap keeper (`runtime.lifecycle.heap`): a quiet connect burst is frozen, churn or
a long freeze brings one thaw. The collector is a fake; time is the autojump clock's."""

from __future__ import annotations

import trio
import trio.testing

from iop_edge.core.gc_pause import gc_held
from iop_edge.runtime.lifecycle.heap import BURST, QUIET_S, THAW_INTERVAL_S, HeapKeeper


class FakeCollector:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def freeze(self) -> None:
        self.calls.append(("freeze", trio.current_time()))

    def unfreeze(self) -> None:
        self.calls.append(("unfreeze", trio.current_time()))

    def collect(self) -> int:
        self.calls.append(("collect", trio.current_time()))
        return 7

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


async def connect(keeper: HeapKeeper, nodes: int, every_s: float = 0.01) -> None:
    for _ in range(nodes):
        keeper.node_connected()
        await trio.sleep(every_s)


async def test_a_burst_is_frozen_once_it_has_been_quiet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    collector = FakeCollector()
    keeper = HeapKeeper(collector)
    async with trio.open_nursery() as nursery:
        await nursery.start(keeper.run)
        start = trio.current_time()
        await connect(keeper, BURST - 1)
        await trio.sleep(QUIET_S * 3)
        assert collector.calls == []  # too few to be a burst
        await connect(keeper, 1)
        last = trio.current_time()
        await trio.sleep(QUIET_S * 3)
        assert collector.calls == [("freeze", last + QUIET_S - 0.01)]
        assert last > start
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
        for _ in range(90):  # 90 ended, 910 connected: under a tenth of them
            keeper.node_disconnected()
        await trio.testing.wait_all_tasks_blocked()
        assert collector.names() == ["freeze"]
        keeper.node_disconnected()  # 91 ended, 909 connected: a tenth
        await trio.testing.wait_all_tasks_blocked()
        assert collector.names() == ["freeze", "unfreeze", "collect", "freeze"]
        nursery.cancel_scope.cancel()


async def test_a_refresh_freeze_is_thawed_after_the_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    collector = FakeCollector()
    keeper = HeapKeeper(collector)
    async with trio.open_nursery() as nursery:
        await nursery.start(keeper.run)
        start = trio.current_time()
        await trio.sleep(THAW_INTERVAL_S * 2)
        assert collector.calls == []  # nothing frozen since the start: nothing to thaw
        with gc_held():  # a refresh freezes the heap
            pass
        keeper.node_connected()  # any wake-up; the keeper looks again
        await trio.sleep(THAW_INTERVAL_S)
        assert collector.names() == ["unfreeze", "collect", "freeze"]
        assert collector.calls[0][1] >= start + THAW_INTERVAL_S
        nursery.cancel_scope.cancel()
