"""Fair queueing between principals: the queue itself (`fair_queue`), then the scheduler
sharing a saturated model with it (design §15).

The scheduler tests build their pool as the fair-share benchmark does
(`bench.fair_share.one_model_pool`: one model on one Node's provider), so the benchmark
measures the pool these tests check. They run on virtual time (`autojump_clock`): every
run holds its slot for exactly `RUN_S`, as the sim provider's fixed run time would, so
waits are measured in runs, not in a machine's speed.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from itertools import count

import pytest
import trio
from trio.testing import MockClock, wait_all_tasks_blocked

from bench.fair_share import one_model_pool, work_share
from iop_edge.core.routing.run_work import EXPECTED_OUTPUT_CAP, run_work
from iop_edge.runtime.runs.admission_errors import ConcurrencyLimited, QueueTimeout
from iop_edge.runtime.runs.fair_queue import FairQueue
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas.config import PrincipalLimits

_seq = count()


@dataclass(eq=False)
class Item:
    principal: str
    seq: int = field(default_factory=lambda: next(_seq))
    kind: str = "chat"
    work: int = 1


def drain(queue: FairQueue[Item], n: int, weights: dict[str, float] | None = None) -> list[str]:
    """Serve `n` requests one at a time (one slot frees, one is granted): whose they are."""
    weights = weights or {}
    served = []
    for _ in range(n):
        with queue.walk(lambda _principal: True) as walk:
            item = walk.peek()
            if item is None:
                break
            queue.served(item, weights.get(item.principal, 1.0))
        served.append(item.principal)
    return served


# --- the queue -----------------------------------------------------------------------------


def test_one_principal_is_plain_fifo() -> None:
    queue: FairQueue[Item] = FairQueue()
    items = [Item("a") for _ in range(5)]
    for item in items:
        queue.append(item)
    order = []
    while True:
        with queue.walk(lambda _p: True) as walk:
            head = walk.peek()
            if head is None:
                break
            order.append(head)
            queue.served(head, 1.0)
    assert order == items
    assert len(queue) == 0


def test_a_newcomer_is_served_next_not_after_the_backlog() -> None:
    queue: FairQueue[Item] = FairQueue()
    for _ in range(200):
        queue.append(Item("batch"))
    assert drain(queue, 3) == ["batch"] * 3
    queue.append(Item("person"))
    assert drain(queue, 2) == ["person", "batch"]


def test_a_newcomer_gets_no_credit_for_time_it_did_not_wait() -> None:
    queue: FairQueue[Item] = FairQueue()
    for _ in range(50):
        queue.append(Item("a"))
    drain(queue, 20)
    for _ in range(10):
        queue.append(Item("b"))
    # b starts at the queue's virtual time: it alternates with a, no burst of 20.
    assert drain(queue, 6) == ["b", "a", "b", "a", "b", "a"]


def test_weights_share_the_slots() -> None:
    queue: FairQueue[Item] = FairQueue()
    for _ in range(400):
        queue.append(Item("heavy"))
        queue.append(Item("light"))
    served = Counter(drain(queue, 400, {"heavy": 3.0, "light": 1.0}))
    assert served == {"heavy": 300, "light": 100}


def test_service_is_counted_in_work_not_requests() -> None:
    queue: FairQueue[Item] = FairQueue()
    for _ in range(3):
        queue.append(Item("huge", work=8_000))
    for _ in range(40):
        queue.append(Item("small", work=1_000))
    # one huge request moves its principal's tag as far as eight small ones
    assert drain(queue, 19) == ["huge"] + ["small"] * 8 + ["huge"] + ["small"] * 8 + ["huge"]


def test_weights_scale_the_work_charged() -> None:
    queue: FairQueue[Item] = FairQueue()
    for _ in range(3):
        queue.append(Item("huge", work=8_000))
    for _ in range(40):
        queue.append(Item("small", work=1_000))
    # weight 2: a huge request costs its principal half as much
    served = drain(queue, 10, {"huge": 2.0})
    assert served == ["huge"] + ["small"] * 4 + ["huge"] + ["small"] * 4


def test_a_runs_work_is_its_input_and_its_capped_expected_output() -> None:
    assert run_work(500, 256) == 756
    assert run_work(32_000, 32_768) == 32_000 + EXPECTED_OUTPUT_CAP  # a ceiling, capped
    assert run_work(100, None) == 100 + EXPECTED_OUTPUT_CAP  # none named: the cap
    assert run_work(300, 0) == 300  # embeddings generate nothing
    assert run_work(0, 0) == 1  # every run is some service


def test_an_ineligible_principal_is_passed_over_and_keeps_its_place() -> None:
    queue: FairQueue[Item] = FairQueue()
    a1, a2, b1 = Item("a"), Item("a"), Item("b")
    for item in (a1, a2, b1):
        queue.append(item)
    with queue.walk(lambda principal: principal != "a") as walk:
        assert walk.peek() is b1
        queue.served(b1, 1.0)
        walk.advance()
        assert walk.peek() is None
    with queue.walk(lambda _p: True) as walk:
        assert walk.peek() is a1  # its turn was kept
    assert queue.tag("a") == 0.0


def test_a_waiter_left_waiting_does_not_block_its_lane() -> None:
    queue: FairQueue[Item] = FairQueue()
    first, second = Item("a"), Item("a")
    queue.append(first)
    queue.append(second)
    with queue.walk(lambda _p: True) as walk:
        assert walk.peek() is first
        walk.advance()  # it keeps waiting (say, a long run with no long slot free)
        assert walk.peek() is second
        walk.advance()
        assert walk.peek() is None
    with queue.walk(lambda _p: True) as walk:  # the next walk starts from the top again
        assert walk.peek() is first


def test_the_queue_forgets_everything_once_empty() -> None:
    queue: FairQueue[Item] = FairQueue()
    for _ in range(10):
        queue.append(Item("a"))
    drain(queue, 10)
    assert len(queue) == 0
    assert queue._tags == {}
    assert queue.tag("a") == 0.0


def test_removing_a_waiter_that_left_is_a_no_op() -> None:
    queue: FairQueue[Item] = FairQueue()
    item = Item("a")
    queue.append(item)
    queue.remove(item)
    queue.remove(item)
    assert len(queue) == 0
    assert item not in queue


@pytest.mark.parametrize("seed", range(20))
def test_the_heap_offers_what_a_plain_scan_would(seed: int) -> None:
    """The lanes' heap outlives walks; whatever happened to the queue, a walk offers
    the lane a scan of every lane picks (least tag, then oldest waiter), eligible only."""
    rng = random.Random(seed)
    queue: FairQueue[Item] = FairQueue()
    present: list[Item] = []
    weights = {f"p{i}": rng.choice((0.5, 1.0, 3.0)) for i in range(8)}
    for _ in range(400):
        action = rng.random()
        if action < 0.45 or not present:
            item = Item(rng.choice(list(weights)))
            queue.append(item)
            present.append(item)
        elif action < 0.55:
            item = rng.choice(present)
            queue.remove(item)
            present.remove(item)
        else:
            banned = rng.choice(list(weights))
            eligible = [item for item in present if item.principal != banned]
            heads: dict[str, Item] = {}
            for item in eligible:
                heads.setdefault(item.principal, item)  # `present` keeps arrival order
            expected = min(
                heads.values(), key=lambda item: (queue.tag(item.principal), item.seq), default=None
            )
            with queue.walk(banned.__ne__) as walk:
                offered = walk.peek()
                assert offered is expected
                if offered is not None and rng.random() < 0.7:
                    queue.served(offered, weights[offered.principal])
                    present.remove(offered)
                    walk.advance()
                    walk.peek()  # the walk goes on, then closes mid-way
        assert len(queue) == len(present)


# --- the scheduler ---------------------------------------------------------------------------

RUN_S = 1.0
"""Every run's fixed duration (the sim's fixed run time)."""


@dataclass
class Log:
    served: list[str] = field(default_factory=list)
    waits: dict[str, float] = field(default_factory=dict)


async def run_once(scheduler: Scheduler, principal: str, run_id: str, log: Log) -> None:
    """One request: wait for a slot, hold it for `RUN_S`."""
    asked = trio.current_time()
    with await scheduler.acquire("m", run_id, long=False, principal=principal):
        log.served.append(principal)
        log.waits[run_id] = trio.current_time() - asked
        await trio.sleep(RUN_S)


async def test_a_flood_delays_another_principal_by_about_one_run(
    autojump_clock: MockClock,
) -> None:
    scheduler = one_model_pool(capacity=2)
    log = Log()
    async with trio.open_nursery() as nursery:
        for i in range(200):
            nursery.start_soon(run_once, scheduler, "batch", f"a{i}", log)
        await wait_all_tasks_blocked()
        assert scheduler.statistics().queued["m"] == 198
        await trio.sleep(RUN_S * 3.5)  # the flood is being served
        nursery.start_soon(run_once, scheduler, "person", "b", log)
        await trio.sleep(RUN_S * 2)
        assert "person" in log.served
        nursery.cancel_scope.cancel()
    assert log.waits["b"] <= RUN_S


async def test_with_one_principal_the_queue_is_fifo(autojump_clock: MockClock) -> None:
    scheduler = one_model_pool(capacity=1)  # one grant at a time: the grant order is observable
    order: list[str] = []

    async def numbered(i: int) -> None:
        with await scheduler.acquire("m", f"r{i}", long=False, principal="only"):
            order.append(f"r{i}")
            await trio.sleep(RUN_S)

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(numbered, i)
            await wait_all_tasks_blocked()  # arrival order = start order
    assert order == [f"r{i}" for i in range(20)]


async def test_weights_split_served_runs_three_to_one_under_steady_load(
    autojump_clock: MockClock,
) -> None:
    scheduler = one_model_pool(
        [PrincipalLimits(ref="heavy", weight=3), PrincipalLimits(ref="light", weight=1)],
        capacity=2,
    )
    log = Log()

    async def worker(principal: str, number: int) -> None:
        """A closed loop: a new request as soon as the last one is served."""
        for i in count():
            await run_once(scheduler, principal, f"{principal}{number}.{i}", log)

    async with trio.open_nursery() as nursery:
        for number in range(20):  # 20 each: both always have requests waiting
            nursery.start_soon(worker, "heavy", number)
            nursery.start_soon(worker, "light", number)
        await trio.sleep(RUN_S * 200)  # 400 runs on 2 slots
        nursery.cancel_scope.cancel()
    # The first 40 requests were granted in arrival order while both lanes filled.
    served = Counter(log.served[40:])
    ratio = served["heavy"] / served["light"]
    assert 3 * 0.9 <= ratio <= 3 * 1.1, served


async def test_max_concurrent_waits_in_the_queue_and_never_gets_a_slot_over_it(
    autojump_clock: MockClock,
) -> None:
    scheduler = one_model_pool([PrincipalLimits(ref="capped", max_concurrent=1)], capacity=4)
    log = Log()
    peak = 0

    async def capped(i: int) -> None:
        nonlocal peak
        with await scheduler.acquire("m", f"c{i}", long=False, principal="capped"):
            peak = max(peak, scheduler.principal_load()["capped"].in_flight)
            log.served.append("capped")
            await trio.sleep(RUN_S)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(capped, i)
        await wait_all_tasks_blocked()
        load = scheduler.principal_load()["capped"]
        assert (load.in_flight, load.queued) == (1, 2)
        # The pool has free slots: another principal is not held up by the capped one.
        nursery.start_soon(run_once, scheduler, "other", "o", log)
        await wait_all_tasks_blocked()
        assert scheduler.principal_load()["other"].in_flight == 1
    assert peak == 1
    assert log.served.count("capped") == 3


async def test_a_request_held_by_its_own_concurrency_limit_times_out_as_such(
    autojump_clock: MockClock,
) -> None:
    scheduler = one_model_pool(
        [PrincipalLimits(ref="capped", max_concurrent=1)], capacity=4, queue_timeout_ms=500
    )
    async with trio.open_nursery() as nursery:
        first = await scheduler.acquire("m", "c0", long=False, principal="capped")
        with pytest.raises(ConcurrencyLimited) as caught:
            await scheduler.acquire("m", "c1", long=False, principal="capped")
        assert isinstance(caught.value, QueueTimeout)
        assert "max_concurrent" in caught.value.reason
        first.release()
        nursery.cancel_scope.cancel()
    assert scheduler.principal_load() == {}


async def test_concurrency_is_split_between_replicas(autojump_clock: MockClock) -> None:
    scheduler = one_model_pool([PrincipalLimits(ref="capped", max_concurrent=4)], capacity=8)
    scheduler.set_replicas(2)
    leases = [
        await scheduler.acquire("m", f"c{i}", long=False, principal="capped") for i in range(2)
    ]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_once, scheduler, "capped", "c2", Log())
        await wait_all_tasks_blocked()
        assert scheduler.principal_load()["capped"].queued == 1
        scheduler.set_replicas(1)  # the other replica left: the share grows at once
        await wait_all_tasks_blocked()
        assert scheduler.principal_load()["capped"].in_flight == 3
        nursery.cancel_scope.cancel()
    for lease in leases:
        lease.release()


async def test_a_request_that_cannot_use_the_slot_does_not_hold_up_another_principal(
    autojump_clock: MockClock,
) -> None:
    scheduler = one_model_pool(capacity=2, long_context_slots=1)
    long_run = await scheduler.acquire("m", "l1", long=True, principal="a")
    regular = await scheduler.acquire("m", "r1", long=False, principal="b")
    got: dict[str, object] = {}

    async def wait_for(run_id: str, principal: str, *, long: bool) -> None:
        got[run_id] = await scheduler.acquire("m", run_id, long=long, principal=principal)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(wait_for, "l2", "a", long=True))
        await wait_all_tasks_blocked()
        nursery.start_soon(partial(wait_for, "r2", "c", long=False))
        await wait_all_tasks_blocked()
        regular.release()  # a regular slot: the long waiter, first in line, cannot use it
        await wait_all_tasks_blocked()
        assert list(got) == ["r2"]
        long_run.release()
    assert sorted(got) == ["l2", "r2"]


async def test_slot_time_is_shared_by_work_between_few_huge_and_many_small_requests(
    autojump_clock: MockClock,
) -> None:
    """The fair-share benchmark's scenario (`bench.fair_share.work_share`): at equal
    weights, a principal keeping 24 small requests outstanding gets its share of slot
    time against one keeping 2 huge ones (counting requests, it got a few percent)."""
    share = await work_share()
    assert share.ratio <= 1.5, (share.huge_s, share.small_s)
    # a small request waits for the other small ones and one huge run at most, never
    # for a run of huge requests
    huge_run_s = run_work(32_000, 4_096) / 1_000.0
    assert max(share.small_waits) <= 24 * run_work(500, 256) / 1_000.0 + huge_run_s
