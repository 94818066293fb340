"""Usage views stay bounded on a big ledger: the database sums, one page of groups comes
back, pages cover every group once, and the totals cover the whole window.

`bench/usage_views.py` times the same on a million records; here the ledgers are small
enough to build in a moment and big enough that an unbounded answer would show.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from iop_edge.runtime.metering.usage_ledger.ledger_sqlite import SqliteStore
from iop_edge.runtime.metering.usage_ledger.usage import UsageLedger
from iop_edge.runtime.metering.usage_ledger.usage_store import (
    UsageSelection,
    aggregate_sql,
    encode_cursor,
)

COLUMNS = ["principal_ref", "token_ref", "model"]


def build_ledger(path: Path, records: int, principals: int) -> None:
    """A ledger of `records` rows spread over `principals` principals, a model `m0` for
    the first `principals` records, `m1` for the next, and so on."""
    store = SqliteStore(path)
    store.open()
    store.close()
    rows = (
        (1_700_000_000.0 + i, f"run-{i}", f"p{i % principals:06d}", f"t{i % principals:06d}",
         None, f"m{(i // principals) % 2}", "pr", "n", 10, 20, 200, 5.0, 1.0,
         "estimated" if i % 10 == 0 else "provider", "chat", 5)
        for i in range(records)
    )  # fmt: skip
    with sqlite3.connect(path) as db:
        db.executemany(f"INSERT INTO usage VALUES ({', '.join('?' * 16)})", rows)


@pytest.fixture(scope="module")
def big_ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UsageLedger]:
    """200,000 records in 100,000 groups (50,000 principals, two models each)."""
    path = tmp_path_factory.mktemp("ledger") / "usage.sqlite3"
    build_ledger(path, 200_000, 50_000)
    yield UsageLedger(path)


async def test_a_page_is_bounded_and_its_totals_cover_the_window(
    big_ledger: UsageLedger,
) -> None:
    report = await big_ledger.aggregate(since=None, until=None, group_by=COLUMNS, limit=1000)
    assert len(report.rows) == 1000 and report.truncated and report.next is not None
    assert report.rows[0].principal_ref == "p000000" and report.rows[0].requests == 2
    assert report.totals is not None
    assert (report.totals.requests, report.totals.prompt_tokens) == (200_000, 2_000_000)
    assert report.totals.estimated_requests == 20_000
    # The next page starts after the last group of this one.
    following = await big_ledger.aggregate(
        since=None, until=None, group_by=COLUMNS, limit=1000, after=report.next
    )
    last, first = report.rows[-1], following.rows[0]
    assert (last.principal_ref, last.model) < (first.principal_ref, first.model)
    assert following.totals == report.totals


async def test_the_pages_cover_every_group_once_in_order(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite3"
    build_ledger(path, 2_600, 1_300)  # 2,600 groups: pages of 1000, 1000, 600
    ledger = UsageLedger(path)
    seen: list[tuple[str | None, str | None, str | None]] = []
    after: str | None = None
    pages = 0
    while True:
        report = await ledger.aggregate(
            since=1_700_000_100.0, until=None, group_by=COLUMNS, limit=1000, after=after
        )
        pages += 1
        seen += [(row.principal_ref, row.token_ref, row.model) for row in report.rows]
        if not report.truncated:
            assert report.next is None
            break
        after = report.next
    assert pages == 3
    assert seen == sorted(set(seen)) and len(seen) == 2_500  # the first 100 s: outside
    assert report.totals is not None and report.totals.requests == 2_500


def test_the_database_sums_from_the_index_and_returns_one_page_more(tmp_path: Path) -> None:
    """The proof that the work is the database's: the query groups, sums and limits, and
    SQLite answers the default grouping from the covering index, in order (no sort of
    the whole table)."""
    path = tmp_path / "usage.sqlite3"
    build_ledger(path, 1_000, 100)
    selection = UsageSelection(since=None, until=None, columns=COLUMNS, limit=50)
    sql, params = aggregate_sql(selection, "?")
    assert "GROUP BY principal_ref, token_ref, model" in sql and params == [51]
    with sqlite3.connect(path) as db:
        plan = " / ".join(row[-1] for row in db.execute(f"EXPLAIN QUERY PLAN {sql}", params))
        assert "USING COVERING INDEX usage_by_principal_tokens" in plan, plan
        assert "TEMP B-TREE" not in plan, plan
        assert len(db.execute(sql, params).fetchall()) == 51


async def test_a_cursor_only_continues_its_own_grouping(big_ledger: UsageLedger) -> None:
    with pytest.raises(ValueError, match="after: not a cursor"):
        await big_ledger.aggregate(
            since=None, until=None, group_by=COLUMNS, limit=10, after="not-a-cursor!"
        )
    by_model = encode_cursor(["model"], ["m0"])
    with pytest.raises(ValueError, match="grouped by model, not by principal_ref,token_ref"):
        await big_ledger.aggregate(
            since=None, until=None, group_by=COLUMNS, limit=10, after=by_model
        )


async def test_an_unbounded_query_still_returns_every_group(tmp_path: Path) -> None:
    """The principals' budgets read every principal (no `limit`)."""
    path = tmp_path / "usage.sqlite3"
    build_ledger(path, 3_000, 1_500)
    report = await UsageLedger(path).aggregate(since=None, until=None, group_by=["principal_ref"])
    assert len(report.rows) == 1_500 and not report.truncated
    assert report.totals is not None and report.totals.requests == 3_000


def test_an_older_ledger_gains_the_index_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite3"
    build_ledger(path, 10, 2)
    with sqlite3.connect(path) as db:
        db.execute("DROP INDEX usage_by_principal_tokens")
    store = SqliteStore(path)
    store.open()
    store.close()
    with sqlite3.connect(path) as db:
        names = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert "usage_by_principal_tokens" in names
