"""The heap keeper (`runtime.lifecycle.heap_keeper`; its rules are
`runtime.lifecycle.heap`'s): a quiet connect burst is frozen, only ended sessions that stay
alive (leaked) bring a thaw, a hold keeps the older generations uncollected. The collector
is a fake, time the autojump clock's, and the keeper runs in the test's nursery (the
`keeper` fixture); the tests named so drive the real collector (`garbage`,
`manual_collector`: tests/unit/conftest.py)."""

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
    LEAK_GRACE_S,
    LEAKS_FOR_THAW,
    QUIET_S,
    RECENT,
    SWEEP_FLEET,
    SWEEP_MIN_S,
    SWEEP_S,
    SWEEP_STEP_S,
    THRESHOLDS,
    sweep_period,
)
from iop_edge.runtime.lifecycle.heap_keeper import HeapKeeper


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


class Session:
    """Stands for a Node session: freed by reference counting once the test drops it."""


async def test_ended_sessions_that_are_freed_bring_no_thaw_however_many_or_long(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
    await connect(keeper, 1000)
    await trio.sleep(QUIET_S * 2)
    collector.calls.clear()  # a freeze per burst of connects
    for index in range(900):  # most of the fleet leaves, and its sessions are freed
        keeper.node_disconnected()
        keeper.session_ended(Session(), f"node {index}")
    await trio.sleep(LEAK_GRACE_S * 100)  # and time passes
    assert collector.calls == []
    assert keeper.statistics().sessions_leaked == 0


async def test_sessions_alive_after_the_grace_are_leaked_and_enough_of_them_bring_one_thaw(
    autojump_clock: trio.testing.MockClock,
    collector: FakeCollector,
    keeper: HeapKeeper,
    caplog: pytest.LogCaptureFixture,
) -> None:
    leaked = [Session() for _ in range(LEAKS_FOR_THAW)]  # held: as a cycle would hold them
    for index, session in enumerate(leaked[:-1]):
        keeper.session_ended(session, f"node {index}")
    await trio.sleep(LEAK_GRACE_S / 2)
    keeper.session_ended(leaked[-1], "node last")
    keeper.session_ended(Session(), "node freed")  # freed at once: never counted
    await trio.sleep(LEAK_GRACE_S / 2 + 0.01)
    assert keeper.statistics().sessions_leaked == LEAKS_FOR_THAW - 1
    assert collector.calls == []  # one short of the threshold
    await trio.sleep(LEAK_GRACE_S / 2)  # the last one is past its grace too
    assert collector.names() == ["unfreeze", "collect", "freeze"]
    assert keeper.statistics().thaws == 1
    said = caplog.text
    assert f"{LEAKS_FOR_THAW} ended session(s) were still alive" in said
    assert "node 0, node 1" in said and "node freed" not in said
    # The fake collection freed none: they are held by a live reference, named once, and
    # no longer counted; they bring no second thaw.
    assert f"{LEAKS_FOR_THAW} leaked session(s) outlived a full collection" in said
    await trio.sleep(LEAK_GRACE_S * 10)
    assert collector.names() == ["unfreeze", "collect", "freeze"]


async def test_a_session_freed_after_its_grace_no_longer_counts_toward_a_thaw(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
    late = [Session() for _ in range(LEAKS_FOR_THAW - 1)]
    for index, session in enumerate(late):
        keeper.session_ended(session, f"node {index}")
    await trio.sleep(LEAK_GRACE_S * 2)
    late.clear()  # held long (a slow push), then freed
    keeper.session_ended(held := Session(), "node held")
    await trio.sleep(LEAK_GRACE_S * 2)
    assert held is not None
    assert keeper.statistics().sessions_leaked == LEAKS_FOR_THAW
    assert collector.calls == []


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


async def test_what_a_held_operation_keeps_is_frozen_without_a_walk(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
    """A snapshot assembled in steps is said alive as it is made (`keep`): frozen, so the
    sweeps meanwhile do not walk it (Rule 5)."""
    with keeper.held() as keep:
        collector.calls.clear()
        keep()
        assert collector.names() == ["freeze"]
        assert collector.thresholds == (THRESHOLDS[0], HELD_THRESHOLD, HELD_THRESHOLD)


async def test_a_thaw_due_during_a_hold_waits_for_its_end(
    autojump_clock: trio.testing.MockClock, collector: FakeCollector, keeper: HeapKeeper
) -> None:
    leaked = [Session() for _ in range(LEAKS_FOR_THAW)]
    with keeper.held():
        collector.calls.clear()
        for index, session in enumerate(leaked):
            keeper.session_ended(session, f"node {index}")
        await connect(keeper, BURST, every_s=0)  # a burst: frozen, its collection held back
        await trio.sleep(LEAK_GRACE_S * 2)  # the sessions leaked meanwhile
        assert collector.names() == ["freeze"]
    await trio.testing.wait_all_tasks_blocked()
    assert collector.names() == ["freeze", "freeze", "unfreeze", "collect", "freeze"]


async def test_a_hold_sweeps_at_the_shortest_period_from_its_opening_to_its_end(
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
    # and so on while it is open, however cheap the sweeps are (a fleet's pushes may
    # not have begun yet)
    assert sweeps == pytest.approx([opened + SWEEP_MIN_S * (i + 1) for i in range(len(sweeps))])
    assert len(sweeps) >= 5


async def test_a_leaked_cycle_is_freed_by_the_thaw_it_brings(
    autojump_clock: trio.testing.MockClock,
    manual_collector: None,
    nursery: trio.Nursery,
) -> None:
    """The real collector: sessions in reference cycles, frozen, are freed by the thaw,
    and their finalizers tell the keeper so (nothing is left to name afterwards)."""
    keeper = HeapKeeper()
    await nursery.start(keeper.run)
    cycles = [Session() for _ in range(LEAKS_FOR_THAW)]
    for session in cycles:
        session.itself = session  # type: ignore[attr-defined]
    freed = [weakref.ref(session) for session in cycles]
    for index, session in enumerate(cycles):
        keeper.session_ended(session, f"node {index}")
    gc.freeze()  # as a sweep would have
    del session
    cycles.clear()
    await trio.sleep(LEAK_GRACE_S * 2)
    assert all(ref() is None for ref in freed)
    assert keeper.statistics().thaws == 1
