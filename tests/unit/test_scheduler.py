"""The scheduler (iop_edge.runtime.runs.scheduler): slots, FIFO queues, waits, cooldowns, refresh.

Time is virtual (`autojump_clock`); ordering is established with
`wait_all_tasks_blocked()`, never with sleeps.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import pytest
import trio
from trio.testing import MockClock, wait_all_tasks_blocked

from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.runs.admission_errors import (
    RETRY_AFTER_BUSY_S,
    AdmissionError,
    NoProvider,
    QueueFull,
    QueueTimeout,
    UnknownModel,
)
from iop_edge.runtime.runs.lease import Lease
from iop_edge.runtime.runs.observation import SlotStatistics
from iop_edge.runtime.runs.provider_state import MAX_REST_S
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas.config import (
    CooldownPolicy,
    DispatchSection,
    EdgeConfig,
    LifecycleFlag,
    ModelEntry,
    NodeEntry,
    ProviderConfig,
)
from schemas.wire import Health

HASH = "0" * 64


def provider(
    pid: str,
    *,
    capacity: int = 2,
    long_context_slots: int | None = None,
    priority: int = 100,
    enabled: bool = True,
    lifecycle: Sequence[LifecycleFlag] = (),
) -> ProviderConfig:
    return ProviderConfig(
        id=pid,
        type="sim",
        models=[served(pid)],
        capacity=capacity,
        long_context_slots=long_context_slots,
        priority=priority,
        enabled=enabled,
        lifecycle=list(lifecycle),
    )


def served(pid: str) -> str:
    return f"{pid}-served"


def make_snapshot(
    nodes: Mapping[str, Sequence[ProviderConfig]],
    models: Mapping[str, Sequence[str]],
    *,
    revision: int = 1,
    max_queue: int = 8,
    queue_timeout_ms: int = 10_000,
    failures: int = 2,
    cooldown_s: float = 5.0,
) -> Snapshot:
    config = EdgeConfig(
        dispatch=DispatchSection(
            max_queue=max_queue,
            queue_timeout_ms=queue_timeout_ms,
            cooldown=CooldownPolicy(failures=failures, seconds=cooldown_s),
        ),
        models=[
            ModelEntry(id=mid, display_name=mid.upper(), providers={p: served(p) for p in pids})
            for mid, pids in models.items()
        ],
        nodes=[
            NodeEntry(id=nid, token_hash_sha256=HASH, providers=list(providers))
            for nid, providers in nodes.items()
        ],
    )
    return Snapshot.build(config, revision=revision, config_sha256=HASH)


def online(snapshot: Snapshot, *, clock: float | None = None) -> Scheduler:
    """A scheduler whose nodes are all connected and whose providers all report healthy."""
    scheduler = Scheduler(snapshot) if clock is None else Scheduler(snapshot, clock=lambda: clock)
    for node_id in snapshot.nodes:
        scheduler.node_connected(node_id)
    for pid, config in snapshot.providers.items():
        scheduler.provider_status(pid, "available", list(config.models))
    return scheduler


def slots(scheduler: Scheduler, provider_id: str) -> SlotStatistics:
    return scheduler.statistics().providers[provider_id]


def in_flight(scheduler: Scheduler, provider_id: str) -> int:
    """Regular slots held on `provider_id` (0 for a provider the scheduler forgot)."""
    found = scheduler.statistics().providers.get(provider_id)
    return found.in_flight if found is not None else 0


def queued(scheduler: Scheduler, model_id: str) -> int:
    return scheduler.statistics().queued[model_id]


class Attempt:
    """One `acquire()` running in the background, observed by the test."""

    def __init__(
        self,
        scheduler: Scheduler,
        model_id: str,
        run_id: str,
        *,
        long: bool = False,
        exclude: frozenset[str] = frozenset(),
    ) -> None:
        self.scheduler = scheduler
        self.model_id = model_id
        self.run_id = run_id
        self.long = long
        self.exclude = exclude
        self.scope = trio.CancelScope()
        self.done = trio.Event()
        self.lease: Lease | None = None
        self.error: AdmissionError | None = None
        self.woke_at: float | None = None

    async def run(self) -> None:
        with self.scope:
            try:
                self.lease = await self.scheduler.acquire(
                    self.model_id, self.run_id, long=self.long, exclude=self.exclude
                )
            except AdmissionError as error:
                self.error = error
        self.woke_at = trio.current_time()
        self.done.set()


async def start(
    nursery: trio.Nursery,
    scheduler: Scheduler,
    model_id: str,
    run_id: str,
    *,
    long: bool = False,
    exclude: frozenset[str] = frozenset(),
) -> Attempt:
    """Start an attempt and let it settle (granted, failed or parked in the queue)."""
    attempt = Attempt(scheduler, model_id, run_id, long=long, exclude=exclude)
    nursery.start_soon(attempt.run)
    await wait_all_tasks_blocked()
    return attempt


ONE = make_snapshot({"n1": [provider("a", capacity=1)]}, {"m": ["a"]})


# -- selection and spread --------------------------------------------------------------


async def test_lease_names_provider_node_and_target() -> None:
    scheduler = online(ONE)
    lease = await scheduler.acquire("m", "r1", long=False)
    assert (lease.run_id, lease.provider_id, lease.node_id, lease.target) == (
        "r1",
        "a",
        "n1",
        "a-served",
    )
    assert not lease.long
    assert lease.queued_s == 0.0
    assert in_flight(scheduler, "a") == 1
    lease.release()
    assert in_flight(scheduler, "a") == 0


async def test_concurrent_runs_spread_evenly_over_identical_providers() -> None:
    snapshot = make_snapshot(
        {"n1": [provider(p, capacity=4) for p in "abc"]}, {"m": ["a", "b", "c"]}
    )
    scheduler = online(snapshot)
    leases = [await scheduler.acquire("m", f"r{i}", long=False) for i in range(9)]
    assert Counter(lease.provider_id for lease in leases) == {"a": 3, "b": 3, "c": 3}
    for lease in leases:
        lease.release()


async def test_sequential_runs_rotate_instead_of_collapsing_onto_one_provider() -> None:
    snapshot = make_snapshot(
        {"n1": [provider(p, capacity=4) for p in "abc"]}, {"m": ["a", "b", "c"]}
    )
    scheduler = online(snapshot)
    picks = []
    for i in range(6):
        with await scheduler.acquire("m", f"r{i}", long=False) as lease:
            picks.append(lease.provider_id)
    assert picks == ["a", "b", "c", "a", "b", "c"]


async def test_lower_load_ratio_beats_priority() -> None:
    snapshot = make_snapshot(
        {"n1": [provider("a", capacity=3, priority=1), provider("b", capacity=3, priority=9)]},
        {"m": ["a", "b"]},
    )
    scheduler = online(snapshot)
    held = [await scheduler.acquire("m", f"r{i}", long=False) for i in range(3)]
    # a (priority 1) took r0 and r2 and is at 2/3; b is at 1/3 and must win
    assert [lease.provider_id for lease in held] == ["a", "b", "a"]
    lease = await scheduler.acquire("m", "r3", long=False)
    assert lease.provider_id == "b"


async def test_unknown_model_is_refused() -> None:
    scheduler = online(ONE)
    with pytest.raises(UnknownModel, match="'nope' is not in the catalog"):
        await scheduler.acquire("nope", "r1", long=False)


async def test_exclude_fails_over_and_refuses_when_everything_was_tried() -> None:
    snapshot = make_snapshot({"n1": [provider("a"), provider("b")]}, {"m": ["a", "b"]})
    scheduler = online(snapshot)
    lease = await scheduler.acquire("m", "r1", long=False, exclude=frozenset({"a"}))
    assert lease.provider_id == "b"
    with pytest.raises(NoProvider, match="already tried"):
        await scheduler.acquire("m", "r1", long=False, exclude=frozenset({"a", "b"}))


# -- queue -------------------------------------------------------------------------------


async def test_waiters_are_served_in_fifo_order() -> None:
    scheduler = online(ONE)
    held = await scheduler.acquire("m", "holder", long=False)
    order: list[str] = []

    async def client(run_id: str) -> None:
        with await scheduler.acquire("m", run_id, long=False):
            order.append(run_id)

    async with trio.open_nursery() as nursery:
        for run_id in ("w1", "w2", "w3"):
            nursery.start_soon(client, run_id)
            await wait_all_tasks_blocked()
        assert queued(scheduler, "m") == 3
        held.release()
    assert order == ["w1", "w2", "w3"]
    assert in_flight(scheduler, "a") == 0


async def test_new_arrival_does_not_barge_past_the_queue(nursery: trio.Nursery) -> None:
    scheduler = online(ONE)
    held = await scheduler.acquire("m", "holder", long=False)
    first = await start(nursery, scheduler, "m", "first")
    held.release()  # granted to `first` synchronously: the slot is spoken for
    late = await start(nursery, scheduler, "m", "late")
    assert first.lease is not None
    assert late.lease is None
    assert queued(scheduler, "m") == 1
    first.lease.release()
    await late.done.wait()
    assert late.lease is not None
    late.lease.release()


async def test_earlier_waiter_goes_first_even_before_anything_woke_it(
    autojump_clock: MockClock, nursery: trio.Nursery
) -> None:
    """A cooldown end is a matter of time: if a newcomer arrives before `run()` has woken
    the queue (here `run()` is not even started), the earlier waiter still goes first."""
    nodes = {"n1": [provider("a", capacity=1), provider("b", capacity=1)]}
    scheduler = online(make_snapshot(nodes, {"m": ["a", "b"]}, failures=1, cooldown_s=5.0))
    held = await scheduler.acquire("m", "holder", long=False, exclude=frozenset({"a"}))
    scheduler.record_failure("a")
    first = await start(nursery, scheduler, "m", "first")
    autojump_clock.jump(5)
    late = await start(nursery, scheduler, "m", "late")
    assert first.lease is not None
    assert first.lease.provider_id == "a"
    assert not late.done.is_set()
    held.release()
    await late.done.wait()
    assert late.lease is not None
    late.lease.release()
    first.lease.release()


async def test_models_sharing_a_provider_are_served_in_arrival_order() -> None:
    """A busy model must not starve another on the same provider: when the slot frees,
    the earliest waiter of either model goes first, whichever model is listed first."""
    shared = make_snapshot({"n1": [provider("p", capacity=1)]}, {"a": ["p"], "b": ["p"]})
    scheduler = online(shared)
    held = await scheduler.acquire("a", "a1", long=False)
    order: list[str] = []

    async def client(model_id: str, run_id: str) -> None:
        with await scheduler.acquire(model_id, run_id, long=False):
            order.append(run_id)

    async with trio.open_nursery() as nursery:
        for model_id, run_id in (("b", "b1"), ("a", "a2"), ("a", "a3"), ("b", "b2")):
            nursery.start_soon(client, model_id, run_id)
            await wait_all_tasks_blocked()
        assert (queued(scheduler, "a"), queued(scheduler, "b")) == (2, 2)
        held.release()
    assert order == ["b1", "a2", "a3", "b2"]
    assert in_flight(scheduler, "p") == 0


async def test_waiter_that_cannot_use_the_freed_slot_does_not_block_another_model(
    nursery: trio.Nursery,
) -> None:
    shared = make_snapshot(
        {"n1": [provider("p", capacity=2, long_context_slots=1)]}, {"a": ["p"], "b": ["p"]}
    )
    scheduler = online(shared)
    long_run = await scheduler.acquire("a", "l1", long=True)
    regular_run = await scheduler.acquire("b", "r1", long=False)
    long_waiter = await start(nursery, scheduler, "a", "l2", long=True)
    regular_waiter = await start(nursery, scheduler, "b", "r2", long=False)
    regular_run.release()  # a regular slot frees; the earlier long waiter can't use it
    await regular_waiter.done.wait()
    assert regular_waiter.lease is not None
    assert not long_waiter.done.is_set()
    long_run.release()
    regular_waiter.lease.release()
    await long_waiter.done.wait()
    assert long_waiter.lease is not None
    long_waiter.lease.release()


async def test_newcomer_does_not_barge_past_another_models_earlier_waiter(
    autojump_clock: MockClock, nursery: trio.Nursery
) -> None:
    """As above, but the newcomer asks for a different model sharing the provider."""
    nodes = {"n1": [provider("p", capacity=1), provider("q", capacity=1)]}
    scheduler = online(
        make_snapshot(nodes, {"a": ["p"], "b": ["p", "q"]}, failures=1, cooldown_s=5.0)
    )
    held = await scheduler.acquire("b", "holder", long=False, exclude=frozenset({"p"}))
    scheduler.record_failure("p")
    first = await start(nursery, scheduler, "b", "first")
    autojump_clock.jump(5)  # p's trial slot is free, but `run()` has not woken anyone
    late = await start(nursery, scheduler, "a", "late")
    assert first.lease is not None
    assert first.lease.provider_id == "p"
    assert not late.done.is_set()
    scheduler.record_success("p")
    first.lease.release()
    await late.done.wait()
    assert late.lease is not None
    late.lease.release()
    held.release()


async def test_queue_full_is_refused_at_once() -> None:
    snapshot = make_snapshot({"n1": [provider("a", capacity=1)]}, {"m": ["a"]}, max_queue=1)
    scheduler = online(snapshot)
    held = await scheduler.acquire("m", "holder", long=False)
    async with trio.open_nursery() as nursery:
        waiter = await start(nursery, scheduler, "m", "w1")
        with pytest.raises(QueueFull) as refused:
            await scheduler.acquire("m", "w2", long=False)
        assert refused.value.retry_after_s == RETRY_AFTER_BUSY_S
        assert queued(scheduler, "m") == 1
        held.release()
    assert waiter.lease is not None
    waiter.lease.release()


async def test_max_queue_zero_never_queues() -> None:
    snapshot = make_snapshot({"n1": [provider("a", capacity=1)]}, {"m": ["a"]}, max_queue=0)
    scheduler = online(snapshot)
    held = await scheduler.acquire("m", "holder", long=False)
    with pytest.raises(QueueFull):
        await scheduler.acquire("m", "w1", long=False)
    held.release()
    (await scheduler.acquire("m", "w2", long=False)).release()


async def test_queue_timeout(autojump_clock: MockClock) -> None:
    snapshot = make_snapshot(
        {"n1": [provider("a", capacity=1)]}, {"m": ["a"]}, queue_timeout_ms=2000
    )
    scheduler = online(snapshot)
    held = await scheduler.acquire("m", "holder", long=False)
    began = trio.current_time()
    with pytest.raises(QueueTimeout) as timed_out:
        await scheduler.acquire("m", "w1", long=False)
    assert trio.current_time() - began == pytest.approx(2.0)
    assert timed_out.value.retry_after_s == RETRY_AFTER_BUSY_S
    assert queued(scheduler, "m") == 0
    held.release()
    assert in_flight(scheduler, "a") == 0


async def test_queued_time_is_reported_on_the_lease(
    autojump_clock: MockClock, nursery: trio.Nursery
) -> None:
    scheduler = online(ONE)
    held = await scheduler.acquire("m", "holder", long=False)
    waiter = await start(nursery, scheduler, "m", "w1")
    autojump_clock.jump(1.5)  # while the holder runs
    held.release()
    await waiter.done.wait()
    assert waiter.lease is not None
    assert waiter.lease.queued_s == pytest.approx(1.5)
    waiter.lease.release()


@pytest.mark.parametrize(
    ("new_timeout_ms", "expected_s"), [(3000, 3.0), (500, 1.0), (20_000, 20.0)]
)
async def test_new_queue_timeout_applies_to_requests_already_waiting(
    autojump_clock: MockClock, nursery: trio.Nursery, new_timeout_ms: int, expected_s: float
) -> None:
    """The timeout counts from arrival; one already exceeded fires at once."""
    scheduler = online(make_snapshot({"n1": [provider("a", capacity=1)]}, {"m": ["a"]}))
    held = await scheduler.acquire("m", "holder", long=False)
    began = trio.current_time()
    waiter = await start(nursery, scheduler, "m", "w1")
    autojump_clock.jump(1)  # the refresh arrives a second later
    refreshed = make_snapshot(
        {"n1": [provider("a", capacity=1)]},
        {"m": ["a"]},
        revision=2,
        queue_timeout_ms=new_timeout_ms,
    )
    scheduler.apply_snapshot(refreshed)
    await waiter.done.wait()
    assert isinstance(waiter.error, QueueTimeout)
    assert waiter.woke_at is not None
    assert waiter.woke_at - began == pytest.approx(expected_s)
    held.release()


# -- cancellation and release --------------------------------------------------------------


async def test_cancelled_waiter_leaves_nothing_behind(nursery: trio.Nursery) -> None:
    scheduler = online(ONE)
    held = await scheduler.acquire("m", "holder", long=False)
    waiter = await start(nursery, scheduler, "m", "w1")
    assert queued(scheduler, "m") == 1
    waiter.scope.cancel()
    await waiter.done.wait()
    assert waiter.lease is None
    assert waiter.error is None
    assert queued(scheduler, "m") == 0
    held.release()
    assert in_flight(scheduler, "a") == 0
    assert slots(scheduler, "a").holders == ()


async def test_slot_granted_to_a_waiter_being_cancelled_is_given_back(
    nursery: trio.Nursery,
) -> None:
    """The race: the waiter's cancellation is already delivered when a slot frees up and
    is handed to it (it is still first in the queue). It must return that slot, which
    then goes to the next waiter."""
    scheduler = online(ONE)
    held = await scheduler.acquire("m", "holder", long=False)
    doomed = await start(nursery, scheduler, "m", "doomed")
    patient = await start(nursery, scheduler, "m", "patient")
    doomed.scope.cancel()  # delivered, but `doomed` has not run yet ...
    held.release()  # ... when the freed slot is granted to it
    await doomed.done.wait()
    await patient.done.wait()
    assert doomed.lease is None
    assert patient.lease is not None
    assert in_flight(scheduler, "a") == 1
    assert slots(scheduler, "a").holders == (patient.lease,)
    patient.lease.release()
    assert in_flight(scheduler, "a") == 0


async def test_release_is_idempotent_and_in_flight_never_negative() -> None:
    snapshot = make_snapshot(
        {"n1": [provider("a", capacity=2, long_context_slots=1)]}, {"m": ["a"]}
    )
    scheduler = online(snapshot)
    lease = await scheduler.acquire("m", "r1", long=True)
    assert (slots(scheduler, "a").in_flight, slots(scheduler, "a").long_in_flight) == (1, 1)
    with lease:
        pass
    assert (slots(scheduler, "a").in_flight, slots(scheduler, "a").long_in_flight) == (0, 0)
    lease.release()
    lease.release()
    assert (slots(scheduler, "a").in_flight, slots(scheduler, "a").long_in_flight) == (0, 0)
    assert "unknown" not in scheduler.statistics().providers


async def test_cancelled_caller_before_acquire_takes_nothing() -> None:
    scheduler = online(ONE)
    with trio.CancelScope() as scope:
        scope.cancel()
        await scheduler.acquire("m", "r1", long=False)
    assert scope.cancelled_caught
    assert in_flight(scheduler, "a") == 0


# -- refresh -------------------------------------------------------------------------------


async def test_resize_keeps_the_same_slots() -> None:
    """A refresh resizes a provider's slots in place: the runs holding them still count."""
    base = {"n1": [provider("a", capacity=3, long_context_slots=1)]}
    scheduler = online(make_snapshot(base, {"m": ["a"]}))
    held = await scheduler.acquire("m", "r1", long=True)
    scheduler.apply_snapshot(
        make_snapshot({"n1": [provider("a", capacity=5, long_context_slots=None)]}, {"m": ["a"]})
    )
    after = slots(scheduler, "a")
    assert (after.capacity, after.long_capacity) == (5, math.inf)
    assert (after.in_flight, after.long_in_flight, after.holders) == (1, 1, (held,))
    more = [await scheduler.acquire("m", f"r{i}", long=True) for i in range(2, 6)]
    assert slots(scheduler, "a").in_flight == 5  # 4 more, not 5: the first run still counts
    for lease in [held, *more]:
        lease.release()


