"""The embedded usage ledger: one SQLite file in WAL mode (design §7).

The default `LedgerStore` (`usage_store`), beside the shared PostgreSQL one
(`ledger_postgres`): the `usage` table, the journal's checkpoints saved in the same
transaction as the rows they cover, and the report's queries run on a connection of
their own.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from iop_edge.runtime.metering.sqlite_file import open_shared
from iop_edge.runtime.metering.usage_ledger import ledger_schema
from iop_edge.runtime.metering.usage_ledger.usage_store import (
    UsageRecord,
    UsageReport,
    UsageSelection,
    aggregate_sql,
    paged,
    row_of,
    totals_sql,
    usage_report,
)

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    time REAL NOT NULL,
    run_id TEXT NOT NULL,
    principal_ref TEXT NOT NULL,
    token_ref TEXT NOT NULL,
    alias TEXT,
    model TEXT NOT NULL,
    provider TEXT NOT NULL,
    node TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    status INTEGER NOT NULL,
    latency_ms REAL NOT NULL,
    ttft_ms REAL,
    usage_source TEXT NOT NULL DEFAULT 'provider',
    protocol TEXT NOT NULL DEFAULT 'chat',
    cached_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS usage_time ON usage(time);
"""
_INSERT = "INSERT INTO usage ({}) VALUES ({})".format(
    ", ".join(UsageRecord.__struct_fields__),
    ", ".join("?" for _ in UsageRecord.__struct_fields__),
)

_CHECKPOINT_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS journal_checkpoint (
    segment TEXT PRIMARY KEY,
    offset INTEGER NOT NULL
);
"""
_SAVE_CHECKPOINT: Final = (
    "INSERT INTO journal_checkpoint (segment, offset) VALUES (?, ?) "
    "ON CONFLICT (segment) DO UPDATE SET offset = excluded.offset"
)
#: A row SQLite cannot store (an integer past 64 bits...): skipped, never retried.
_BAD_ROW: Final = (OverflowError, sqlite3.InterfaceError, sqlite3.IntegrityError)


class SqliteStore:
    """The embedded ledger: one SQLite file in WAL mode (several Edges on one host may
    share it: SQLite takes their writers in turn)."""

    WRITE_ERRORS: tuple[type[Exception], ...] = (sqlite3.Error,)
    shared = False

    def __init__(self, path: Path) -> None:
        self.path = path
        self._connection: sqlite3.Connection | None = None

    def __repr__(self) -> str:
        return f"SQLite {self.path}"

    def open(self) -> None:
        connection = open_shared(self.path)
        connection.executescript(_SCHEMA)
        connection.executescript(_CHECKPOINT_SCHEMA)
        ledger_schema.migrate(connection)
        ledger_schema.create_index(connection)
        self._connection = connection

    def _db(self) -> sqlite3.Connection:
        if self._connection is None:
            raise RuntimeError("the SQLite ledger is not open")
        return self._connection

    def checkpoints(self) -> dict[str, int]:
        return dict(self._db().execute("SELECT segment, offset FROM journal_checkpoint"))

    def insert(self, records: Sequence[UsageRecord], segment: str, offset: int) -> None:
        connection = self._db()
        rows = [row_of(record) for record in records]
        with connection:
            try:
                connection.executemany(_INSERT, rows)
            except _BAD_ROW:
                # One bad row must not hold back the others: insert them one by one.
                connection.rollback()
                for row in rows:
                    try:
                        connection.execute(_INSERT, row)
                    except _BAD_ROW:
                        log.error("usage ledger: record %s cannot be stored; skipped", row[1])
            connection.execute(_SAVE_CHECKPOINT, (segment, offset))

    def forget(self, segments: Sequence[str]) -> None:
        connection = self._db()
        connection.execute("PRAGMA wal_checkpoint(FULL)")
        with connection:
            connection.executemany(
                "DELETE FROM journal_checkpoint WHERE segment = ?", [(s,) for s in segments]
            )

    def aggregate(self, selection: UsageSelection) -> UsageReport:
        # The writer created the file and schema at start-up; a query only reads.
        connection = sqlite3.connect(self.path)
        try:
            sql, params = aggregate_sql(selection, "?")
            rows = connection.execute(sql, params).fetchall()
            totals = None
            if paged(selection, rows):
                sql, params = totals_sql(selection, "?")
                totals = connection.execute(sql, params).fetchone()
        finally:
            connection.close()
        return usage_report(selection, rows, totals)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
