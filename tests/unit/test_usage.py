"""The usage ledger: metering failures never take the Edge down; a stop loses nothing."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import msgspec
import pytest
import trio

from iop_edge.runtime.metering.usage_ledger.usage import UsageLedger
from tests.timing import GUARD_S
from tests.unit.usage_records import usage_record


def _rows(path: Path) -> list[str]:
    with sqlite3.connect(path) as db:
        return [row[0] for row in db.execute("SELECT run_id FROM usage ORDER BY run_id")]


async def test_a_failing_write_is_retried_and_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite3"
    ledger = UsageLedger(path, retry_s=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        with sqlite3.connect(path) as db:
            db.execute("ALTER TABLE usage RENAME TO hidden")  # every insert now fails
        ledger.record(usage_record("held"))
        with trio.move_on_after(0.3):  # it cannot be written while the table is gone
            await ledger.wait_flushed()
        assert ledger.statistics().committed == 0 and ledger.statistics().failed_writes >= 1
        with sqlite3.connect(path) as db:
            db.execute("ALTER TABLE hidden RENAME TO usage")
        ledger.record(usage_record("kept"))
        with trio.fail_after(GUARD_S):
            await ledger.wait_flushed()
        nursery.cancel_scope.cancel()
    assert _rows(path) == ["held", "kept"]
    assert ledger.dropped == 0


async def test_close_drains_what_is_queued(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite3"
    ledger = UsageLedger(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        for index in range(5):
            ledger.record(usage_record(f"r{index}"))
        ledger.close()
        with trio.fail_after(GUARD_S):
            await ledger.wait_stopped()
        ledger.record(usage_record("late"))  # after close: counted, not written, no crash
    assert _rows(path) == [f"r{index}" for index in range(5)]
    assert ledger.dropped == 1


async def test_aggregate_groups_and_rejects_unknown_columns(tmp_path: Path) -> None:
    ledger = UsageLedger(tmp_path / "usage.sqlite3")
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        ledger.record(usage_record("a"))
        ledger.record(usage_record("b"))
        with trio.fail_after(GUARD_S):
            await ledger.wait_flushed()
        report = await ledger.aggregate(since=None, until=None, group_by=["model"])
        assert [
            (r.model, r.requests, r.prompt_tokens, r.completion_tokens) for r in report.rows
        ] == [("m", 2, 6, 8)]
        with pytest.raises(ValueError, match="colour"):
            await ledger.aggregate(since=None, until=None, group_by=["colour"])
        nursery.cancel_scope.cancel()


#: The ledger's table as Edges before `usage_source` created it.
_OLD_SCHEMA = """
CREATE TABLE usage (
    time REAL NOT NULL, run_id TEXT NOT NULL, principal_ref TEXT NOT NULL,
    token_ref TEXT NOT NULL, alias TEXT, model TEXT NOT NULL, provider TEXT NOT NULL,
    node TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
    status INTEGER NOT NULL, latency_ms REAL NOT NULL, ttft_ms REAL
);
INSERT INTO usage VALUES (0.5, 'old', 'p', 't', NULL, 'm', 'pr', 'n', 1, 2, 200, 1.0, NULL);
"""


def _older_ledger(tmp_path: Path) -> tuple[Path, UsageLedger]:
    """A ledger on the file an Edge from before `usage_source` and `protocol` wrote."""
    path = tmp_path / "usage.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(_OLD_SCHEMA)
    return path, UsageLedger(path)


async def test_an_older_ledger_gains_usage_source_and_keeps_its_rows(tmp_path: Path) -> None:
    path, ledger = _older_ledger(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        ledger.record(usage_record("reported"))
        ledger.record(msgspec.structs.replace(usage_record("guessed"), usage_source="estimated"))
        with trio.fail_after(GUARD_S):
            await ledger.wait_flushed()
        by_source = await ledger.aggregate(since=None, until=None, group_by=["usage_source"])
        total = await ledger.aggregate(since=None, until=None, group_by=[])
        nursery.cancel_scope.cancel()
    with sqlite3.connect(path) as db:
        sources = dict(db.execute("SELECT run_id, usage_source FROM usage"))
    assert sources == {"old": "provider", "reported": "provider", "guessed": "estimated"}
    assert [
        (row.usage_source, row.requests, row.estimated_requests, row.estimated_tokens)
        for row in by_source.rows
    ] == [("estimated", 1, 1, 7), ("provider", 2, 0, 0)]
    [row] = total.rows
    assert (row.requests, row.prompt_tokens, row.estimated_requests, row.estimated_tokens) == (
        3,
        7,
        1,
        7,
    )


def _journal_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("usage-journal-*.jsonl"))


async def test_records_journaled_before_a_kill_are_replayed_once(tmp_path: Path) -> None:
    """The writer dies before committing (as with kill -9); the next start-up inserts
    every journaled record exactly once, skipping a torn last line and an unreadable one."""
    path = tmp_path / "usage.sqlite3"
    first = UsageLedger(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        first.record(usage_record("committed"))
        with trio.fail_after(GUARD_S):
            await first.wait_flushed()
        for name in ("a", "b", "c"):
            first.record(usage_record(name))
        nursery.cancel_scope.cancel()  # before the batch window ends: nothing committed
    assert _rows(path) == ["committed"]
    (segment,) = _journal_files(tmp_path)
    with segment.open("ab") as file:
        file.write(b"not a record\n")
        file.write(b'{"time": 1.0, "run_id": "torn"')  # no newline: a torn write
    second = UsageLedger(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(second.run)
        assert second.statistics().replayed == 4  # a, b, c and the unreadable line
        second.close()
        await second.wait_stopped()
    assert _rows(path) == ["a", "b", "c", "committed"]
    assert _journal_files(tmp_path) == []  # replayed, then deleted; the clean stop too


async def test_a_live_ledgers_journal_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite3"
    live, starting = UsageLedger(path), UsageLedger(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(live.run)
        live.record(usage_record("live"))
        await nursery.start(starting.run)  # another Edge on the same state_dir
        assert starting.statistics().replayed == 0
        with trio.fail_after(GUARD_S):
            await live.wait_flushed()
        nursery.cancel_scope.cancel()
    assert _rows(path) == ["live"]


async def test_segments_rotate_and_are_deleted_once_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("iop_edge.runtime.metering.usage_ledger.journal.ROTATE_BYTES", 600)
    path = tmp_path / "usage.sqlite3"
    ledger = UsageLedger(path)
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        for index in range(20):
            ledger.record(usage_record(f"r{index:02}"))
        assert len(_journal_files(tmp_path)) > 3
        with trio.fail_after(GUARD_S):
            await ledger.wait_flushed()
        assert len(_journal_files(tmp_path)) == 1  # the live one
        nursery.cancel_scope.cancel()
    assert _rows(path) == [f"r{index:02}" for index in range(20)]


async def test_an_older_ledger_gains_protocol_and_groups_by_it(tmp_path: Path) -> None:
    """Rows from before the caller protocols were all chat completions."""
    _, ledger = _older_ledger(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        ledger.record(msgspec.structs.replace(usage_record("agent"), protocol="messages"))
        ledger.record(msgspec.structs.replace(usage_record("codex"), protocol="responses"))
        with trio.fail_after(GUARD_S):
            await ledger.wait_flushed()
        report = await ledger.aggregate(since=None, until=None, group_by=["protocol"])
        nursery.cancel_scope.cancel()
    assert [(row.protocol, row.requests) for row in report.rows] == [
        ("chat", 1),
        ("messages", 1),
        ("responses", 1),
    ]