async def test_shrink_below_borrowed_only_stops_new_admissions(nursery: trio.Nursery) -> None:
    scheduler = online(make_snapshot({"n1": [provider("a", capacity=3)]}, {"m": ["a"]}))
    held = [await scheduler.acquire("m", f"r{i}", long=False) for i in range(3)]
    scheduler.apply_snapshot(
        make_snapshot({"n1": [provider("a", capacity=1)]}, {"m": ["a"]}, revision=2)
    )
    assert in_flight(scheduler, "a") == 3  # runs in flight keep their slots
    waiter = await start(nursery, scheduler, "m", "w1")
    held[0].release()
    held[1].release()
    await wait_all_tasks_blocked()
    assert waiter.lease is None  # 1 borrowed of 1: still full
    held[2].release()
    await waiter.done.wait()
    assert waiter.lease is not None
    assert in_flight(scheduler, "a") == 1
    waiter.lease.release()


async def test_grow_wakes_waiters(nursery: trio.Nursery) -> None:
    scheduler = online(ONE)
    held = await scheduler.acquire("m", "holder", long=False)
    waiters = [await start(nursery, scheduler, "m", f"w{i}") for i in range(3)]
    scheduler.apply_snapshot(
        make_snapshot({"n1": [provider("a", capacity=3)]}, {"m": ["a"]}, revision=2)
    )
    await wait_all_tasks_blocked()
    assert [w.lease is not None for w in waiters] == [True, True, False]
    held.release()
    await waiters[2].done.wait()
    for waiter in waiters:
        assert waiter.lease is not None
        waiter.lease.release()
    assert in_flight(scheduler, "a") == 0


