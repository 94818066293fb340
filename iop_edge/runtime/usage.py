"""The durable usage ledger (SPEC §7): one record per finished run, in SQLite.

Requests must not wait on disk, so `UsageLedger.record` is synchronous and only queues
the record on a bounded channel; one writer task (owned by the Edge's nursery) drains it
in batches gathered over a short window and inserts them from a worker thread (SQLite
in WAL mode). If the writer ever falls a whole
buffer behind, further records are counted as dropped and logged rather than blocking
callers: metering must never take the gateway down. Queries also run in a worker thread.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import ClassVar

import msgspec
import trio

log = logging.getLogger(__name__)

BUFFER = 10_000
BATCH = 500
BATCH_WINDOW_S = 0.05
GROUP_COLUMNS = ("principal_ref", "token_ref", "model", "provider", "node")

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
    ttft_ms REAL
);
CREATE INDEX IF NOT EXISTS usage_time ON usage(time);
"""


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


class UsageRow(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    principal_ref: str | None = None
    token_ref: str | None = None
    model: str | None = None
    provider: str | None = None
    node: str | None = None


class UsageReport(msgspec.Struct, frozen=True, kw_only=True):
    since: float | None
    until: float | None
    group_by: list[str]
    rows: list[UsageRow]


class UsageLedger:
    #: What a failed write raises (a batch is then lost, never the gateway); a ledger on
    #: another database names its driver's errors (see `ledger_postgres`).
    WRITE_ERRORS: ClassVar[tuple[type[Exception], ...]] = (sqlite3.Error,)

    def __init__(self, path: Path) -> None:
        self.path = path
        self._send, self._receive = trio.open_memory_channel[UsageRecord](BUFFER)
        self.dropped = 0
        self._queued = 0
        self._written = 0
        self._batch_written = trio.Event()
        self._stopped = trio.Event()

    def record(self, record: UsageRecord) -> None:
        try:
            self._send.send_nowait(record)
            self._queued += 1
        except trio.WouldBlock:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.error("usage ledger is behind; %d record(s) dropped so far", self.dropped)
        except (trio.ClosedResourceError, trio.BrokenResourceError):  # the writer is gone
            self.dropped += 1

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, check_same_thread=False)
        # WAL + NORMAL: a commit is an append, not an fsync'd rewrite; a power cut may
        # lose the last batch, a crash of the Edge process loses nothing committed.
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")
        connection.executescript(_SCHEMA)
        return connection

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer: owned by the Edge's nursery, drains the channel in batches."""
        connection = await trio.to_thread.run_sync(self._connect)
        task_status.started()
        try:
            async with self._receive:
                async for first in self._receive:
                    batch = [first]
                    # Gather what arrives within a short window: one commit per batch
                    # instead of one per request keeps the ledger off the hot path.
                    with trio.move_on_after(BATCH_WINDOW_S):
                        while len(batch) < BATCH:
                            try:
                                batch.append(await self._receive.receive())
                            except trio.EndOfChannel:
                                break
                    try:
                        await trio.to_thread.run_sync(self._insert, connection, batch)
                    except self.WRITE_ERRORS:
                        # Locked, full or broken disk: lose this batch, never the gateway.
                        self.dropped += len(batch)
                        log.exception("usage ledger: %d record(s) not written", len(batch))
                    self._written += len(batch)
                    self._batch_written.set()
                    self._batch_written = trio.Event()
        finally:
            connection.close()
            self._stopped.set()

    def close(self) -> None:
        """No more records: the writer drains what is queued, then stops."""
        self._send.close()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def wait_flushed(self) -> None:
        """Return once every record queued before this call is on disk."""
        target = self._queued
        while self._written < target:
            await self._batch_written.wait()

    @staticmethod
    def _insert(connection: sqlite3.Connection, batch: Sequence[UsageRecord]) -> None:
        with connection:
            connection.executemany(
                "INSERT INTO usage VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                [astuple(record) for record in batch],
            )

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
        select = ", ".join([*columns, "COUNT(*)", "SUM(prompt_tokens)", "SUM(completion_tokens)"])
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
            requests, prompt, completion = row[len(columns) :]
            if not requests:
                continue
            result.append(
                UsageRow(
                    requests=requests,
                    prompt_tokens=prompt or 0,
                    completion_tokens=completion or 0,
                    **keys,
                )
            )
        return UsageReport(since=since, until=until, group_by=columns, rows=result)
