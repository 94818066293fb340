"""The durable usage ledger (SPEC §7): one record per finished run, in SQLite.

Requests must not wait on SQLite, yet a response its caller received completely must be
in the ledger even if the Edge is killed right after (SPEC §7, crash-safe). So
`UsageLedger.record` is synchronous and does one thing: append the record to the journal
(`journal.py`: one `write()` to a file in `state_dir`, done before the run's last bytes
go to the caller). One writer task (owned by the Edge's nursery) reads the journal in
batches gathered over a short window and inserts them from a worker thread (SQLite in WAL
mode), moving the journal's checkpoint in the same transaction; at start-up it first
replays what a killed Edge left in its journal. A failing insert is retried, never
dropped: the journal holds the records meanwhile. Metering never takes the gateway down:
a record that cannot even be journaled (disk full) is counted as dropped and logged.
Queries also run in a worker thread.

Every record says where its token counts come from (`usage_source`, SPEC §7): "provider"
(the provider reported them) or "estimated" (IOP estimated them: the provider reported
none, or the run was cut short). A ledger written before that column existed is migrated
in place when the Edge opens it; its old rows count as "provider" (all that Edge knew).
"""

from __future__ import annotations

import logging
import operator
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Final

import msgspec
import trio

from iop_edge.runtime.journal import (
    CHECKPOINT_SCHEMA,
    SYNC_INTERVAL_S,
    Segment,
    UsageJournal,
    read_lines,
    saved_checkpoints,
)

log = logging.getLogger(__name__)

