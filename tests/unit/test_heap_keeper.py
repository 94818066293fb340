"""The heap keeper (`runtime.lifecycle.heap`): a quiet connect burst is frozen, churn or a
long freeze brings one thaw, a hold keeps the older generations uncollected. The
collector is a fake, time the autojump clock's, and the keeper runs in the test's
nursery (the `keeper` fixture); the last test drives the real collector (`garbage`:
tests/unit/conftest.py)."""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import trio
import trio.testing

from iop_edge.runtime.lifecycle.heap import (
    BURST,
    HELD_THRESHOLD,
    QUIET_S,
    RECENT,
    SWEEP_FLEET,
    SWEEP_MIN_S,
    SWEEP_S,
    SWEEP_STEP_S,
    THAW_INTERVAL_S,
    THRESHOLDS,
    HeapKeeper,
    sweep_period,
)


class FakeCollector:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.thresholds = THRESHOLDS

    def get_threshold(self) -> tuple[int, int, int]:
        return self.thresholds

    def set_threshold(self, young: int, middle: int, old: int) -> None:
        self.thresholds = (young, middle, old)

    def freeze(self) -> None:
        self.calls.append(("freeze", trio.current_time()))

    def unfreeze(self) -> None:
        self.calls.append(("unfreeze", trio.current_time()))

    def collect(self, generation: int = 2) -> int:
        name = "collect" if generation == 2 else f"collect {generation}"
        self.calls.append((name, trio.current_time()))
        return 7

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def collector() -> FakeCollector:
    return FakeCollector()


@pytest.fixture
async def keeper(collector: FakeCollector, nursery: trio.Nursery) -> HeapKeeper:
    """A keeper running on the fake collector until the test ends (pytest-trio cancels
    the test's nursery then)."""
    keeper = HeapKeeper(collector)
    await nursery.start(keeper.run)
    return keeper


async def connect(keeper: HeapKeeper, nodes: int, every_s: float = 0.01) -> None:
    for _ in range(nodes):
        keeper.node_connected()
        await trio.sleep(every_s)


