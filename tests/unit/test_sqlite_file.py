"""The SQLite file the usage ledger and the Responses store share (`metering.sqlite_file`):
a write-ahead log a held reader let grow gives its disk back after the next checkpoint."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from iop_edge.runtime.metering.response_store import ResponseRow, SqliteResponses
from iop_edge.runtime.metering.sqlite_file import WAL_LIMIT_BYTES
from iop_edge.runtime.metering.usage_ledger.ledger_sqlite import SqliteStore
from tests.unit.usage_records import usage_record

_MIB = 1024 * 1024


def _wal_bytes(path: Path) -> int:
    wal = path.with_name(path.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


def _response(number: int) -> ResponseRow:
    body = bytes([number % 251]) * _MIB  # incompressible enough: SQLite stores it as is
    return ResponseRow(
        id=f"resp_{number}", principal_ref="p", previous_id=None, input=b"[]", response=body
    )


def test_a_log_grown_behind_a_held_reader_shrinks_after_the_next_checkpoint(
    tmp_path: Path,
) -> None:
    path = tmp_path / "usage.db"
    ledger = SqliteStore(path)
    ledger.open()
    responses = SqliteResponses(path)
    responses.open()
    reader = sqlite3.connect(path)
    try:
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM usage").fetchone()  # holds its snapshot
        for number in range(3 * WAL_LIMIT_BYTES // _MIB):
            assert responses.put(_response(number), continues=[], now=1.0)
        grown = _wal_bytes(path)
        assert grown > 2 * WAL_LIMIT_BYTES  # no checkpoint could restart the log
        reader.rollback()

        ledger.forget([])  # the writer's checkpoint, as after a journal segment
        ledger.insert([usage_record("run_1")], segment="s", offset=1)  # restarts the log

        assert _wal_bytes(path) <= WAL_LIMIT_BYTES
        # Nothing was lost on the way: the rows are all in the database file.
        assert responses.open() == 3 * WAL_LIMIT_BYTES // _MIB
        assert ledger.checkpoints() == {"s": 1}
    finally:
        reader.close()
        responses.close()
        ledger.close()