async def test_disabled_provider_finishes_its_runs_but_gets_no_new_ones(
    nursery: trio.Nursery,
) -> None:
    nodes = {"n1": [provider("a", capacity=2), provider("b", capacity=1)]}
    models = {"m": ["a", "b"], "solo": ["a"]}
    scheduler = online(make_snapshot(nodes, models))
    on_a = [await scheduler.acquire("solo", f"a{i}", long=False) for i in range(2)]
    on_b = await scheduler.acquire("m", "b0", long=False, exclude=frozenset({"a"}))
    solo_waiter = await start(nursery, scheduler, "solo", "s1")
    shared_waiter = await start(nursery, scheduler, "m", "w1")
    assert queued(scheduler, "solo") == queued(scheduler, "m") == 1

    disabled = {"n1": [provider("a", capacity=2, enabled=False), provider("b", capacity=1)]}
    scheduler.apply_snapshot(make_snapshot(disabled, models, revision=2))
    await wait_all_tasks_blocked()
    assert isinstance(solo_waiter.error, NoProvider)  # nowhere else to go
    assert solo_waiter.error.reason == "every provider of model 'solo' is disabled"
    assert not shared_waiter.done.is_set()  # b may still serve it

    for lease in on_a:
        lease.release()  # a's runs finish normally ...
    await wait_all_tasks_blocked()
    assert in_flight(scheduler, "a") == 0
    assert not shared_waiter.done.is_set()  # ... and a's free slots are not reused
    on_b.release()
    await shared_waiter.done.wait()
    assert shared_waiter.lease is not None
    assert shared_waiter.lease.provider_id == "b"
    with pytest.raises(NoProvider, match="disabled"):
        await scheduler.acquire("solo", "s2", long=False)
    shared_waiter.lease.release()


