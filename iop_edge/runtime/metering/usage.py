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
none, or the run was cut short), and the caller's protocol (`protocol`: chat, messages or
responses, design §14). A ledger written before one of those columns existed is migrated
in place when the Edge opens it; its old rows take the column's default ("provider",
"chat": all that Edge knew).
"""

from __future__ import annotations

import logging
import operator
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Final, Protocol

import msgspec
import trio

from iop_edge.runtime.metering.journal import SYNC_INTERVAL_S, Segment, UsageJournal, read_lines
from schemas.principals import PrincipalsReport

log = logging.getLogger(__name__)

BATCH_WINDOW_S = 0.05
#: Pause before retrying a batch the store refused (locked, disk full, unreachable).
RETRY_S: Final = 1.0
GROUP_COLUMNS = (
    "principal_ref",
    "token_ref",
    "model",
    "provider",
    "node",
    "usage_source",
    "status",
    "protocol",
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
    usage_source TEXT NOT NULL DEFAULT 'provider',
    protocol TEXT NOT NULL DEFAULT 'chat'
);
CREATE INDEX IF NOT EXISTS usage_time ON usage(time);
"""
#: Columns added since the first schema, with their definitions: an older ledger file gets
#: them with `ALTER TABLE` when opened (its rows take the default).
_ADDED_COLUMNS = {
    "usage_source": "TEXT NOT NULL DEFAULT 'provider'",
    "protocol": "TEXT NOT NULL DEFAULT 'chat'",
}


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
    protocol: str = "chat"
    """The caller's protocol: "chat", "messages" or "responses"."""


#: A record's values in `_INSERT`'s column order (`dataclasses.astuple` deep-copies each).
row_of: Final = operator.attrgetter(*(field.name for field in fields(UsageRecord)))
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
    protocol: str | None = None


class UsageReport(msgspec.Struct, frozen=True, kw_only=True):
    since: float | None
    until: float | None
    group_by: list[str]
    rows: list[UsageRow]
    principals: PrincipalsReport | None = None
    """Each principal against its limits now (the Edge adds it; a store does not)."""


_encode_record: Final = msgspec.json.Encoder().encode
_decode_record: Final = msgspec.json.Decoder(UsageRecord).decode


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


class LedgerStore(Protocol):
    """Where journaled records end up: SQLite (`SqliteStore`, the embedded default) or a
    database Edge replicas share (`ledger_postgres.PostgresStore`). Every method blocks and
    runs in a worker thread; the ledger calls one at a time."""

    WRITE_ERRORS: tuple[type[Exception], ...]
    """What a refused write raises (the ledger retries it later; the journal keeps the
    records meanwhile)."""
    shared: bool
    """Edges with other journal folders checkpoint here too (a database replicas share),
    so a checkpoint whose segment is not in this journal's folder may be theirs."""

    def open(self) -> None:
        """Connect; create or migrate the schema (the usage table, the checkpoints)."""

    def checkpoints(self) -> dict[str, int]:
        """Every journal segment's checkpoint saved so far (journal Rule 2)."""
        ...

    def insert(self, records: Sequence[UsageRecord], segment: str, offset: int) -> None:
        """Insert `records` and set `segment`'s checkpoint to `offset`, in one transaction.
        A record the store cannot hold is logged and skipped; the others go in."""

    def forget(self, segments: Sequence[str]) -> None:
        """Make what is committed durable, then drop these segments' checkpoints."""

    def aggregate(
        self, since: float | None, until: float | None, columns: list[str]
    ) -> UsageReport:
        """Rows grouped by `columns` (checked against `GROUP_COLUMNS` by the caller)."""
        ...

    def close(self) -> None: ...