async def test_a_burst_is_frozen_every_burst_and_its_tail_once_quiet(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
    await connect(keeper, BURST - 1)
    await trio.testing.wait_all_tasks_blocked()
    assert collector.calls == []  # fewer than a burst, still arriving
    await connect(keeper, 1)
    await trio.testing.wait_all_tasks_blocked()
    young = f"collect {RECENT}"
    assert collector.names() == [young, "freeze"]  # a whole burst: at once
    await connect(keeper, 3)
    quiet = trio.current_time() - 0.01 + QUIET_S
    await trio.sleep(QUIET_S * 3)
    assert collector.calls[2:] == [(young, quiet), ("freeze", quiet)]  # the tail, once quiet


async def test_churn_brings_one_thaw_and_the_survivors_are_frozen_again(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
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


async def test_a_freeze_is_thawed_after_the_interval(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
    await trio.sleep(THAW_INTERVAL_S * 2)
    assert collector.calls == []  # nothing frozen since the start: nothing to thaw
    keeper.node_connected()
    await trio.sleep(QUIET_S * 2)  # frozen once quiet; the last thaw is long past
    young = f"collect {RECENT}"
    assert collector.names() == [young, "freeze", "unfreeze", "collect", "freeze"]
    keeper.node_connected()  # frozen once quiet: the next thaw an interval after the last
    await trio.sleep(THAW_INTERVAL_S * 2)
    thaws = [at for name, at in collector.calls if name == "unfreeze"]
    assert len(thaws) == 2 and thaws[1] == thaws[0] + THAW_INTERVAL_S


async def test_a_large_fleets_heap_is_frozen_every_sweep(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
    await connect(keeper, SWEEP_FLEET - 1, every_s=0)
    await trio.sleep(QUIET_S * 2)
    collector.calls.clear()
    await trio.sleep(SWEEP_S * 3.5)
    assert collector.calls == []  # a smaller fleet: frozen after bursts only
    await connect(keeper, 1, every_s=0)
    await trio.sleep(QUIET_S * 2 + SWEEP_S / 4)  # the last connects' freeze, once quiet
    collector.calls.clear()
    await trio.sleep(SWEEP_S * 3)  # a quarter period off the sweeps: three of them
    assert collector.names() == ["collect 0", "freeze"] * 3


@pytest.mark.parametrize(
    ("period", "took", "expected"),
    [
        (1.0, 0.0, SWEEP_S),  # nothing to walk: the longest period
        (1.0, SWEEP_STEP_S / 2, SWEEP_S),  # cheap: never longer than the longest
        (1.0, SWEEP_STEP_S * 4, 0.25),  # four times the aim: a quarter of the period
        (0.25, SWEEP_STEP_S, 0.25),  # on the aim: the period stays
        (0.1, SWEEP_STEP_S * 100, SWEEP_MIN_S),  # never shorter than the shortest
        (0.1, SWEEP_STEP_S / 5, 0.5),  # the work eased: the period grows back
    ],
)
def test_the_sweep_period_aims_each_sweep_at_its_step(
    period: float, took: float, expected: float
) -> None:
    assert sweep_period(period, took) == pytest.approx(expected)


class CostlyCollector(FakeCollector):
    """A young collection costs the loop `per_s` for every second since the last one:
    the young generation of a fleet whose Nodes keep sending."""

    def __init__(self, per_s: float) -> None:
        super().__init__()
        self.per_s = per_s
        self.cpu = 0.0
        self._last = trio.current_time()

    def collect(self, generation: int = 2) -> int:
        now = trio.current_time()
        self.cpu += (now - self._last) * self.per_s
        self._last = now
        return super().collect(generation)

    def timer(self) -> float:
        return self.cpu


async def test_a_busy_fleets_sweeps_come_faster_and_slow_down_when_it_quiets(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    collector = CostlyCollector(per_s=SWEEP_STEP_S * 8)  # eight steps' worth a second
    keeper = HeapKeeper(collector, timer=collector.timer)
    await nursery.start(keeper.run)
    await connect(keeper, SWEEP_FLEET, every_s=0)
    await trio.sleep(QUIET_S * 2)
    collector.calls.clear()
    await trio.sleep(SWEEP_S * 2)
    sweeps = [at for name, at in collector.calls if name == "collect 0"]
    gaps = [later - earlier for earlier, later in itertools.pairwise(sweeps)]
    assert gaps and all(gap == pytest.approx(SWEEP_S / 8) for gap in gaps)
    collector.per_s = SWEEP_STEP_S / 10  # the refresh is over
    await trio.sleep(SWEEP_S * 2)
    collector.calls.clear()
    await trio.sleep(SWEEP_S * 3)
    sweeps = [at for name, at in collector.calls if name == "collect 0"]
    assert len(sweeps) == 3  # back to one a period


async def test_the_garbage_waiting_for_the_collector_is_not_frozen_with_new_sessions(
    autojump_clock: trio.testing.MockClock,
    garbage: weakref.ref[object],
    nursery: trio.Nursery,
) -> None:
    keeper = HeapKeeper()  # the real collector
    await nursery.start(keeper.run)
    frozen = gc.get_freeze_count()
    keeper.node_connected()  # a Node reconnects; its session is frozen once quiet
    await trio.sleep(QUIET_S * 2)
    assert gc.get_freeze_count() > frozen
    gc.collect()
    assert garbage() is None


async def test_a_hold_freezes_at_both_ends_and_collects_only_the_young_meanwhile(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
    with keeper.held():
        assert collector.names() == [f"collect {RECENT}", "freeze"]
        assert collector.thresholds == (THRESHOLDS[0], HELD_THRESHOLD, HELD_THRESHOLD)
        with keeper.held():  # re-entrant: the inner one changes nothing
            pass
        assert collector.thresholds == (THRESHOLDS[0], HELD_THRESHOLD, HELD_THRESHOLD)
        collector.calls.clear()
    assert collector.names() == ["freeze"]  # what the body made: never walked again
    assert collector.thresholds == THRESHOLDS


async def test_a_thaw_due_during_a_hold_waits_for_its_end(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
    await connect(keeper, 1000)
    await trio.sleep(QUIET_S * 2)
    with keeper.held():
        collector.calls.clear()
        for _ in range(200):  # churn: a fifth of the fleet ended
            keeper.node_disconnected()
        await connect(keeper, BURST, every_s=0)  # a burst: frozen, its collection held back
        await trio.sleep(THAW_INTERVAL_S * 2)  # and the interval passed
        assert collector.names() == ["freeze"]
    await trio.testing.wait_all_tasks_blocked()
    assert collector.names() == ["freeze", "freeze", "unfreeze", "collect", "freeze"]


async def test_a_hold_starts_the_sweeps_over_at_their_shortest_period(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
    await connect(keeper, SWEEP_FLEET, every_s=0)
    await trio.sleep(QUIET_S * 2 + SWEEP_S / 4)  # the connects frozen; a sweep a period
    collector.calls.clear()
    opened = trio.current_time()
    with keeper.held():
        await trio.sleep(SWEEP_S / 2)
    sweeps = [at for name, at in collector.calls if name == "collect 0"]
    # not a period after the last sweep: the shortest period after the hold opened
    assert sweeps[0] == pytest.approx(opened + SWEEP_MIN_S)
