"""Budgets reserved in a ledger replicas share, from the limiter's side (limits Rule 7,
`metering.usage_ledger.shared_budgets`): a refused reservation costs nothing, settlements reach the
store added up and are retried, and a store that does not answer refuses nobody.

The store is a fake with the `BudgetStore` methods; the real one is tested against
PostgreSQL in `tests/e2e/test_budgets_postgres.py`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing
import yaml

from iop_edge.core.configuration.config import parse_config
from iop_edge.core.principals import SECONDS_PER_DAY, PrincipalPolicies
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.metering.usage_ledger import shared_budgets
from iop_edge.runtime.metering.usage_ledger.shared_budgets import SharedBudgets
from iop_edge.runtime.runs.dispatch import Dispatcher, Outcome
from iop_edge.runtime.runs.limits import LimitExceeded, PrincipalLimiter
from iop_edge.runtime.runs.run_plan import RunPlan
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas.config import PrincipalLimits
from tests.nodeless_pool import nodeless_dispatcher
from tests.timing import GUARD_S
from tests.unit.test_config import valid

WALL = 10 * SECONDS_PER_DAY + 3600.0
DAY = int(10 * SECONDS_PER_DAY)


@dataclass
class FakeStore:
    budget_left: int = 1000
    down: bool = False
    reserved: list[tuple[str, int, int, int]] = field(default_factory=list)
    settled: list[dict[tuple[str, int], tuple[int, int]]] = field(default_factory=list)
    settle_failures: int = 0
    closed: bool = False
    attempts: int = 0
    wrote: trio.Event = field(default_factory=trio.Event)
    """Set (from the worker thread) by each settlement written."""

    def reserve(self, principal: str, day: int, tokens: int, budget: int) -> bool:
        if self.down:
            raise OSError("the ledger is unreachable")
        if self.budget_left <= 0:
            return False
        self.budget_left -= tokens
        self.reserved.append((principal, day, tokens, budget))
        return True

    def settle(self, settlements: Mapping[tuple[str, int], tuple[int, int]]) -> None:
        self.attempts += 1
        if self.settle_failures:
            self.settle_failures -= 1
            raise OSError("the ledger is unreachable")
        self.settled.append(dict(settlements))
        trio.from_thread.run_sync(self.wrote.set)

    def release_stale(self, now: float) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def _limiter(
    store: FakeStore,
    *,
    tokens_per_day: int | None = None,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
) -> PrincipalLimiter:
    limits = PrincipalLimits(
        ref="alice",
        tokens_per_day=tokens_per_day,
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
    )
    policies = PrincipalPolicies([limits])
    limiter = PrincipalLimiter(lambda: policies, clock=lambda: 0.0, wall=lambda: WALL)
    limiter.shared_budgets = SharedBudgets(store, wall=lambda: WALL)
    return limiter


async def test_a_request_reserves_its_estimate_for_the_day() -> None:
    store = FakeStore()
    limiter = _limiter(store, tokens_per_day=500)
    ticket = limiter.admit("alice", prompt_tokens=10, max_output=40)
    await limiter.reserve_shared(ticket)
    assert store.reserved == [("alice", DAY, 50, 500)]
    assert ticket.shared_day == DAY


async def test_a_budget_spent_on_other_replicas_refuses_and_costs_nothing() -> None:
    store = FakeStore(budget_left=0)
    limiter = _limiter(store, tokens_per_day=500, requests_per_minute=3, tokens_per_minute=900)
    ticket = limiter.admit("alice", prompt_tokens=10, max_output=40)
    with pytest.raises(LimitExceeded) as caught:
        await limiter.reserve_shared(ticket)
    refusal = caught.value
    assert (refusal.limit, refusal.code) == ("tokens_per_day", "budget_exceeded")
    assert refusal.rate_limits.remaining_tokens == 0
    assert refusal.retry_after_s == pytest.approx(SECONDS_PER_DAY - 3600.0)
    standing = limiter.report({}).principals[0]
    assert standing.requests_remaining == 3  # the refused request took nothing
    assert standing.tokens_remaining == 900
    assert standing.budget_remaining == 500  # this Edge's own view: nothing in flight
    assert standing.rejected == {"tokens_per_day": 1}
    limiter.settle(ticket, 0)  # a refused ticket is settled already: nothing happens
    assert limiter.shared_budgets is not None and limiter.shared_budgets.pending == 0


async def test_a_principal_without_a_budget_never_asks_the_store() -> None:
    store = FakeStore(down=True)
    limiter = _limiter(store, requests_per_minute=3)
    ticket = limiter.admit("alice", prompt_tokens=10, max_output=40)
    await limiter.reserve_shared(ticket)
    assert ticket.shared_day is None


async def test_a_store_that_does_not_answer_refuses_nobody(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FakeStore(down=True)
    limiter = _limiter(store, tokens_per_day=500)
    for _ in range(3):
        ticket = limiter.admit("alice", prompt_tokens=10, max_output=40)
        await limiter.reserve_shared(ticket)  # admitted on this Edge's view (Rule 3)
        assert ticket.shared_day is None
        limiter.settle(ticket, 30)  # reserved nowhere: nothing to settle there
    assert limiter.shared_budgets is not None and limiter.shared_budgets.pending == 0
    said = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(said) == 1  # once, not per request


async def test_settlements_are_added_up_written_and_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two runs' settlements go out as one; the write fails once and is tried again
    `RETRY_S` later (shortened here: the store is a worker thread's, so the clock is
    the real one); the store is closed when the task ends."""
    monkeypatch.setattr(shared_budgets, "RETRY_S", 0.01)
    store = FakeStore(settle_failures=1)
    limiter = _limiter(store, tokens_per_day=5000)
    shared = limiter.shared_budgets
    assert shared is not None
    tickets = []
    for _ in range(3):
        ticket = limiter.admit("alice", prompt_tokens=10, max_output=40)
        await limiter.reserve_shared(ticket)
        tickets.append(ticket)
    async with trio.open_nursery() as nursery:
        for ticket in tickets[:2]:
            limiter.settle(ticket, 20)
        await nursery.start(shared.run)
        with trio.fail_after(GUARD_S):
            await store.wrote.wait()
        # The first write failed: kept, and written whole after `RETRY_S`.
        assert store.attempts == 2
        assert store.settled == [{("alice", DAY): (100, 40)}]
        store.wrote = trio.Event()
        limiter.settle(tickets[2], 5)
        with trio.fail_after(GUARD_S):
            await store.wrote.wait()
        assert store.settled[1:] == [{("alice", DAY): (50, 5)}]
        assert shared.pending == 0
        nursery.cancel_scope.cancel()
    assert store.closed