async def test_removed_model_fails_its_waiters(nursery: trio.Nursery) -> None:
    scheduler = online(make_snapshot({"n1": [provider("a", capacity=1)]}, {"m": ["a"], "k": ["a"]}))
    held = await scheduler.acquire("m", "holder", long=False)
    waiter = await start(nursery, scheduler, "k", "w1")
    scheduler.apply_snapshot(
        make_snapshot({"n1": [provider("a", capacity=1)]}, {"m": ["a"]}, revision=2)
    )
    await waiter.done.wait()
    assert isinstance(waiter.error, UnknownModel)
    assert "k" not in scheduler.statistics().queued
    held.release()


async def test_removed_provider_lease_release_does_not_crash() -> None:
    nodes = {"n1": [provider("a", capacity=1), provider("b", capacity=1)]}
    scheduler = online(make_snapshot(nodes, {"m": ["a", "b"]}))
    lease = await scheduler.acquire("m", "r1", long=True)
    assert lease.provider_id == "a"
    scheduler.apply_snapshot(
        make_snapshot({"n1": [provider("b", capacity=1)]}, {"m": ["b"]}, revision=2)
    )
    assert [p.id for p in scheduler.catalog().providers] == ["b"]
    removed = slots(scheduler, "a")
    assert (removed.removed, removed.in_flight) == (True, 1)  # still held, still counted
    lease.release()
    lease.release()
    assert "a" not in scheduler.statistics().providers  # forgotten with its last lease


async def test_readded_provider_keeps_its_slots_while_leases_linger() -> None:
    nodes = {"n1": [provider("a", capacity=1)]}
    scheduler = online(make_snapshot(nodes, {"m": ["a"]}))
    lease = await scheduler.acquire("m", "r1", long=False)
    scheduler.apply_snapshot(make_snapshot({"n1": []}, {}, revision=2))
    scheduler.apply_snapshot(make_snapshot(nodes, {"m": ["a"]}, revision=3))
    scheduler.config_applied("n1", 3)  # its Node has it again
    assert slots(scheduler, "a").holders == (lease,)  # concurrency never doubles ...
    scheduler.apply_snapshot(make_snapshot(nodes, {"m": ["a"]}, revision=4, max_queue=0))
    with pytest.raises(QueueFull):
        await scheduler.acquire("m", "r2", long=False)  # ... the old run still counts
    lease.release()
    (await scheduler.acquire("m", "r3", long=False)).release()


async def test_a_held_provider_follows_its_node_across_swaps_until_released() -> None:
    """A provider removed while a run holds it still goes with its node (connects and
    disconnects reach it), stays held through later swaps without it, is configured
    again when put back, and is forgotten with its last lease."""
    nodes = {"n1": [provider("a", capacity=1), provider("b", capacity=1)]}
    scheduler = online(make_snapshot(nodes, {"m": ["a", "b"]}))
    lease = await scheduler.acquire("m", "r1", long=False)
    assert lease.provider_id == "a"
    without_a = {"n1": [provider("b", capacity=1)]}
    scheduler.apply_snapshot(make_snapshot(without_a, {"m": ["b"]}, revision=2))
    scheduler.apply_snapshot(make_snapshot(without_a, {"m": ["b"]}, revision=3))
    assert slots(scheduler, "a").removed  # held once, not twice
    scheduler.node_disconnected("n1")  # reaches the held provider: its health is reset
    scheduler.node_connected("n1")
    scheduler.provider_status("b", "available", [served("b")])
    scheduler.apply_snapshot(make_snapshot(nodes, {"m": ["a", "b"]}, revision=4))
    health = {p.id: p.health for p in scheduler.catalog().providers}
    assert health == {"a": "unknown", "b": "available"}  # not the "available" it had
    assert not slots(scheduler, "a").removed and slots(scheduler, "a").holders == (lease,)
    scheduler.apply_snapshot(make_snapshot(without_a, {"m": ["b"]}, revision=5))
    lease.release()
    assert "a" not in scheduler.statistics().providers
    scheduler.node_disconnected("n1")  # nothing of "a" is left on its node
    assert [p.health for p in scheduler.catalog().providers] == ["unavailable"]


async def test_a_swap_gives_every_provider_its_new_config_and_node_at_once() -> None:
    """The states read their config and Node through the running snapshot's lookups:
    a swap that changes every provider (and moves one, its config object unchanged, to
    another Node) is seen whole by the next decision and the next Node event."""
    a, b = provider("a", capacity=1), provider("b", capacity=1)
    scheduler = online(make_snapshot({"n1": [a], "n2": [b]}, {"m": ["a", "b"]}))
    first = await scheduler.acquire("m", "r1", long=False)
    second = await scheduler.acquire("m", "r2", long=False)
    assert {first.provider_id, second.provider_id} == {"a", "b"}  # one slot each: full
    wider = make_snapshot(
        {"n1": [], "n2": [a, provider("b", capacity=3)]}, {"m": ["a", "b"]}, revision=2
    )
    scheduler.apply_snapshot(wider)
    third = await scheduler.acquire("m", "r3", long=False)  # b's new slots, at once
    assert (third.provider_id, third.node_id) == ("b", "n2")
    scheduler.node_disconnected("n1")  # a is on n2 now: n1 going takes nothing of it
    assert {p.id: p.health for p in scheduler.catalog().providers} == {
        "a": "available",
        "b": "available",
    }
    for lease in (first, second, third):
        lease.release()
    moved = await scheduler.acquire("m", "r4", long=False)
    assert moved.node_id == "n2"


def big_snapshot(revision: int, *, big_on: Sequence[str]) -> Snapshot:
    """`m` on providers `a` (node n1) and `b` (node n2), by their own names; `m2` on each
    provider of `big_on`, by the name `big`, which those serve besides their own."""

    def one(pid: str) -> ProviderConfig:
        names = [served(pid), *(["big"] if pid in big_on else [])]
        return ProviderConfig(id=pid, type="sim", models=names, capacity=1)

    models = [ModelEntry(id="m", providers={"a": served("a"), "b": served("b")})]
    if big_on:
        models.append(ModelEntry(id="m2", providers=dict.fromkeys(big_on, "big")))
    config = EdgeConfig(
        dispatch=DispatchSection(max_queue=8, queue_timeout_ms=10_000),
        models=models,
        nodes=[
            NodeEntry(id=nid, token_hash_sha256=HASH, providers=[one(pid)])
            for nid, pid in (("n1", "a"), ("n2", "b"))
        ],
    )
    return Snapshot.build(config, revision=revision, config_sha256=HASH)


