"""The heap keeper (`runtime.lifecycle.heap`): a quiet connect burst is frozen, churn or
a long freeze brings one thaw. The collector is a fake, time the autojump clock's, and
the keeper runs in the test's nursery (the `keeper` fixture); the last test drives the
real collector (`garbage`: tests/unit/conftest.py)."""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import trio
import trio.testing

from iop_edge.core.gc_pause import RECENT, freezes, gc_held
from iop_edge.runtime.lifecycle.heap import (
    BURST,
    QUIET_S,
    SWEEP_FLEET,
    SWEEP_HELD_S,
    SWEEP_MIN_S,
    SWEEP_S,
    SWEEP_STEP_S,
    THAW_AFTER_FREEZES,
    THAW_INTERVAL_S,
    HeapKeeper,
    sweep_period,
)


class FakeCollector:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

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


async def test_a_refresh_freeze_is_thawed_after_the_interval(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
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


async def test_the_first_sweep_after_a_pause_comes_at_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """A pause (a refresh reading its candidate) skips sweeps; the fleet keeps sending
    meanwhile, so the first sweep after it comes at once, not a period later."""
    collector = CostlyCollector(per_s=SWEEP_STEP_S * 8)
    pause = Pause()
    keeper = HeapKeeper(collector, paused=pause, timer=collector.timer)
    await nursery.start(keeper.run)
    await connect(keeper, SWEEP_FLEET, every_s=0)
    await trio.sleep(QUIET_S * 2)
    pause.open = True
    await trio.sleep(SWEEP_S / 2)
    pause.open = False
    resumed = trio.current_time()
    collector.calls.clear()
    await trio.sleep(SWEEP_S / 2)
    sweeps = [at for name, at in collector.calls if name == "collect 0"]
    assert sweeps and sweeps[0] - resumed <= SWEEP_MIN_S


async def test_while_a_refresh_holds_the_heap_a_sweep_comes_every_held_period(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """An idle fleet's sweeps come a second apart; an apply's pushes begin right after its
    swap, so a hold wakes the sweep and keeps its period short until it closes."""
    collector = CostlyCollector(per_s=SWEEP_STEP_S / 10)  # idle: the longest period
    keeper = HeapKeeper(collector, timer=collector.timer)
    await nursery.start(keeper.run)
    await connect(keeper, SWEEP_FLEET, every_s=0)
    await trio.sleep(QUIET_S * 2 + SWEEP_S / 2)  # half way through a second-long period
    collector.calls.clear()
    with gc_held():  # the refresh begins
        began = trio.current_time()
        await trio.sleep(SWEEP_S)
    ended = trio.current_time()
    sweeps = [at for name, at in collector.calls if name == "collect 0"]
    gaps = [later - earlier for earlier, later in itertools.pairwise([began, *sweeps])]
    assert len(sweeps) >= SWEEP_S / SWEEP_HELD_S - 1
    assert all(gap <= SWEEP_HELD_S for gap in gaps)
    collector.calls.clear()
    await trio.sleep(SWEEP_S * 4)  # let go: the period grows back to a second
    sweeps = [at for name, at in collector.calls if name == "collect 0"]
    assert sweeps[-1] - sweeps[-2] == pytest.approx(SWEEP_S)
    assert sweeps[0] > ended


async def test_many_refresh_freezes_bring_a_thaw_before_the_interval(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
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


class Pause:
    """Whether bulk work has the collector paused, as the test says."""

    def __init__(self) -> None:
        self.open = False

    def __call__(self) -> bool:
        return self.open


@pytest.fixture
def pause() -> Pause:
    return Pause()


@pytest.fixture
async def paused_keeper(
    collector: FakeCollector, pause: Pause, nursery: trio.Nursery
) -> HeapKeeper:
    keeper = HeapKeeper(collector, paused=pause)
    await nursery.start(keeper.run)
    return keeper


async def test_the_end_of_a_refresh_alone_brings_the_thaw_after_many_freezes(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
    before = freezes()
    while freezes() - before < THAW_AFTER_FREEZES:  # refreshes, no Node comes or goes
        with gc_held():
            pass
    await trio.testing.wait_all_tasks_blocked()
    assert collector.names() == ["unfreeze", "collect", "freeze"]


async def test_no_collection_and_no_thaw_while_a_build_has_the_collector_paused(
    autojump_clock: trio.testing.MockClock,
    collector: FakeCollector,
    pause: Pause,
    paused_keeper: HeapKeeper,
) -> None:
    await connect(paused_keeper, SWEEP_FLEET, every_s=0)
    await trio.sleep(QUIET_S * 2)
    collector.calls.clear()
    pause.open = True  # a refresh reads a candidate in a worker thread
    await trio.sleep(SWEEP_S * 3.5)
    assert collector.calls == []  # the sweep leaves the build alone
    await connect(paused_keeper, BURST, every_s=0)
    await trio.testing.wait_all_tasks_blocked()
    assert collector.names() == ["freeze"]  # a burst: frozen, not collected
    collector.calls.clear()
    for _ in range(SWEEP_FLEET // 5):  # churn: a thaw is due, and waits
        paused_keeper.node_disconnected()
    await trio.sleep(SWEEP_S / 2)
    assert "unfreeze" not in collector.names()
    pause.open = False
    with gc_held():  # the refresh lets go of the heap: the keeper catches up at once
        pass
    await trio.testing.wait_all_tasks_blocked()
    assert collector.names() == ["unfreeze", "collect", "freeze"]


async def test_a_thaw_that_waited_for_a_pause_is_tried_again_a_sweep_later(
    autojump_clock: trio.testing.MockClock,
    collector: FakeCollector,
    pause: Pause,
    paused_keeper: HeapKeeper,
) -> None:
    """A pause without a hold (a catalog, a config read for `check-config`) ends with
    no word to the keeper: it looks again a sweep period later."""
    await connect(paused_keeper, BURST, every_s=0)
    await trio.testing.wait_all_tasks_blocked()
    collector.calls.clear()
    pause.open = True
    for _ in range(BURST):
        paused_keeper.node_disconnected()
    await trio.sleep(SWEEP_S * 2.5)
    assert collector.calls == []
    pause.open = False
    ended = trio.current_time()
    await trio.sleep(SWEEP_S)
    thaws = [at for name, at in collector.calls if name == "unfreeze"]
    assert len(thaws) == 1 and ended < thaws[0] <= ended + SWEEP_S