@dataclass
class _HeldStore(FakeStore):
    """A store whose reservations wait (in their worker threads) until `answer` is set."""

    answer: threading.Event = field(default_factory=threading.Event)

    def reserve(self, principal: str, day: int, tokens: int, budget: int) -> bool:
        self.answer.wait()
        return super().reserve(principal, day, tokens, budget)


def _dispatcher(limiter: PrincipalLimiter) -> Dispatcher:
    """A dispatcher over a pool with no Node: only its admission by limits is exercised."""
    snapshot = Snapshot.build(
        parse_config(yaml.safe_dump(valid())).config, revision=1, config_sha256="0" * 64
    )
    return nodeless_dispatcher(Scheduler(snapshot), limits=limiter)


async def test_a_run_cut_while_the_store_reserves_gives_back_what_its_ticket_took() -> None:
    """A caller who leaves while its run's budget waits on the shared store (every store
    thread busy) leaves nothing reserved: the run holds its ticket before it awaits, and
    its end settles it."""
    store = _HeldStore()
    limiter = _limiter(store, tokens_per_day=5000)
    dispatcher = _dispatcher(limiter)
    plan = RunPlan(
        run_id="req_1",
        model_id="qwen3.6:35b",
        operation="chat",
        body={},
        stream=False,
        long=False,
        caller_wants_usage=False,
        principal_ref="alice",
        prompt_tokens=10,
        max_output=40,
    )
    run = dispatcher.open(plan)
    async with trio.open_nursery() as nursery:
        busy = [
            limiter.admit("alice", prompt_tokens=10, max_output=40)
            for _ in range(shared_budgets.CONNECTIONS)  # the store's threads, all taken
        ]
        for ticket in busy:
            nursery.start_soon(limiter.reserve_shared, ticket)
        try:
            await trio.testing.wait_all_tasks_blocked()
            with trio.CancelScope() as caller:
                nursery.start_soon(_cancel_when_all_wait, caller)
                await dispatcher.start(run)
            assert caller.cancelled_caught
            run.end(Outcome(499))  # as `RunEndpoints` ends every run it opened
        finally:
            store.answer.set()
    [alice] = limiter.report({}).principals
    assert alice.budget_remaining == 5000 - 50 * len(busy)  # the cut run's 50 given back


async def _cancel_when_all_wait(scope: trio.CancelScope) -> None:
    await trio.testing.wait_all_tasks_blocked()
    scope.cancel()


async def test_settlements_cut_while_waiting_for_a_store_thread_are_written_at_the_end() -> None:
    """A stopping Edge cuts the writer while it waits for one of the store's threads (all
    busy with reservations): the batch it held is the final flush's, not lost."""
    store = _HeldStore()
    store.answer.set()
    limiter = _limiter(store, tokens_per_day=5000)
    shared = limiter.shared_budgets
    assert shared is not None
    ticket = limiter.admit("alice", prompt_tokens=10, max_output=40)
    await limiter.reserve_shared(ticket)
    limiter.settle(ticket, 20)
    store.answer.clear()
    async with trio.open_nursery() as nursery:
        for _ in range(shared_budgets.CONNECTIONS):  # the store's threads, all taken
            held = limiter.admit("alice", prompt_tokens=10, max_output=40)
            nursery.start_soon(limiter.reserve_shared, held)
        await trio.testing.wait_all_tasks_blocked()
        with trio.CancelScope() as edge:
            nursery.start_soon(_answer_when_all_wait, store, edge)
            await shared.run()
    assert store.settled == [{("alice", DAY): (50, 20)}]


async def _answer_when_all_wait(store: _HeldStore, edge: trio.CancelScope) -> None:
    """The writer waits for a thread: the Edge stops, then the store answers."""
    await trio.testing.wait_all_tasks_blocked()
    edge.cancel()
    await trio.testing.wait_all_tasks_blocked()
    store.answer.set()