async def test_a_model_a_refresh_gives_a_provider_waits_for_its_node_to_apply_it(
    nursery: trio.Nursery,
) -> None:
    scheduler = online(big_snapshot(1, big_on=()))
    scheduler.apply_snapshot(big_snapshot(2, big_on=("a",)))
    waiter = await start(nursery, scheduler, "m2", "w")
    assert (waiter.lease, waiter.error, queued(scheduler, "m2")) == (None, None, 1)
    held = await scheduler.acquire("m", "r", long=False)  # what `a` served before runs on
    held.release()
    scheduler.config_applied("n2", 2)  # another Node
    scheduler.config_applied("n1", 1)  # an older revision
    await wait_all_tasks_blocked()
    assert waiter.lease is None
    scheduler.config_applied("n1", 2)
    await waiter.done.wait()
    assert waiter.lease is not None
    assert (waiter.lease.provider_id, waiter.lease.target) == ("a", "big")
    waiter.lease.release()


async def test_a_provider_that_served_the_model_already_takes_its_runs_meanwhile(
    nursery: trio.Nursery,
) -> None:
    scheduler = online(big_snapshot(1, big_on=("b",)))
    scheduler.apply_snapshot(big_snapshot(2, big_on=("a", "b")))
    first = await scheduler.acquire("m2", "r1", long=False)
    assert first.provider_id == "b"
    second = await start(nursery, scheduler, "m2", "r2")  # `b` is full, `a` pending
    assert second.lease is None and second.error is None
    scheduler.config_applied("n1", 2)
    await second.done.wait()
    assert second.lease is not None and second.lease.provider_id == "a"
    for lease in (first, second.lease):
        lease.release()


async def test_a_node_that_refuses_the_config_leaves_the_model_out_until_it_applies_one(
    nursery: trio.Nursery,
) -> None:
    scheduler = online(big_snapshot(1, big_on=()))
    scheduler.apply_snapshot(big_snapshot(2, big_on=("a",)))
    waiter = await start(nursery, scheduler, "m2", "w")
    scheduler.config_refused("n1", 2)
    await waiter.done.wait()
    refused = "every provider of model 'm2' is on a node that refused the config that gives it"
    assert isinstance(waiter.error, NoProvider)
    assert waiter.error.reason.startswith(refused)
    with pytest.raises(NoProvider):
        await scheduler.acquire("m2", "again", long=False)
    held = await scheduler.acquire("m", "r", long=False)  # the Node runs its older config
    held.release()
    scheduler.apply_snapshot(big_snapshot(3, big_on=("a",)))  # adds nothing: still refused
    with pytest.raises(NoProvider):
        await scheduler.acquire("m2", "still", long=False)
    scheduler.config_applied("n1", 3)  # the catch-up's push of the running config
    lease = await scheduler.acquire("m2", "at-last", long=False)
    assert lease.provider_id == "a"
    lease.release()


# -- nodes and health ------------------------------------------------------------------


async def test_node_disconnect_fails_waiters_that_have_nowhere_else_to_go(
    nursery: trio.Nursery,
) -> None:
    nodes = {"n1": [provider("a", capacity=1)], "n2": [provider("b", capacity=1)]}
    scheduler = online(make_snapshot(nodes, {"x": ["a"], "y": ["a", "b"]}))
    held_a = await scheduler.acquire("x", "ha", long=False)
    held_b = await scheduler.acquire("y", "hb", long=False)
    assert held_b.provider_id == "b"
    only_a = await start(nursery, scheduler, "x", "w-x")
    either = await start(nursery, scheduler, "y", "w-y")
    scheduler.node_disconnected("n1")
    await wait_all_tasks_blocked()
    assert isinstance(only_a.error, NoProvider)
    assert only_a.error.reason == "no provider of model 'x' is connected"
    assert not either.done.is_set()
    held_a.release()  # the lost node's run ends; its slot serves nobody
    await wait_all_tasks_blocked()
    assert not either.done.is_set()
    held_b.release()
    await either.done.wait()
    assert either.lease is not None
    assert either.lease.provider_id == "b"
    with pytest.raises(NoProvider, match="is connected"):
        await scheduler.acquire("x", "late", long=False)


async def test_a_node_event_reaches_the_providers_on_that_node_after_a_refresh() -> None:
    """Connects and disconnects reach exactly the node's providers, as the latest
    snapshot places them, including a removed one whose run is still out."""
    nodes = {"n1": [provider("a"), provider("gone")], "n2": [provider("b")]}
    scheduler = online(make_snapshot(nodes, {"m": ["a", "b", "gone"]}))
    held = await scheduler.acquire("m", "held", long=False, exclude=frozenset({"a", "b"}))
    assert held.provider_id == "gone"
    moved = {"n1": [], "n2": [provider("b"), provider("a")]}  # `a` moves, `gone` goes
    scheduler.apply_snapshot(make_snapshot(moved, {"m": ["a", "b"]}, revision=2))
    scheduler.node_disconnected("n1")
    health = {p.id: p.health for p in scheduler.catalog().providers}
    assert health == {"a": "available", "b": "available"}
    scheduler.node_disconnected("n2")
    scheduler.node_connected("n2")
    health = {p.id: p.health for p in scheduler.catalog().providers}
    assert health == {"a": "unknown", "b": "unknown"}
    held.release()  # the removed provider is forgotten with its last lease ...
    assert "gone" not in scheduler.statistics().providers
    scheduler.node_connected("n1")  # ... and its old node's events find nothing of it
    scheduler.node_disconnected("n1")


async def test_fresh_node_waits_for_its_first_status(nursery: trio.Nursery) -> None:
    scheduler = Scheduler(ONE)
    with pytest.raises(NoProvider, match="is connected"):
        await scheduler.acquire("m", "r0", long=False)
    scheduler.node_connected("n1")
    assert scheduler.catalog().providers[0].health == "unknown"
    waiter = await start(nursery, scheduler, "m", "r1")
    assert not waiter.done.is_set()
    scheduler.provider_status("a", "available", ["a-served"])
    await waiter.done.wait()
    assert waiter.lease is not None
    waiter.lease.release()


async def test_unavailable_status_refuses_and_recovers(nursery: trio.Nursery) -> None:
    scheduler = online(ONE)
    held = await scheduler.acquire("m", "holder", long=False)
    waiter = await start(nursery, scheduler, "m", "w1")
    scheduler.provider_status("a", "unavailable", [])
    await waiter.done.wait()
    assert isinstance(waiter.error, NoProvider)
    assert waiter.error.reason == "no provider of model 'm' is available"
    held.release()
    scheduler.provider_status("a", "available", ["a-served"])
    (await scheduler.acquire("m", "r2", long=False)).release()


# -- long-context slots ---------------------------------------------------------------------


async def test_long_runs_hold_a_long_slot_and_a_regular_slot(nursery: trio.Nursery) -> None:
    scheduler = online(
        make_snapshot({"n1": [provider("a", capacity=3, long_context_slots=1)]}, {"m": ["a"]})
    )
    first_long = await scheduler.acquire("m", "l1", long=True)
    assert first_long.long
    assert (slots(scheduler, "a").in_flight, slots(scheduler, "a").long_in_flight) == (1, 1)
    second_long = await start(nursery, scheduler, "m", "l2", long=True)
    assert not second_long.done.is_set()
    regular = await scheduler.acquire("m", "r1", long=False)  # regular slots still free
    first_long.release()
    await second_long.done.wait()
    assert second_long.lease is not None
    second_long.lease.release()
    regular.release()


