"""The Node's run slots across Edge links (`iop_node.runs.slots`)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop_node.runs.slots import Busy, ProviderSlots
from schemas.config import ProviderConfig
from schemas.wire import ProviderLoad


def _provider(
    provider_id: str = "p", capacity: int = 2, long_slots: int | None = None
) -> ProviderConfig:
    return ProviderConfig(
        id=provider_id,
        type="sim",
        models=["m"],
        capacity=capacity,
        long_context_slots=long_slots,
    )


def _slots(*providers: ProviderConfig, links: int = 2) -> ProviderSlots:
    slots = ProviderSlots()
    slots.configure(providers or (_provider(),))
    for link in range(1, links + 1):
        slots.add_link(link)
    return slots


def test_capacity_is_shared_by_every_link() -> None:
    slots = _slots(_provider(capacity=2))
    first = slots.hold(1, "p", long=False)
    second = slots.hold(2, "p", long=False)
    assert first is not None and second is not None
    with pytest.raises(Busy, match="all 2 of its slots"):
        slots.hold(1, "p", long=False)
    first.release()
    assert slots.hold(2, "p", long=False) is not None


def test_release_is_idempotent() -> None:
    slots = _slots(_provider(capacity=1))
    hold = slots.hold(1, "p", long=False)
    assert hold is not None
    hold.release()
    hold.release()
    assert slots.statistics().in_flight == {"p": 0}
    assert slots.hold(1, "p", long=False) is not None


def test_others_counts_every_link_but_the_asking_one() -> None:
    slots = _slots(_provider("a", capacity=4), _provider("b", capacity=4), links=3)
    slots.hold(1, "a", long=False)
    slots.hold(2, "a", long=False)
    slots.hold(2, "b", long=False)
    slots.hold(3, "b", long=False)
    assert slots.others(1) == [
        ProviderLoad(id="a", in_flight=1, long_in_flight=0),
        ProviderLoad(id="b", in_flight=2, long_in_flight=0),
    ]
    assert slots.others(2) == [
        ProviderLoad(id="a", in_flight=1, long_in_flight=0),
        ProviderLoad(id="b", in_flight=1, long_in_flight=0),
    ]
    assert slots.statistics().by_link == {1: {"a": 1}, 2: {"a": 1, "b": 1}, 3: {"b": 1}}


def test_a_long_run_holds_a_long_slot_and_a_regular_one() -> None:
    slots = _slots(_provider(capacity=3, long_slots=1))
    assert slots.hold(1, "p", long=True) is not None
    with pytest.raises(Busy, match="long-context"):
        slots.hold(2, "p", long=True)
    # the failed long attempt gave its regular slot back
    assert slots.statistics().in_flight == {"p": 1}
    assert slots.hold(2, "p", long=False) is not None
    assert slots.others(2) == [ProviderLoad(id="p", in_flight=1, long_in_flight=1)]


def test_unknown_providers_are_not_counted() -> None:
    slots = _slots()
    assert slots.hold(1, "nope", long=False) is None


def test_refresh_resizes_in_place_and_a_removed_provider_waits_for_its_runs() -> None:
    slots = _slots(_provider(capacity=2))
    held = [slots.hold(1, "p", long=False), slots.hold(1, "p", long=False)]
    slots.configure([_provider(capacity=1)])  # a shrink below what is held stops new runs
    with pytest.raises(Busy):
        slots.hold(2, "p", long=False)
    held[0].release()  # type: ignore[union-attr]
    with pytest.raises(Busy):
        slots.hold(2, "p", long=False)
    slots.configure([])  # removed: no new runs, the last one still counted
    assert slots.hold(2, "p", long=False) is None
    assert slots.statistics().in_flight == {"p": 1}
    held[1].release()  # type: ignore[union-attr]
    assert slots.statistics().in_flight == {}


def test_peak_records_the_most_held_at_once() -> None:
    slots = _slots(_provider(capacity=3))
    holds = [slots.hold(1, "p", long=False) for _ in range(3)]
    for hold in holds:
        hold.release()  # type: ignore[union-attr]
    slots.hold(2, "p", long=False)
    assert slots.statistics().peak == {"p": 3}


async def test_a_link_wakes_when_the_others_change_not_its_own() -> None:
    slots = _slots()
    woke: list[int] = []

    async def watch(link: int) -> None:
        await slots.wait_changed(link, slots.version(link))
        woke.append(link)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, 1)
        nursery.start_soon(watch, 2)
        await trio.testing.wait_all_tasks_blocked()
        hold = slots.hold(1, "p", long=False)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == [2]
        assert hold is not None
        hold.release()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert woke == [2]


async def test_removing_a_link_wakes_its_waiter() -> None:
    slots = _slots()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(slots.wait_changed, 1, slots.version(1))
        await trio.testing.wait_all_tasks_blocked()
        slots.remove_link(1)


async def test_pressure_starts_at_half_the_slots() -> None:
    slots = _slots(_provider(capacity=4))
    holds = [slots.hold(1, "p", long=False)]
    assert not slots.under_pressure()
    woke = trio.Event()

    async def wait() -> None:
        await slots.wait_pressure()
        woke.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        holds.append(slots.hold(2, "p", long=False))  # 2 of 4: under pressure
        await trio.testing.wait_all_tasks_blocked()
        assert woke.is_set() and slots.under_pressure()
    holds[0].release()  # type: ignore[union-attr]
    assert not slots.under_pressure()
