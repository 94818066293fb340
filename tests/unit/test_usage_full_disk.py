"""The usage ledger on a real full disk: no record is lost while memory allows, and the
journal never glues a good line to a torn one (usage "A full disk", journal Rule 7)."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import trio

from iop_edge.runtime.metering.usage_ledger.journal import UsageJournal
from iop_edge.runtime.metering.usage_ledger.usage import UsageLedger
from tests.small_disk import SmallDisk, small_disk
from tests.timing import GUARD_S
from tests.unit.usage_records import usage_record


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path, "1m") as mounted:
        yield mounted


def _rows(path: Path) -> list[str]:
    with sqlite3.connect(path) as db:
        return [row[0] for row in db.execute("SELECT run_id FROM usage ORDER BY rowid")]


def test_a_short_write_leaves_no_torn_line(disk: SmallDisk) -> None:
    journal = UsageJournal(disk.path / "state")
    journal.open()
    journal.append(b'{"first": 1}\n')  # the segment's first block, mostly slack
    disk.fill()
    long_line = b'{"second": "' + b"x" * 6000 + b'"}\n'  # more than the slack
    with pytest.raises(OSError, match="No space left on device"):
        journal.append(long_line)
    [segment] = journal.segments
    assert segment.path.stat().st_size == segment.written == len(b'{"first": 1}\n')
    disk.free()
    journal.append(long_line)  # the retry, as the ledger makes it
    lines = segment.path.read_bytes().splitlines()
    assert [msgspec.json.decode(line) for line in lines] == [{"first": 1}, {"second": "x" * 6000}]
    journal.release()


async def _record_until_unwritten(ledger: UsageLedger, prefix: str) -> list[str]:
    """Record until one record waits in memory (the journal's last block has slack that
    still takes a few); returns every run id recorded, in order."""
    recorded = []
    while ledger.statistics().unwritten == 0:
        assert len(recorded) < 1000, "a full disk took every record"
        recorded.append(f"{prefix}{len(recorded)}")
        ledger.record(usage_record(recorded[-1]))
    return recorded


async def test_records_wait_in_memory_in_order_and_are_written_when_space_returns(
    disk: SmallDisk, caplog: pytest.LogCaptureFixture
) -> None:
    path = disk.path / "state" / "usage.sqlite3"
    ledger = UsageLedger(path, retry_s=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        ledger.record(usage_record("before"))
        with trio.fail_after(GUARD_S):
            await ledger.wait_flushed()
        disk.fill()
        recorded = ["before", *await _record_until_unwritten(ledger, "slack-")]
        for index in range(50):
            recorded.append(f"held-{index}")
            ledger.record(usage_record(recorded[-1]))
        stats = ledger.statistics()
        assert (stats.state, stats.unwritten, stats.dropped) == ("buffering", 51, 0)
        problem = ledger.problem()
        assert problem is not None and "No space left on device" in problem
        with trio.move_on_after(0.2):  # nothing can be written meanwhile
            await ledger.wait_flushed()
        assert ledger.statistics().unwritten == 51
        disk.free()
        with trio.fail_after(10):
            await ledger.wait_flushed()
        stats = ledger.statistics()
        assert (stats.state, stats.unwritten, stats.dropped) == ("writable", 0, 0)
        assert stats.state_changes == {"writable": 1, "buffering": 1, "full": 0}
        nursery.cancel_scope.cancel()
    assert _rows(path) == recorded
    messages = [r.getMessage() for r in caplog.records if r.name.endswith("usage")]
    assert any("cannot be written (No space left on device)" in m for m in messages)
    assert any("is written again" in m for m in messages)
    assert not [r for r in caplog.records if "unreadable record" in r.getMessage()]


@pytest.mark.parametrize(
    ("when_full", "kept", "dropped"), [("refuse", 6, 0), ("serve", 3, 3)], ids=["refuse", "serve"]
)
async def test_a_full_buffer_refuses_runs_or_drops_records_as_configured(
    disk: SmallDisk,
    caplog: pytest.LogCaptureFixture,
    when_full: str,
    kept: int,
    dropped: int,
) -> None:
    """`refuse`: the Edge stops admitting at the bound, and keeps the records of runs
    already under way (up to twice the bound); `serve`: records past it are dropped."""
    caplog.set_level(logging.INFO)
    path = disk.path / "state" / "usage.sqlite3"
    ledger = UsageLedger(path, retry_s=0.01, buffer_records=3, when_full=when_full)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        disk.fill()
        recorded = await _record_until_unwritten(ledger, "slack-")
        assert not ledger.refuses_runs
        for index in range(5):
            recorded.append(f"more-{index}")
            ledger.record(usage_record(recorded[-1]))
        stats = ledger.statistics()
        assert (stats.state, stats.unwritten, stats.dropped) == ("full", kept, dropped)
        assert ledger.refuses_runs is (when_full == "refuse")
        problem = ledger.problem()
        assert problem is not None and f"edge.ledger_when_unwritable: {when_full}" in problem
        disk.free()
        with trio.fail_after(10):
            await ledger.wait_flushed()
        assert ledger.state == "writable" and not ledger.refuses_runs
        nursery.cancel_scope.cancel()
    written = _rows(path)
    assert written == recorded[: len(recorded) - dropped]
    changes = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("usage ledger: ")
    ]
    assert any("wait in memory (1 so far, at most 3)" in m for m in changes)
    assert any(f"{kept if when_full == 'serve' else 3} usage record(s) wait" in m for m in changes)
    assert any("is written again" in m for m in changes)


async def test_closing_on_a_full_disk_writes_what_waits_once_there_is_room(
    disk: SmallDisk,
) -> None:
    """A stopping Edge spends its grace period retrying what waits in memory."""
    path = disk.path / "state" / "usage.sqlite3"
    ledger = UsageLedger(path, retry_s=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(ledger.run)
        disk.fill()
        recorded = await _record_until_unwritten(ledger, "r")
        ledger.close()
        ledger.record(usage_record("late"))  # after close: dropped, counted
        with trio.move_on_after(0.2):
            await ledger.wait_stopped()
        assert ledger.statistics().unwritten == 1
        disk.free()
        with trio.fail_after(10):
            await ledger.wait_stopped()
    assert _rows(path) == recorded
    assert ledger.dropped == 1