async def test_long_waiter_does_not_block_regular_waiters_behind_it(
    nursery: trio.Nursery,
) -> None:
    scheduler = online(
        make_snapshot({"n1": [provider("a", capacity=2, long_context_slots=1)]}, {"m": ["a"]})
    )
    long_run = await scheduler.acquire("m", "l1", long=True)
    regular_run = await scheduler.acquire("m", "r1", long=False)
    long_waiter = await start(nursery, scheduler, "m", "l2", long=True)
    regular_waiter = await start(nursery, scheduler, "m", "r2", long=False)
    regular_run.release()  # a regular slot frees; the long waiter at the head can't use it
    await regular_waiter.done.wait()
    assert regular_waiter.lease is not None
    assert not long_waiter.done.is_set()
    long_run.release()
    regular_waiter.lease.release()
    await long_waiter.done.wait()
    assert long_waiter.lease is not None
    long_waiter.lease.release()


async def test_long_slots_zero_refuses_long_runs_and_null_needs_only_a_regular_slot() -> None:
    nodes = {"n1": [provider("z", capacity=2, long_context_slots=0), provider("u", capacity=1)]}
    scheduler = online(make_snapshot(nodes, {"zero": ["z"], "any": ["z", "u"], "null": ["u"]}))
    with pytest.raises(NoProvider, match="accepts long-context runs"):
        await scheduler.acquire("zero", "l1", long=True)
    regular = await scheduler.acquire("zero", "r1", long=False)
    assert regular.provider_id == "z"
    routed = await scheduler.acquire("any", "l2", long=True)
    assert routed.provider_id == "u"  # z takes no long runs, even though it is idler
    routed.release()
    unbounded = await scheduler.acquire("null", "l3", long=True)
    assert unbounded.provider_id == "u"
    catalog = {p.id: p for p in scheduler.catalog().providers}
    assert (catalog["u"].long_context_slots, catalog["u"].long_in_flight) == (None, 1)
    unbounded.release()
    regular.release()


# -- passive health ----------------------------------------------------------------------


async def test_cooldown_then_exactly_one_trial_run(
    autojump_clock: MockClock, nursery: trio.Nursery
) -> None:
    scheduler = online(
        make_snapshot({"n1": [provider("a", capacity=4)]}, {"m": ["a"]}, cooldown_s=5.0)
    )
    await nursery.start(scheduler.run)
    began = trio.current_time()
    scheduler.record_failure("a")
    (await scheduler.acquire("m", "r0", long=False)).release()  # 1 of 2: still in
    scheduler.record_failure("a")
    with pytest.raises(NoProvider, match="cooling down") as refused:
        await scheduler.acquire("m", "r1", long=False)
    assert refused.value.retry_after_s == pytest.approx(5.0)
    assert scheduler.catalog().providers[0].cooling_down

    autojump_clock.jump(5)  # the cooldown runs out
    trial = await scheduler.acquire("m", "trial", long=False)
    assert trio.current_time() - began == pytest.approx(5.0)
    behind = await start(nursery, scheduler, "m", "behind")
    assert not behind.done.is_set()  # one trial at a time, although slots are free
    scheduler.record_success("a")
    trial.release()
    await behind.done.wait()
    assert behind.lease is not None
    extra = await scheduler.acquire("m", "extra", long=False)  # closed again: full capacity
    behind.lease.release()
    extra.release()
    provider_record = scheduler.catalog().providers[0]
    assert not provider_record.cooling_down
    assert provider_record.consecutive_failures == 0


async def test_failed_trial_cools_down_again(
    autojump_clock: MockClock, nursery: trio.Nursery
) -> None:
    scheduler = online(make_snapshot({"n1": [provider("a")]}, {"m": ["a"]}, failures=1))
    await nursery.start(scheduler.run)
    scheduler.record_failure("a")
    autojump_clock.jump(5)
    with await scheduler.acquire("m", "trial", long=False):
        scheduler.record_failure("a")
    with pytest.raises(NoProvider, match="cooling down"):
        await scheduler.acquire("m", "r1", long=False)


async def test_inconclusive_trial_lets_another_run_be_the_trial(
    autojump_clock: MockClock, nursery: trio.Nursery
) -> None:
    scheduler = online(make_snapshot({"n1": [provider("a")]}, {"m": ["a"]}, failures=1))
    await nursery.start(scheduler.run)
    scheduler.record_failure("a")
    autojump_clock.jump(5)
    trial = await scheduler.acquire("m", "trial", long=False)
    waiter = await start(nursery, scheduler, "m", "w1")
    scheduler.record_capacity_signal("a")  # no verdict
    trial.release()
    await waiter.done.wait()
    assert waiter.lease is not None  # the next run is the new trial
    assert scheduler.catalog().providers[0].consecutive_failures == 1
    waiter.lease.release()


async def test_cooldown_end_wakes_waiters_without_polling(
    autojump_clock: MockClock, nursery: trio.Nursery
) -> None:
    """`a` cools down while `b` is busy: the waiter stays queued (b could serve it) and is
    handed `a`'s trial slot the moment the cooldown ends."""
    nodes = {"n1": [provider("a", capacity=2), provider("b", capacity=1)]}
    scheduler = online(make_snapshot(nodes, {"m": ["a", "b"]}, failures=1, cooldown_s=5.0))
    await nursery.start(scheduler.run)
    held = await scheduler.acquire("m", "hb", long=False, exclude=frozenset({"a"}))
    began = trio.current_time()
    scheduler.record_failure("a")
    waiter = await start(nursery, scheduler, "m", "w1")
    assert not waiter.done.is_set()
    await waiter.done.wait()
    assert waiter.woke_at is not None
    assert waiter.woke_at - began == pytest.approx(5.0)
    assert waiter.lease is not None
    assert waiter.lease.provider_id == "a"
    waiter.lease.release()
    held.release()


async def test_cooldown_start_fails_waiters_with_no_other_provider(nursery: trio.Nursery) -> None:
    scheduler = online(make_snapshot({"n1": [provider("a", capacity=1)]}, {"m": ["a"]}, failures=1))
    held = await scheduler.acquire("m", "holder", long=False)
    waiter = await start(nursery, scheduler, "m", "w1")
    scheduler.record_failure("a")
    await waiter.done.wait()
    assert isinstance(waiter.error, NoProvider)
    assert waiter.error.retry_after_s is not None
    held.release()


async def test_capacity_signals_are_not_health_failures() -> None:
    scheduler = online(make_snapshot({"n1": [provider("a")]}, {"m": ["a"]}, failures=2))
    for _ in range(5):
        scheduler.record_capacity_signal("a")
    (await scheduler.acquire("m", "r1", long=False)).release()
    record = scheduler.catalog().providers[0]
    assert (record.cooling_down, record.consecutive_failures) == (False, 0)


async def test_retry_after_rests_the_provider_until_it_ends(
    autojump_clock: MockClock, nursery: trio.Nursery
) -> None:
    """An upstream's Retry-After takes its provider out of the pool that long (pool Rule
    9): a run refused meanwhile hears when it is back; a waiter for another provider is
    handed it the moment the rest ends; and no failure is counted."""
    nodes = {"n1": [provider("a", capacity=2), provider("b", capacity=1)]}
    scheduler = online(make_snapshot(nodes, {"m": ["a", "b"], "only-a": ["a"]}, failures=1))
    await nursery.start(scheduler.run)
    began = trio.current_time()
    scheduler.record_capacity_signal("a", 8.0)
    scheduler.record_capacity_signal("a", 3.0)  # a rest only grows
    with pytest.raises(NoProvider, match="rate-limited by its upstream") as refused:
        await scheduler.acquire("only-a", "r1", long=False)
    assert refused.value.retry_after_s == pytest.approx(8.0)
    record = next(p for p in scheduler.catalog().providers if p.id == "a")
    assert record.rate_limited_s == pytest.approx(8.0)
    assert record.health_reason == "rate-limited by its upstream for 8 s more"
    held = await scheduler.acquire("m", "hb", long=False)
    assert held.provider_id == "b"
    waiter = await start(nursery, scheduler, "m", "w1")
    await waiter.done.wait()
    assert waiter.woke_at is not None
    assert waiter.woke_at - began == pytest.approx(8.0)
    assert waiter.lease is not None
    assert waiter.lease.provider_id == "a"
    record = next(p for p in scheduler.catalog().providers if p.id == "a")
    assert (record.rate_limited_s, record.cooling_down, record.consecutive_failures) == (
        None,
        False,
        0,
    )
    waiter.lease.release()
    held.release()


