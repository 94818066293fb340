"""The daily budgets replicas reserve against, in a real PostgreSQL (design §15, limits
Rule 7): one counter per principal per day, seeded from the usage ledger, reservations
that stop at the budget whichever replica makes them, settlements, and the holds of a
replica that was killed given back once the roster no longer lists it.

The server is the suite's throwaway cluster (`tests/e2e/postgres.py`).
"""

from __future__ import annotations

import os
import time

import psycopg
import trio

from iop_edge.core.configuration.ledger_url import parse_ledger_url
from iop_edge.runtime.lifecycle.replicas import STALE_AFTER_S
from iop_edge.runtime.metering.usage_ledger.budgets_postgres import DAYS, HOLDS, PostgresBudgets
from iop_edge.runtime.metering.usage_ledger.ledger_postgres import PostgresStore
from iop_edge.runtime.metering.usage_ledger.usage import UsageRecord
from tests.e2e.postgres import PASSWORD_ENV

DAY = 20_000 * 86_400


def _budgets(ledger_url: str, instance: str) -> PostgresBudgets:
    """A replica's budgets, in a ledger set up as an Edge sets it up before serving."""
    store = PostgresStore(parse_ledger_url(ledger_url), PASSWORD_ENV)
    store.open()
    store.close()
    return PostgresBudgets(parse_ledger_url(ledger_url), PASSWORD_ENV, instance)


def _rows(ledger_url: str, query: str) -> list[tuple[object, ...]]:
    with psycopg.connect(ledger_url, password=os.environ[PASSWORD_ENV]) as connection:
        return list(connection.execute(query).fetchall())


def _seen(ledger_url: str, instance: str, at: float) -> None:
    """`instance` as the replica roster lists it, last written at `at`."""
    with psycopg.connect(ledger_url, password=os.environ[PASSWORD_ENV]) as connection:
        connection.execute(
            "INSERT INTO iop_replicas VALUES (%s, '{}', %s) ON CONFLICT (instance) "
            "DO UPDATE SET seen_at = excluded.seen_at",
            [instance, at],
        )


def test_reservations_stop_at_the_budget_whichever_replica_makes_them(ledger_url: str) -> None:
    a, b = _budgets(ledger_url, "host/1"), _budgets(ledger_url, "host/2")
    try:
        assert a.reserve("alice", DAY, 60, budget=100)
        assert b.reserve("alice", DAY, 60, budget=100)  # 60 < 100: admitted, crosses it
        assert not a.reserve("alice", DAY, 1, budget=100)  # 120 reserved: none left
        assert not b.reserve("alice", DAY, 1, budget=100)
        assert b.reserve("bob", DAY, 60, budget=100)  # another principal's own counter
        assert b.reserve("alice", DAY + 86_400, 60, budget=100)  # another day's
        # a's run used 10 of its 60: 70 counted, so a new request fits again.
        a.settle({("alice", DAY): (60, 10)})
        assert _rows(
            ledger_url,
            f"SELECT used, reserved FROM {DAYS} WHERE principal = 'alice' AND day = {DAY}",
        ) == [(10, 60)]
        assert a.reserve("alice", DAY, 30, budget=100)  # 100 counted: the last that fits
        assert not b.reserve("alice", DAY, 1, budget=100)
    finally:
        a.close()
        b.close()


def test_a_days_counter_starts_from_what_the_ledger_holds(ledger_url: str) -> None:
    store = PostgresStore(parse_ledger_url(ledger_url), PASSWORD_ENV)
    store.open()
    record = UsageRecord(
        time=DAY + 60.0,
        run_id="r1",
        principal_ref="alice",
        token_ref="alice-key",
        alias=None,
        model="m",
        provider="p",
        node="n",
        prompt_tokens=70,
        completion_tokens=20,
        status=200,
        latency_ms=1.0,
        ttft_ms=None,
    )
    store.insert([record], "segment-1", 1)
    store.close()
    budgets = _budgets(ledger_url, "host/1")
    try:
        assert budgets.reserve("alice", DAY, 5, budget=100)  # 90 used + 5
        assert budgets.reserve("alice", DAY, 5, budget=100)  # 95 < 100
        assert not budgets.reserve("alice", DAY, 5, budget=100)
    finally:
        budgets.close()


def test_a_killed_replicas_holds_are_given_back(ledger_url: str) -> None:
    now = time.time()
    killed, alive = _budgets(ledger_url, "host/1"), _budgets(ledger_url, "host/2")
    try:
        assert killed.reserve("alice", DAY, 90, budget=100)
        assert alive.reserve("alice", DAY, 10, budget=100)
        assert not alive.reserve("alice", DAY, 10, budget=100)
        _seen(ledger_url, "host/1", now)
        _seen(ledger_url, "host/2", now)
        alive.release_stale(now)  # both listed: nothing is released
        assert not alive.reserve("alice", DAY, 10, budget=100)
        # host/1 stops writing its roster row (killed): once stale, its 90 come back.
        alive.release_stale(now + STALE_AFTER_S + 1)
        assert _rows(ledger_url, f"SELECT instance, reserved FROM {HOLDS}") == [("host/2", 10)]
        assert alive.reserve("alice", DAY, 10, budget=100)
    finally:
        killed.close()
        alive.close()


async def test_replicas_reserving_at_once_never_pass_the_budget(ledger_url: str) -> None:
    """Many reservations from several replicas' worker threads at once: the row takes
    them in turn, and what was reserved passes the budget by one reservation at most."""
    replicas = [_budgets(ledger_url, f"host/{index}") for index in range(3)]
    granted: list[int] = []

    async def reserve(budgets: PostgresBudgets) -> None:
        if await trio.to_thread.run_sync(budgets.reserve, "alice", DAY, 7, 100):
            granted.append(7)

    try:
        async with trio.open_nursery() as nursery:
            for index in range(60):
                nursery.start_soon(reserve, replicas[index % 3])
    finally:
        for budgets in replicas:
            budgets.close()
    assert 100 <= sum(granted) < 100 + 7
    assert _rows(ledger_url, f"SELECT reserved FROM {DAYS}") == [(sum(granted),)]