BATCH_WINDOW_S = 0.05
#: Pause before retrying a batch SQLite refused (locked, disk full).
RETRY_S: Final = 1.0
GROUP_COLUMNS = (
    "principal_ref",
    "token_ref",
    "model",
    "provider",
    "node",
    "usage_source",
    "status",
)

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
    usage_source TEXT NOT NULL DEFAULT 'provider'
);
CREATE INDEX IF NOT EXISTS usage_time ON usage(time);
"""
#: Columns added since the first schema, with their definitions: an older ledger file gets
#: them with `ALTER TABLE` when opened (its rows take the default).
_ADDED_COLUMNS = {"usage_source": "TEXT NOT NULL DEFAULT 'provider'"}


@dataclass(frozen=True, slots=True)
class UsageRecord:
    time: float
    run_id: str
    principal_ref: str
    token_ref: str
    alias: str | None
    model: str
    provider: str
    node: str
    prompt_tokens: int
    completion_tokens: int
    status: int
    latency_ms: float
    ttft_ms: float | None
    usage_source: str = "provider"
    """"provider" or "estimated" (see the module docstring)."""


#: A record's values in `_INSERT`'s column order (`dataclasses.astuple` deep-copies each).
_row: Final = operator.attrgetter(*(field.name for field in fields(UsageRecord)))
_INSERT = "INSERT INTO usage ({}) VALUES ({})".format(
    ", ".join(field.name for field in fields(UsageRecord)),
    ", ".join("?" for _ in fields(UsageRecord)),
)


class UsageRow(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    estimated_requests: int
    """How many of `requests` carry estimated token counts (`usage_source: estimated`)."""
    estimated_tokens: int
    """How many of the prompt + completion tokens are estimates."""
    principal_ref: str | None = None
    token_ref: str | None = None
    model: str | None = None
    provider: str | None = None
    node: str | None = None
    usage_source: str | None = None
    status: int | None = None
    """The HTTP status the caller got (when grouped by `status`)."""


class UsageReport(msgspec.Struct, frozen=True, kw_only=True):
    since: float | None
    until: float | None
    group_by: list[str]
    rows: list[UsageRow]


_encode_record: Final = msgspec.json.Encoder().encode
_decode_record: Final = msgspec.json.Decoder(UsageRecord).decode
_SAVE_CHECKPOINT: Final = (
    "INSERT INTO journal_checkpoint (segment, offset) VALUES (?, ?) "
    "ON CONFLICT (segment) DO UPDATE SET offset = excluded.offset"
)
#: A row SQLite cannot store (an integer past 64 bits...): skipped, never retried.
_BAD_ROW: Final = (OverflowError, sqlite3.InterfaceError, sqlite3.IntegrityError)


@dataclass(frozen=True, slots=True)
class LedgerStatistics:
    journaled: int
    """Records this process appended to the journal."""
    committed: int
    """Of those, records in SQLite (or skipped as unreadable)."""
    replayed: int
    """Records a killed Edge left in its journal, inserted at start-up."""
    dropped: int
    """Records that could not even be journaled (or came after `close`)."""
    failed_writes: int
    """Batches SQLite refused (each retried)."""


class UsageLedger:
    def __init__(self, path: Path, *, retry_s: float = RETRY_S) -> None:
        self.path = path
        self.journal = UsageJournal(path.parent)
        self.dropped = 0
        self._retry_s = retry_s
        self._journaled = 0
        self._committed = 0
        self._replayed = 0
        self._failed_writes = 0
        self._appended = trio.Event()
        self._batch_written = trio.Event()
        self._stopped = trio.Event()

    def statistics(self) -> LedgerStatistics:
        return LedgerStatistics(
            journaled=self._journaled,
            committed=self._committed,
            replayed=self._replayed,
            dropped=self.dropped,
            failed_writes=self._failed_writes,
        )

    def record(self, record: UsageRecord) -> None:
        """Journal `record` (one small write, no fsync); the writer takes it from there."""
        try:
            self.journal.append(_encode_record(record) + b"\n")
        except (OSError, ValueError) as exc:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.error("usage ledger: %d record(s) dropped so far (%s)", self.dropped, exc)
            return
        self._journaled += 1
        self._appended.set()

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, check_same_thread=False)
        # WAL + NORMAL: a commit is an append, not an fsync'd rewrite. A power cut may
        # lose the last commits; the journal (fsynced every SYNC_INTERVAL_S) replays them.
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")
        connection.executescript(_SCHEMA)
        connection.executescript(CHECKPOINT_SCHEMA)
        _migrate(connection)
        return connection

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer: owned by the Edge's nursery. Replays a killed Edge's journal, then
        moves this process's journal into SQLite in batches until `close`."""
        connection = await trio.to_thread.run_sync(self._connect)
        try:
            self._replayed = await trio.to_thread.run_sync(self._replay_orphans, connection)
            if self._replayed:
                log.warning(
                    "usage ledger: %d record(s) recovered from the journal of an Edge that "
                    "stopped before writing them",
                    self._replayed,
                )
            await trio.to_thread.run_sync(self.journal.open)
            task_status.started()
            synced_at = time.monotonic()
            while True:
                appended = self._appended
                if self._caught_up() and not self.journal.closed:
                    await appended.wait()
                    # Gather what arrives within a short window: one commit per batch
                    # instead of one per request keeps the ledger off the hot path.
                    await trio.sleep(BATCH_WINDOW_S)
                self._appended = trio.Event()
                closing = self.journal.closed
                if not await self._write_available(connection, closing=closing):
                    await trio.sleep(self._retry_s)
                    continue
                if closing and self._caught_up():
                    return
                if time.monotonic() - synced_at >= SYNC_INTERVAL_S:
                    await trio.to_thread.run_sync(self.journal.sync)
                    synced_at = time.monotonic()
        finally:
            # What is left stays on disk for the next start-up; the locks go with the
            # descriptors, as they would with the process.
            self.journal.release()
            connection.close()
            self._stopped.set()

    def _caught_up(self) -> bool:
        return all(s.checkpoint >= s.written for s in self.journal.segments)

    async def _write_available(self, connection: sqlite3.Connection, *, closing: bool) -> bool:
        """Insert everything journaled so far and delete the segments done with; False
        when SQLite refused (the journal keeps the records: retry later)."""
        segments = list(self.journal.segments)
        try:
            committed, done = await trio.to_thread.run_sync(_drain, connection, segments, closing)
        except sqlite3.Error:
            self._failed_writes += 1
            log.exception("usage ledger: batch not written; retrying in %gs", self._retry_s)
            return False
        # Only this task and `record`, both on the event loop, change the list.
        self.journal.segments = [s for s in self.journal.segments if s not in done]
        self._committed += committed
        self._batch_written.set()
        self._batch_written = trio.Event()
        return True

    def close(self) -> None:
        """No more records: the writer drains what is journaled, then stops."""
        self.journal.close()
        self._appended.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def wait_flushed(self) -> None:
        """Return once every record journaled before this call is in SQLite."""
        target = self._journaled
        while self._committed < target:
            await self._batch_written.wait()

    def _replay_orphans(self, connection: sqlite3.Connection) -> int:
        """Worker thread: insert what dead Edges left in their journals, then delete
        those segments (journal Rule 3)."""
        checkpoints = saved_checkpoints(connection)
        orphans = self.journal.claim_orphans()
        total = 0
        for segment in orphans:
            segment.checkpoint = checkpoints.pop(segment.name, 0)
            total += _insert_all(connection, segment)
        _finish(connection, orphans)
        # Checkpoints of segments already gone: left by a crash in the middle of a cleanup.
        stale = [(name,) for name in checkpoints if not (self.path.parent / name).exists()]
        with connection:
            connection.executemany("DELETE FROM journal_checkpoint WHERE segment = ?", stale)
        return total

    async def aggregate(
        self, *, since: float | None, until: float | None, group_by: Sequence[str]
    ) -> UsageReport:
        unknown = [column for column in group_by if column not in GROUP_COLUMNS]
        if unknown:
            raise ValueError(
                f"group_by: unknown column(s) {', '.join(unknown)}; "
                f"choose from {', '.join(GROUP_COLUMNS)}"
            )
        columns = list(dict.fromkeys(group_by))
        return await trio.to_thread.run_sync(self._aggregate, since, until, columns)

    def _aggregate(
        self, since: float | None, until: float | None, columns: list[str]
    ) -> UsageReport:
        where, params = [], []
        if since is not None:
            where.append("time >= ?")
            params.append(since)
        if until is not None:
            where.append("time < ?")
            params.append(until)
        select = ", ".join(
            [
                *columns,
                "COUNT(*)",
                "SUM(prompt_tokens)",
                "SUM(completion_tokens)",
                "SUM(usage_source = 'estimated')",
                "SUM(CASE WHEN usage_source = 'estimated'"
                " THEN prompt_tokens + completion_tokens ELSE 0 END)",
            ]
        )
        sql = f"SELECT {select} FROM usage"  # columns come from GROUP_COLUMNS only
        if where:
            sql += " WHERE " + " AND ".join(where)
        if columns:
            sql += " GROUP BY " + ", ".join(columns) + " ORDER BY " + ", ".join(columns)
        # The writer created the file and schema at start-up; a query only reads.
        connection = sqlite3.connect(self.path)
        try:
            rows = connection.execute(sql, params).fetchall()
        finally:
            connection.close()
        result = []
        for row in rows:
            keys = dict(zip(columns, row[: len(columns)], strict=True))
            requests, prompt, completion, estimated, estimated_tokens = row[len(columns) :]
            if not requests:
                continue
            result.append(
                UsageRow(
                    requests=requests,
                    prompt_tokens=prompt or 0,
                    completion_tokens=completion or 0,
                    estimated_requests=estimated or 0,
                    estimated_tokens=estimated_tokens or 0,
                    **keys,
                )
            )
        return UsageReport(since=since, until=until, group_by=columns, rows=result)