async def test_retry_after_is_capped(autojump_clock: MockClock) -> None:
    scheduler = online(make_snapshot({"n1": [provider("a")]}, {"m": ["a"]}))
    scheduler.record_capacity_signal("a", 86_400.0)  # a daily quota
    with pytest.raises(NoProvider) as refused:
        await scheduler.acquire("m", "r1", long=False)
    assert refused.value.retry_after_s == pytest.approx(MAX_REST_S)
    scheduler.record_capacity_signal("a", 0.0)  # said nothing usable: no rest
    autojump_clock.jump(MAX_REST_S)
    (await scheduler.acquire("m", "r2", long=False)).release()


async def test_success_resets_the_consecutive_failure_count() -> None:
    scheduler = online(make_snapshot({"n1": [provider("a")]}, {"m": ["a"]}, failures=2))
    scheduler.record_failure("a")
    scheduler.record_success("a")
    scheduler.record_failure("a")
    (await scheduler.acquire("m", "r1", long=False)).release()
    assert scheduler.catalog().providers[0].consecutive_failures == 1
    scheduler.record_failure("unknown-provider")  # ignored, not a crash
    scheduler.record_success("unknown-provider")


# -- catalog -------------------------------------------------------------------------------


async def test_catalog_reports_every_field(nursery: trio.Nursery) -> None:
    nodes = {
        "n2": [
            provider("b", capacity=4, long_context_slots=2, priority=5, lifecycle=["list_models"])
        ],
        "n1": [provider("a", capacity=1, enabled=False)],
    }
    snapshot = make_snapshot(nodes, {"m2": ["b"], "m1": ["b", "a"]}, revision=7)
    scheduler = Scheduler(snapshot)
    scheduler.node_connected("n2")
    scheduler.provider_status("b", "available", ["b-served", "extra"])
    leases = [await scheduler.acquire("m2", f"r{i}", long=i == 0) for i in range(4)]
    waiter = await start(nursery, scheduler, "m1", "w1")

    catalog = scheduler.catalog()
    assert catalog.revision == 7
    assert [m.id for m in catalog.models] == ["m1", "m2"]
    assert catalog.models[0].display_name == "M1"
    assert catalog.models[0].providers == {"a": "a-served", "b": "b-served"}
    assert (catalog.models[0].queued, catalog.models[1].queued) == (1, 0)
    a, b = catalog.providers
    assert (a.id, a.node_id, a.connected, a.health, a.enabled) == (
        "a",
        "n1",
        False,
        "unavailable",
        False,
    )
    assert (a.in_flight, a.load_ratio, a.queued) == (0, 0.0, 1)
    assert b.type == "sim"
    assert b.category == "local_inference"
    assert (b.connected, b.health, b.capacity, b.in_flight, b.load_ratio) == (
        True,
        "available",
        4,
        4,
        1.0,
    )
    assert (b.long_context_slots, b.long_in_flight, b.priority, b.queued) == (2, 1, 5, 1)
    assert b.models == ["b-served"]
    assert b.discovered_models == ["b-served", "extra"]
    assert b.lifecycle.list_models
    assert not (b.lifecycle.load_model or b.lifecycle.pull_model or b.lifecycle.delete_model)
    assert b.discovered_lifecycle is None  # the node did not say
    assert (b.cooling_down, b.consecutive_failures) == (False, 0)

    encoded = msgspec.json.decode(msgspec.json.encode(catalog))
    assert encoded["providers"][0]["models"] == ["a-served"]
    assert encoded["providers"][0]["discovered_models"] == []

    waiter.scope.cancel()
    for lease in leases:
        lease.release()
    scheduler.node_disconnected("n2")
    assert scheduler.catalog().providers[1].health == "unavailable"


async def test_observers_wake_on_every_change(nursery: trio.Nursery) -> None:
    scheduler = online(ONE)
    changes: list[int] = []

    async def observer() -> None:
        while True:
            await scheduler.wait_changed()
            changes.append(in_flight(scheduler, "a"))

    nursery.start_soon(observer)
    await wait_all_tasks_blocked()
    lease = await scheduler.acquire("m", "r1", long=False)
    await wait_all_tasks_blocked()
    waiter = await start(nursery, scheduler, "m", "w1")  # enqueued
    lease.release()  # granted to the waiter
    await waiter.done.wait()
    await wait_all_tasks_blocked()
    assert changes == [1, 1, 1]
    assert waiter.lease is not None
    waiter.lease.release()
    await wait_all_tasks_blocked()
    assert changes[-1] == 0


# -- stress ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What one simulated client will do, drawn up front so runs are reproducible."""

    run_id: str
    model_id: str
    long: bool
    arrive_s: float
    patience_s: float
    work_s: float
    verdict: str


async def test_random_acquire_release_cancel_never_leaks_a_slot(
    autojump_clock: MockClock,
) -> None:
    """Hundreds of clients with random timing, cancellation and outcomes, while config
    refreshes, nodes drop and providers flap. Afterwards every slot is back."""
    rng = random.Random(4242)
    models = {"m1": ["a", "b", "c"], "m2": ["b", "c"], "m3": ["a"]}

    def variant(revision: int) -> Snapshot:
        present_c = revision % 5 != 4  # sometimes c is removed from config
        nodes = {
            "n1": [
                provider(
                    "a", capacity=rng.randint(1, 3), long_context_slots=rng.choice([None, 0, 1])
                ),
                provider("b", capacity=rng.randint(1, 4), enabled=rng.random() > 0.2),
            ],
            "n2": [provider("c", capacity=rng.randint(1, 2), long_context_slots=1)]
            if present_c
            else [],
        }
        routed = {m: [p for p in pids if present_c or p != "c"] for m, pids in models.items()}
        return make_snapshot(
            nodes,
            {m: pids for m, pids in routed.items() if pids},
            revision=revision,
            max_queue=rng.randint(0, 12),
            queue_timeout_ms=rng.randint(200, 3000),
            failures=3,
            cooldown_s=1.0,
        )

    plans = [
        Plan(
            run_id=f"r{i}",
            model_id=rng.choice(list(models)),
            long=rng.random() < 0.3,
            arrive_s=rng.random() * 15,
            patience_s=rng.choice([0.05, 0.5, 2.0, 60.0]),
            work_s=rng.random() * 1.5,
            verdict=rng.choice(["success"] * 4 + ["failure", "capacity"]),
        )
        for i in range(400)
    ]
    scheduler = online(variant(1))
    outcomes: Counter[str] = Counter()

    async def client(plan: Plan) -> None:
        await trio.sleep(plan.arrive_s)  # arrival, on the virtual clock
        with trio.move_on_after(plan.patience_s) as scope:
            try:
                lease = await scheduler.acquire(plan.model_id, plan.run_id, long=plan.long)
            except AdmissionError as error:
                outcomes[type(error).__name__] += 1
                return
            with lease:
                outcomes["served"] += 1
                await trio.sleep(plan.work_s)  # the run itself, on the virtual clock
                match plan.verdict:
                    case "success":
                        scheduler.record_success(lease.provider_id)
                    case "failure":
                        scheduler.record_failure(lease.provider_id)
                    case _:
                        scheduler.record_capacity_signal(lease.provider_id)
                lease.release()  # and `with` releases it again: must be harmless
        if scope.cancelled_caught:
            outcomes["cancelled"] += 1

    async def chaos() -> None:
        for step in range(60):
            await trio.sleep(rng.random() * 0.5)
            match rng.choice(["refresh", "refresh", "drop", "connect", "connect", "status"]):
                case "refresh":
                    scheduler.apply_snapshot(variant(step + 2))
                case "drop":
                    scheduler.node_disconnected(rng.choice(["n1", "n2"]))
                case "connect":
                    node_id = rng.choice(["n1", "n2"])
                    scheduler.node_connected(node_id)
                    for pid in ("a", "b") if node_id == "n1" else ("c",):
                        scheduler.provider_status(pid, "available", [served(pid)])
                case _:
                    health: list[Health] = ["available", "available", "available", "unavailable"]
                    scheduler.provider_status(rng.choice("abc"), rng.choice(health), [])

    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        async with trio.open_nursery() as clients:
            clients.start_soon(chaos)
            for plan in plans:
                clients.start_soon(client, plan)
        nursery.cancel_scope.cancel()

    assert outcomes["served"] > 50
    assert outcomes["cancelled"] > 0
    assert sum(outcomes.values()) - outcomes["served"] > 0
    # Every slot is back, on the providers of the last snapshot and on any removed one a
    # leaked lease would keep around.
    for pid, held in scheduler.statistics().providers.items():
        assert (held.in_flight, held.long_in_flight, held.holders) == (0, 0, ()), pid
        assert not held.removed, pid
    catalog = scheduler.catalog()
    assert all(p.in_flight == 0 and p.long_in_flight == 0 for p in catalog.providers)
    assert all(m.queued == 0 for m in catalog.models)