class UsageLedger:
    """Records journaled on the event loop, moved into a `LedgerStore` by one writer task
    (see the module docstring)."""

    def __init__(
        self, path: Path, *, store: LedgerStore | None = None, retry_s: float = RETRY_S
    ) -> None:
        """`path` is the SQLite ledger file and its folder the journal's; `store` is where
        records go instead of that file (a database replicas share)."""
        self.path = path
        self.store = store if store is not None else SqliteStore(path)
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

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer: owned by the Edge's nursery. Replays a killed Edge's journal, then
        moves this process's journal into the store in batches until `close`."""
        store = self.store
        await trio.to_thread.run_sync(store.open)
        try:
            self._replayed = await trio.to_thread.run_sync(self._replay_orphans)
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
                if not await self._write_available(closing=closing):
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
            store.close()
            self._stopped.set()

    def _caught_up(self) -> bool:
        return all(s.checkpoint >= s.written for s in self.journal.segments)

    async def _write_available(self, *, closing: bool) -> bool:
        """Insert everything journaled so far and delete the segments done with; False
        when the store refused (the journal keeps the records: retry later)."""
        segments = list(self.journal.segments)
        try:
            committed, done = await trio.to_thread.run_sync(_drain, self.store, segments, closing)
        except self.store.WRITE_ERRORS:
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
        """Return once every record journaled before this call is in the store."""
        target = self._journaled
        while self._committed < target:
            await self._batch_written.wait()

    def _replay_orphans(self) -> int:
        """Worker thread: insert what dead Edges left in their journals, then delete
        those segments (journal Rule 3)."""
        checkpoints = self.store.checkpoints()
        orphans = self.journal.claim_orphans()
        total = 0
        for segment in orphans:
            segment.checkpoint = checkpoints.pop(segment.name, 0)
            total += _insert_all(self.store, segment)
        _finish(self.store, orphans)
        # Checkpoints of segments already gone (a crash in the middle of a cleanup); in a
        # shared store the others may belong to other Edges' journals: left alone.
        if not self.store.shared:
            stale = [name for name in checkpoints if not (self.path.parent / name).exists()]
            if stale:
                self.store.forget(stale)
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
        return await trio.to_thread.run_sync(self.store.aggregate, since, until, columns)


def _drain(store: LedgerStore, segments: list[Segment], closing: bool) -> tuple[int, list[Segment]]:
    """Worker thread: insert what `segments` hold past their checkpoints, then delete the
    ones read to their end that take no more appends (journal Rule 4). Returns the lines
    consumed and the segments deleted; raises the store's `WRITE_ERRORS`."""
    committed = sum(_insert_all(store, segment) for segment in segments)
    done = [s for s in segments if (s.retired or closing) and s.checkpoint >= s.written]
    _finish(store, done)
    return committed, done


def _insert_all(store: LedgerStore, segment: Segment) -> int:
    """Insert `segment`'s complete lines past its checkpoint; returns how many. A torn
    last line (a dead writer's) is left where it is."""
    total = 0
    while segment.checkpoint < segment.written:
        before = segment.checkpoint
        lines, end = read_lines(segment)
        records = []
        for line in lines:
            try:
                records.append(_decode_record(line))
            except msgspec.DecodeError:  # journal Rule 6
                log.error("usage journal %s: an unreadable record skipped", segment.name)
        store.insert(records, segment.name, end)  # journal Rule 2: one transaction
        segment.checkpoint = end
        total += len(lines)
        if segment.checkpoint == before:
            break
    return total


def _finish(store: LedgerStore, segments: Sequence[Segment]) -> None:
    """Sync the store, then delete the segments and their checkpoints (Rule 4)."""
    if not segments:
        return
    for segment in segments:
        UsageJournal.delete(segment)
    store.forget([segment.name for segment in segments])


# --- SQLite -----------------------------------------------------------------------------

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

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, check_same_thread=False)
        # WAL + NORMAL: a commit is an append, not an fsync'd rewrite. A power cut may
        # lose the last commits; the journal (fsynced every SYNC_INTERVAL_S) replays them.
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")
        connection.executescript(_SCHEMA)
        connection.executescript(_CHECKPOINT_SCHEMA)
        _migrate(connection)
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

    def aggregate(
        self, since: float | None, until: float | None, columns: list[str]
    ) -> UsageReport:
        where, params = [], []
        if since is not None:
            where.append("time >= ?")
            params.append(since)
        if until is not None:
            where.append("time < ?")
            params.append(until)
        select = ", ".join([*columns, *AGGREGATES])
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
        return usage_report(since, until, columns, rows)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


#: The sums every usage row carries, in `usage_report`'s order (standard SQL).
AGGREGATES: Final = (
    "COUNT(*)",
    "SUM(prompt_tokens)",
    "SUM(completion_tokens)",
    "SUM(CASE WHEN usage_source = 'estimated' THEN 1 ELSE 0 END)",
    "SUM(CASE WHEN usage_source = 'estimated' THEN prompt_tokens + completion_tokens ELSE 0 END)",
)


def usage_report(
    since: float | None, until: float | None, columns: list[str], rows: Sequence[Sequence[Any]]
) -> UsageReport:
    """The report of grouped rows (`columns`, then `AGGREGATES`), whatever the store."""
    result = []
    for row in rows:
        keys = dict(zip(columns, row[: len(columns)], strict=True))
        requests, prompt, completion, estimated, estimated_tokens = row[len(columns) :]
        if not requests:
            continue
        result.append(
            UsageRow(
                requests=int(requests),
                prompt_tokens=int(prompt or 0),
                completion_tokens=int(completion or 0),
                estimated_requests=int(estimated or 0),
                estimated_tokens=int(estimated_tokens or 0),
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