def _migrate(connection: sqlite3.Connection) -> None:
    """Add the columns an older ledger file lacks (`_ADDED_COLUMNS`)."""
    present = {row[1] for row in connection.execute("PRAGMA table_info(usage)")}
    for name, definition in _ADDED_COLUMNS.items():
        if name not in present:
            log.info("usage ledger: adding column %s (a ledger from an older Edge)", name)
            with connection:
                connection.execute(f"ALTER TABLE usage ADD COLUMN {name} {definition}")


def _drain(
    connection: sqlite3.Connection, segments: list[Segment], closing: bool
) -> tuple[int, list[Segment]]:
    """Worker thread: insert what `segments` hold past their checkpoints, then delete the
    ones read to their end that take no more appends (journal Rule 4). Returns the lines
    consumed and the segments deleted; raises `sqlite3.Error` when SQLite refuses."""
    committed = sum(_insert_all(connection, segment) for segment in segments)
    done = [s for s in segments if (s.retired or closing) and s.checkpoint >= s.written]
    _finish(connection, done)
    return committed, done


def _insert_all(connection: sqlite3.Connection, segment: Segment) -> int:
    """Insert `segment`'s complete lines past its checkpoint; returns how many. A torn
    last line (a dead writer's) is left where it is."""
    total = 0
    while segment.checkpoint < segment.written:
        before = segment.checkpoint
        total += _insert_from(connection, segment)
        if segment.checkpoint == before:
            break
    return total


def _insert_from(connection: sqlite3.Connection, segment: Segment) -> int:
    """Insert the next batch of `segment`'s lines and move its checkpoint past them, in
    one transaction (journal Rule 2); returns the lines consumed."""
    lines, end = read_lines(segment)
    rows = []
    for line in lines:
        try:
            rows.append(_row(_decode_record(line)))
        except msgspec.DecodeError:  # journal Rule 6
            log.error("usage journal %s: an unreadable record skipped", segment.name)
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
        connection.execute(_SAVE_CHECKPOINT, (segment.name, end))
    segment.checkpoint = end
    return len(lines)


def _finish(connection: sqlite3.Connection, segments: Sequence[Segment]) -> None:
    """Sync the database, then delete the segments and their checkpoints (Rule 4)."""
    if not segments:
        return
    connection.execute("PRAGMA wal_checkpoint(FULL)")
    for segment in segments:
        UsageJournal.delete(segment)
    with connection:
        connection.executemany(
            "DELETE FROM journal_checkpoint WHERE segment = ?", [(s.name,) for s in segments]
        )