async def test_catalog_shows_the_lifecycle_the_node_reported() -> None:
    snapshot = make_snapshot({"n1": [provider("a", capacity=1, lifecycle=["list_models"])]}, {})
    scheduler = Scheduler(snapshot)
    scheduler.node_connected("n1")
    scheduler.provider_status("a", "available", ["a-served"], ["list_models", "pull_model"])
    (listed,) = scheduler.catalog().providers
    assert listed.lifecycle.list_models and not listed.lifecycle.pull_model  # configured
    assert listed.discovered_lifecycle is not None
    assert listed.discovered_lifecycle.pull_model and not listed.discovered_lifecycle.load_model

    scheduler.node_disconnected("n1")  # what a gone node said is no longer known
    (listed,) = scheduler.catalog().providers
    assert listed.discovered_lifecycle is None


# -- other Edges sharing the provider's Node (design §13) ---------------------------------


async def test_runs_other_edges_hold_count_against_capacity() -> None:
    snapshot = make_snapshot(
        {"n1": [provider("a", capacity=4), provider("b", capacity=4)]}, {"m": ["a", "b"]}
    )
    scheduler = online(snapshot)
    scheduler.provider_load("a", 3, 0)  # another Edge holds 3 of a's 4 slots
    picks = [(await scheduler.acquire("m", f"r{i}", long=False)).provider_id for i in range(5)]
    # b fills to 3/4 before a (3/4 already) gets a turn; a's last slot is the 5th pick
    assert sorted(picks) == ["a", "b", "b", "b", "b"]
    [a] = [p for p in scheduler.catalog().providers if p.id == "a"]
    assert (a.in_flight, a.other_edges_in_flight, a.load_ratio) == (4, 3, 1.0)


async def test_a_load_report_counts_at_most_the_providers_capacity() -> None:
    """A Node's absurd or negative report fills the provider no more than full, and
    shows as a real load."""
    snapshot = make_snapshot({"n1": [provider("a", capacity=4)]}, {"m": ["a"]})
    scheduler = online(snapshot)
    scheduler.provider_load("a", 2**64 - 1, 2**64 - 1)
    [a] = scheduler.catalog().providers
    assert (a.in_flight, a.other_edges_in_flight, a.load_ratio) == (4, 4, 1.0)
    scheduler.provider_load("a", -5, -5)
    [a] = scheduler.catalog().providers
    assert (a.in_flight, a.other_edges_in_flight) == (0, 0)


async def test_a_load_report_that_frees_slots_wakes_the_queue(nursery: trio.Nursery) -> None:
    scheduler = online(ONE)
    scheduler.provider_load("a", 1, 0)
    waiting = await start(nursery, scheduler, "m", "r1")
    assert not waiting.done.is_set() and scheduler.statistics().queued["m"] == 1
    scheduler.provider_load("a", 0, 0)
    await wait_all_tasks_blocked()
    assert waiting.lease is not None and waiting.lease.provider_id == "a"


async def test_long_runs_of_other_edges_count_against_long_slots(nursery: trio.Nursery) -> None:
    snapshot = make_snapshot(
        {"n1": [provider("a", capacity=4, long_context_slots=1)]}, {"m": ["a"]}
    )
    scheduler = online(snapshot)
    scheduler.provider_load("a", 1, 1)
    waiting = await start(nursery, scheduler, "m", "long", long=True)
    assert not waiting.done.is_set()
    short = await scheduler.acquire("m", "short", long=False)  # regular slots are free
    assert short.provider_id == "a"
    scheduler.provider_load("a", 0, 0)
    await wait_all_tasks_blocked()
    assert waiting.lease is not None


async def test_busy_counts_the_provider_full_until_the_next_load_report(
    nursery: trio.Nursery,
) -> None:
    snapshot = make_snapshot({"n1": [provider("a", capacity=2)]}, {"m": ["a"]})
    scheduler = online(snapshot)
    scheduler.provider_saturated("a")  # the node said `busy`: another Edge took the slots
    waiting = await start(nursery, scheduler, "m", "r1")
    assert not waiting.done.is_set()
    scheduler.provider_load("a", 1, 0)  # the report that follows every `busy`
    await wait_all_tasks_blocked()
    assert waiting.lease is not None


async def test_what_other_edges_hold_is_forgotten_with_the_node(nursery: trio.Nursery) -> None:
    scheduler = online(ONE)
    scheduler.provider_load("a", 1, 0)
    scheduler.provider_saturated("a")
    scheduler.node_disconnected("n1")
    scheduler.node_connected("n1")
    scheduler.provider_status("a", "available", [served("a")])
    with await scheduler.acquire("m", "r1", long=False) as lease:
        assert lease.provider_id == "a"
    [a] = scheduler.catalog().providers
    assert a.other_edges_in_flight == 0


async def test_a_nodes_status_serves_the_waiters_once_after_all_its_providers(
    nursery: trio.Nursery,
) -> None:
    """Within `reports` (a Node's status about each of its providers) the waiters are not
    offered a slot after each provider's report but once, at the end, with the pool as
    the whole status left it."""
    nodes = {"n1": [provider("a", capacity=1), provider("b", capacity=1)]}
    scheduler = online(make_snapshot(nodes, {"m": ["a", "b"]}))
    scheduler.provider_status("b", "unavailable", [])
    held = await scheduler.acquire("m", "r1", long=False)
    attempt = await start(nursery, scheduler, "m", "r2")
    assert held.provider_id == "a" and queued(scheduler, "m") == 1  # a is full
    with scheduler.reports():
        scheduler.provider_status("a", "available", [served("a")])
        scheduler.provider_status("b", "available", [served("b")])
        assert queued(scheduler, "m") == 1  # not served yet: after the last report
    assert queued(scheduler, "m") == 0
    await attempt.done.wait()
    assert attempt.lease is not None and attempt.lease.provider_id == "b"
