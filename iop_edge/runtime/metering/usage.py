"""The durable usage ledger (design §7): one record per finished run, in SQLite.

Requests must not wait on SQLite, yet a response its caller received completely must be
in the ledger even if the Edge is killed right after (design §7, crash-safe). So
`UsageLedger.record` is synchronous and does one thing: append the record to the journal
(`journal.py`: one `write()` to a file in `state_dir`, done before the run's last bytes
go to the caller). One writer task (owned by the Edge's nursery) reads the journal in
batches gathered over a short window and inserts them from a worker thread (SQLite in WAL
mode), moving the journal's checkpoint in the same transaction; at start-up it first
replays what a killed Edge left in its journal. A failing insert is retried, never
dropped: the journal holds the records meanwhile, and the outage is logged once when it
begins and once when it ends, with how many records waited. Queries also run in a worker
thread; a store that cannot answer is `LedgerUnavailable`, with the reason.

A full disk (the journal in `state_dir` cannot be written):

1. A record the journal refuses waits in memory, in order; while any wait, new records
   queue behind them, so the journal keeps the order of the runs' ends. The writer's
   companion task retries them every `RETRY_S` (a disk says nothing when it has room
   again) and appends them in batches of whole lines (journal Rule 7).
2. The state follows the buffer: `writable` (nothing waits), `buffering`, `full` (at
   least `edge.ledger_buffer_records` wait). Each change is one log line with the count,
   and is counted for `/metrics`. When `full`, `edge.ledger_when_unwritable` decides:
   `refuse` (the default) makes the Edge refuse new runs (503 `metering_unavailable`) and
   `/readyz` say why, while the records of runs already under way are still kept (up to
   twice the bound); `serve` serves on, and the records past the bound are dropped and
   counted: those runs go unmetered, as the operator chose.
3. A record is lost only past those bounds, or when the Edge stops before the disk has
   room (its grace period is spent retrying): each loss is logged with its count.

Every record says where its token counts come from (`usage_source`, design §7): "provider"
(the provider reported them) or "estimated" (IOP estimated them: the provider reported
none, or the run was cut short), and the caller's protocol (`protocol`: chat, messages or
responses, design §14). A ledger written before one of those columns existed is migrated
in place when the Edge opens it (`ledger_schema`); its old rows take the column's
default ("provider", "chat", no cached tokens: all that Edge knew). `cached_tokens` is the
part of the prompt the runtime reported taking from its prefix cache (0 when it says
nothing).
"""

from __future__ import annotations

import base64
import logging
import sqlite3
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, Protocol

import msgspec
import trio

from iop_edge.runtime.metering import ledger_schema
from iop_edge.runtime.metering.journal import SYNC_INTERVAL_S, Segment, UsageJournal, read_lines
from schemas.config import DEFAULT_LEDGER_BUFFER_RECORDS, WhenUnwritable
from schemas.principals import PrincipalsReport

log = logging.getLogger(__name__)

BATCH_WINDOW_S = 0.05
#: Pause before retrying a batch the store refused (locked, disk full, unreachable), and
#: before retrying to journal the records waiting in memory.
RETRY_S: Final = 1.0
#: How much of the records waiting in memory goes to the journal in one write.
FLUSH_BYTES: Final = 256 * 1024
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
    protocol TEXT NOT NULL DEFAULT 'chat',
    cached_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS usage_time ON usage(time);
"""


class UsageRecord(msgspec.Struct, frozen=True, gc=False):
    """One finished run, as the ledger keeps it: a journal line (JSON, an object of these
    fields) and a row of the `usage` table (these columns, in this order). A struct: one
    is built, encoded and decoded for every run."""

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
    cached_tokens: int = 0
    """Of `prompt_tokens`, those the runtime reported taking from its prefix cache."""


#: A record's values in `_INSERT`'s column order.
row_of: Final = msgspec.structs.astuple
_INSERT = "INSERT INTO usage ({}) VALUES ({})".format(
    ", ".join(UsageRecord.__struct_fields__),
    ", ".join("?" for _ in UsageRecord.__struct_fields__),
)


class UsageRow(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Of `prompt_tokens`, those the runtimes reported taking from their prefix cache."""
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
    """One page of the groups, in the order of `group_by`'s columns."""
    totals: UsageRow | None = None
    """Every record in the window, whichever page this is (None: there are none)."""
    truncated: bool = False
    """More groups follow this page: ask again with `after` set to `next`."""
    next: str | None = None
    """The cursor of the next page (None on the last one)."""
    principals: PrincipalsReport | None = None
    """Each principal against its limits now (the Edge adds it; a store does not)."""


@dataclass(frozen=True, slots=True)
class UsageSelection:
    """What a store is asked for: the window, the grouping, and one page of the groups.

    The groups come in the order of `columns` (an index serves the default grouping in
    that order, so a page costs what it returns); a page starts after the group `after`
    (the last key of the previous page) and holds at most `limit` groups."""

    since: float | None
    until: float | None
    columns: list[str]
    """Checked against `GROUP_COLUMNS` (they are written into the SQL)."""
    limit: int | None = None
    """None: every group (the principals' budgets read them all)."""
    after: tuple[Any, ...] | None = None


_encode_record: Final = msgspec.json.Encoder().encode
_decode_record: Final = msgspec.json.Decoder(UsageRecord).decode


JournalState = Literal["writable", "buffering", "full"]
_STATES: Final[tuple[JournalState, ...]] = ("writable", "buffering", "full")


@dataclass(frozen=True, slots=True)
class LedgerStatistics:
    journaled: int
    """Records this process appended to the journal."""
    committed: int
    """Of those, records in the store (or skipped as unreadable)."""
    replayed: int
    """Records a killed Edge left in its journal, inserted at start-up."""
    dropped: int
    """Records lost: past the in-memory buffer (`when_unwritable: serve`), or after
    `close`."""
    failed_writes: int
    """Batches the store refused (each retried)."""
    unwritten: int = 0
    """Records waiting in memory for the journal to take them."""
    state: JournalState = "writable"
    state_changes: dict[JournalState, int] = field(default_factory=dict)
    """How many times the ledger entered each state."""
    store_down: bool = False
    """The store refuses writes now (records wait in the journal)."""


class LedgerUnavailable(Exception):
    """The ledger cannot be used at all (opened, queried); the message says why."""


class LedgerStore(Protocol):
    """Where journaled records end up: SQLite (`SqliteStore`, the embedded default) or a
    database Edge replicas share (`ledger_postgres.PostgresStore`). Every method blocks and
    runs in a worker thread; the ledger calls one at a time."""

    WRITE_ERRORS: tuple[type[Exception], ...]
    """What a refused write raises (the ledger retries it later; the journal keeps the
    records meanwhile), and a query that cannot be answered (`LedgerUnavailable`)."""
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

    def aggregate(self, selection: UsageSelection) -> UsageReport:
        """One page of the records grouped, summed in the database (`aggregate_sql`)."""
        ...

    def close(self) -> None: ...


class UsageLedger:
    """Records journaled on the event loop, moved into a `LedgerStore` by one writer task
    (see the module docstring)."""

    def __init__(
        self,
        path: Path,
        *,
        store: LedgerStore | None = None,
        retry_s: float = RETRY_S,
        buffer_records: int = DEFAULT_LEDGER_BUFFER_RECORDS,
        when_full: WhenUnwritable = "refuse",
    ) -> None:
        """`path` is the SQLite ledger file and its folder the journal's; `store` is where
        records go instead of that file (a database replicas share). `buffer_records` and
        `when_full`: what happens while the journal cannot be written (module docstring,
        "A full disk")."""
        self.path = path
        self.store = store if store is not None else SqliteStore(path)
        self.journal = UsageJournal(path.parent)
        self.dropped = 0
        self.buffer_records = buffer_records
        self.when_full: WhenUnwritable = when_full
        self._retry_s = retry_s
        self._journaled = 0
        self._committed = 0
        self._replayed = 0
        self._failed_writes = 0
        self._closing = False
        self._unwritten: deque[bytes] = deque()
        """Encoded records the journal could not take yet, oldest first."""
        self._state: JournalState = "writable"
        self._state_changes: dict[JournalState, int] = dict.fromkeys(_STATES, 0)
        self._journal_problem = ""
        """Why the journal could not be written, last time it could not."""
        self._store_down_since: float | None = None
        self._store_problem = ""
        self._appended = trio.Event()
        self._batch_written = trio.Event()
        self._unwritten_waiting = trio.Event()
        self._stopped = trio.Event()

    def statistics(self) -> LedgerStatistics:
        return LedgerStatistics(
            journaled=self._journaled,
            committed=self._committed,
            replayed=self._replayed,
            dropped=self.dropped,
            failed_writes=self._failed_writes,
            unwritten=len(self._unwritten),
            state=self._state,
            state_changes=dict(self._state_changes),
            store_down=self._store_down_since is not None,
        )

    # --- recording (the event loop, on every run's end) ----------------------------------

    def record(self, record: UsageRecord) -> None:
        """Journal `record` (one small write, no fsync); the writer takes it from there. A
        record the journal cannot take waits in memory behind the others (module
        docstring, "A full disk")."""
        line = _encode_record(record) + b"\n"
        if self._closing:
            self._drop("the ledger is closed")
            return
        if not self._unwritten:
            try:
                self.journal.append(line)
            except OSError as exc:
                self._journal_problem = _os_problem(exc)
            except ValueError:  # not open yet: the writer opens it first thing
                self._journal_problem = "the journal is not open yet"
            else:
                self._journaled += 1
                self._appended.set()
                return
        self._keep(line)

    def _keep(self, line: bytes) -> None:
        """Hold a record the journal could not take (Rules 1-2 of "A full disk")."""
        ceiling = self.buffer_records * (2 if self.when_full == "refuse" else 1)
        if len(self._unwritten) >= ceiling:
            self._drop(f"{len(self._unwritten)} records already wait in memory")
            return
        self._unwritten.append(line)
        self._update_state()

    def _drop(self, why: str) -> None:
        self.dropped += 1
        if self.dropped == 1 or self.dropped % 1000 == 0:
            log.error("usage ledger: %d record(s) dropped so far (%s)", self.dropped, why)

    @property
    def state(self) -> JournalState:
        """`writable`, `buffering` (records wait in memory) or `full` (the buffer is)."""
        return self._state

    @property
    def refuses_runs(self) -> bool:
        """New runs must be refused: the buffer is full and the policy says refuse."""
        return self._state == "full" and self.when_full == "refuse"

    def problem(self) -> str | None:
        """Why records cannot be journaled now, for `/readyz` and the 503 that refuses a
        run; None while the journal is written."""
        if self._state == "writable":
            return None
        waiting = len(self._unwritten)
        text = (
            f"the usage journal in {self.journal.directory} cannot be written "
            f"({self._journal_problem}): {waiting} usage record(s) wait in memory"
        )
        if self._state == "full":
            text += (
                f", the most it keeps (edge.ledger_buffer_records: {self.buffer_records}); "
                + (
                    "new runs are refused until the disk has room"
                    if self.when_full == "refuse"
                    else "runs are served unmetered until the disk has room"
                )
                + f" (edge.ledger_when_unwritable: {self.when_full})"
            )
        return text

    def _update_state(self) -> None:
        """The state follows the buffer; each change is one log line and counted."""
        waiting = len(self._unwritten)
        if not waiting:
            state: JournalState = "writable"
        elif waiting >= self.buffer_records:
            state = "full"
        else:
            state = "buffering"
        previous = self._state
        if state == previous:
            return
        self._state = state
        self._state_changes[state] += 1
        if previous == "writable":
            self._unwritten_waiting.set()
        match state:
            case "buffering" if previous == "writable":
                log.error(
                    "usage ledger: the journal in %s cannot be written (%s): usage records "
                    "wait in memory (%d so far, at most %d) and are written once it can",
                    self.journal.directory,
                    self._journal_problem,
                    waiting,
                    self.buffer_records,
                )
            case "full":
                log.error("usage ledger: %s", self.problem())
            case "buffering":
                log.warning(
                    "usage ledger: %d usage record(s) still wait in memory (%s); new runs "
                    "are admitted again",
                    waiting,
                    self._journal_problem,
                )
            case "writable":
                log.warning(
                    "usage ledger: the journal in %s is written again: every record that "
                    "waited in memory is in it",
                    self.journal.directory,
                )

    async def _write_unwritten(self) -> None:
        """Retry the records waiting in memory, oldest first, every `retry_s` (a full disk
        says nothing when it has room again) until none wait."""
        while True:
            await self._unwritten_waiting.wait()
            while self._unwritten:
                await trio.sleep(self._retry_s)
                await self._flush_unwritten()
            self._unwritten_waiting = trio.Event()

    async def _flush_unwritten(self) -> None:
        """Append what waits in memory, in batches of whole lines (journal Rule 7: a batch
        goes in whole or not at all), until the journal refuses one."""
        while self._unwritten:
            batch: list[bytes] = []
            size = 0
            for line in self._unwritten:
                batch.append(line)
                size += len(line)
                if size >= FLUSH_BYTES:
                    break
            try:
                self.journal.append(b"".join(batch))
            except OSError as exc:
                self._journal_problem = _os_problem(exc)
                break
            except ValueError:  # closed: the writer gave up at the end of the grace period
                break
            for _ in batch:
                self._unwritten.popleft()
            self._journaled += len(batch)
            self._appended.set()
            self._update_state()
            await trio.lowlevel.checkpoint()  # a long backlog must not stall the event loop
        self._update_state()

    # --- the writer ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer: owned by the Edge's nursery. Replays a killed Edge's journal, then
        moves this process's journal into the store in batches until `close`, while
        another task writes to the journal what waits in memory."""
        store = self.store
        try:
            await trio.to_thread.run_sync(self._open)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_unwritten)
                task_status.started()
                await self._move_journal()
                nursery.cancel_scope.cancel()
        finally:
            # What is left stays on disk for the next start-up; the locks go with the
            # descriptors, as they would with the process.
            if self._unwritten:
                log.error(
                    "usage ledger: %d usage record(s) lost: the journal in %s could not be "
                    "written before the Edge stopped (%s)",
                    len(self._unwritten),
                    self.journal.directory,
                    self._journal_problem,
                )
            self.journal.release()
            store.close()
            self._stopped.set()

    def _open(self) -> None:
        """Worker thread: open the store, replay dead Edges' journals, start ours; raises
        `LedgerUnavailable` saying why not."""
        failures: tuple[type[Exception], ...] = (OSError, *self.store.WRITE_ERRORS)
        try:
            self.store.open()
            self._replayed = self._replay_orphans()
            self.journal.open()
        except failures as exc:
            raise LedgerUnavailable(
                f"cannot open the usage ledger ({self.store!r}, journal in "
                f"{self.journal.directory}): {_problem(exc)}"
            ) from None
        if self._replayed:
            log.warning(
                "usage ledger: %d record(s) recovered from the journal of an Edge that "
                "stopped before writing them",
                self._replayed,
            )

    async def _move_journal(self) -> None:
        """Move the journal into the store until closed and nothing is left to move."""
        synced_at = time.monotonic()
        while True:
            appended = self._appended
            # A closing ledger ends its journal once nothing waits in memory for it.
            finishing = self._closing and not self._unwritten
            if self._caught_up() and not finishing:
                await appended.wait()
                if not self._closing:
                    # Gather what arrives within a short window: one commit per batch
                    # instead of one per request keeps the ledger off the hot path.
                    await trio.sleep(BATCH_WINDOW_S)
            self._appended = trio.Event()
            finishing = self._closing and not self._unwritten
            if finishing:
                self.journal.close()
            if not await self._write_available(closing=finishing):
                await trio.sleep(self._retry_s)
                continue
            if finishing and self._caught_up():
                return
            if time.monotonic() - synced_at >= SYNC_INTERVAL_S:
                try:
                    await trio.to_thread.run_sync(self.journal.sync)
                except OSError as exc:  # the lines are in the page cache; fsync again later
                    log.warning("usage journal: fsync failed: %s", _os_problem(exc))
                synced_at = time.monotonic()

    def _caught_up(self) -> bool:
        return all(s.checkpoint >= s.written for s in self.journal.segments)

    async def _write_available(self, *, closing: bool) -> bool:
        """Insert everything journaled so far and delete the segments done with; False
        when the store refused (the journal keeps the records: retry later)."""
        segments = list(self.journal.segments)
        try:
            committed, done = await trio.to_thread.run_sync(_drain, self.store, segments, closing)
        except self.store.WRITE_ERRORS as exc:
            self._failed_writes += 1
            self._store_down(exc)
            return False
        # Only this task and `record`, both on the event loop, change the list.
        self.journal.segments = [s for s in self.journal.segments if s not in done]
        self._committed += committed
        self._store_up(committed)
        self._batch_written.set()
        self._batch_written = trio.Event()
        return True

    def _store_down(self, exc: Exception) -> None:
        """One log line when the store starts refusing (not one per retry)."""
        problem = _problem(exc)
        if self._store_down_since is None:
            self._store_down_since = time.monotonic()
            self._store_problem = problem
            log.error(
                "usage ledger: %r refuses writes (%s): records wait in the journal in %s "
                "and are retried every %gs",
                self.store,
                problem,
                self.journal.directory,
                self._retry_s,
            )
        elif problem != self._store_problem:
            self._store_problem = problem
            log.debug("usage ledger: %r still refuses writes, now: %s", self.store, problem)

    def _store_up(self, committed: int) -> None:
        """One log line when the store takes writes again, with how many waited."""
        if self._store_down_since is None:
            return
        down_s = time.monotonic() - self._store_down_since
        self._store_down_since = None
        log.warning(
            "usage ledger: %r takes writes again after %.1fs; the %d record(s) that waited "
            "in the journal are written",
            self.store,
            down_s,
            committed,
        )

    def store_problem(self) -> str | None:
        """Why the store refuses writes now (None while it takes them)."""
        return self._store_problem if self._store_down_since is not None else None

    def close(self) -> None:
        """No more records: the writer writes what waits (in memory too), then stops."""
        self._closing = True
        self._appended.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def wait_flushed(self) -> None:
        """Return once every record recorded before this call (journaled, or waiting in
        memory) is in the store."""
        target = self._journaled + len(self._unwritten)
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
        self,
        *,
        since: float | None,
        until: float | None,
        group_by: Sequence[str],
        limit: int | None = None,
        after: str | None = None,
    ) -> UsageReport:
        """The records from `since` to `until` grouped by `group_by`: every group, or a
        page of `limit` groups after the cursor `after` (a previous report's `next`).
        Raises `ValueError` naming the parameter that is wrong, `LedgerUnavailable` when
        the database cannot answer."""
        unknown = [column for column in group_by if column not in GROUP_COLUMNS]
        if unknown:
            raise ValueError(
                f"group_by: unknown column(s) {', '.join(unknown)}; "
                f"choose from {', '.join(GROUP_COLUMNS)}"
            )
        columns = list(dict.fromkeys(group_by))
        selection = UsageSelection(
            since=since,
            until=until,
            columns=columns,
            limit=limit,
            after=None if after is None else decode_cursor(after, columns),
        )
        try:
            return await trio.to_thread.run_sync(self.store.aggregate, selection)
        except self.store.WRITE_ERRORS as exc:
            raise LedgerUnavailable(
                f"the usage ledger ({self.store!r}) cannot be read now: {_problem(exc)}"
            ) from None


def _os_problem(exc: OSError) -> str:
    """An OS error in the words of the OS ("No space left on device")."""
    return exc.strerror or str(exc) or type(exc).__name__


def _problem(exc: BaseException) -> str:
    """An error's message, one line (a database's messages run over several)."""
    if isinstance(exc, OSError):
        return _os_problem(exc)
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


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

    def __repr__(self) -> str:
        return f"SQLite {self.path}"

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, check_same_thread=False)
        # WAL + NORMAL: a commit is an append, not an fsync'd rewrite. A power cut may
        # lose the last commits; the journal (fsynced every SYNC_INTERVAL_S) replays them.
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")
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


#: The sums every usage row carries, in `usage_report`'s order (standard SQL).
AGGREGATES: Final = (
    "COUNT(*)",
    "SUM(prompt_tokens)",
    "SUM(completion_tokens)",
    "SUM(CASE WHEN usage_source = 'estimated' THEN 1 ELSE 0 END)",
    "SUM(CASE WHEN usage_source = 'estimated' THEN prompt_tokens + completion_tokens ELSE 0 END)",
    "SUM(cached_tokens)",
)


def _window(selection: UsageSelection, placeholder: str) -> tuple[list[str], list[Any]]:
    where: list[str] = []
    params: list[Any] = []
    if selection.since is not None:
        where.append(f"time >= {placeholder}")
        params.append(selection.since)
    if selection.until is not None:
        where.append(f"time < {placeholder}")
        params.append(selection.until)
    return where, params


def aggregate_sql(selection: UsageSelection, placeholder: str) -> tuple[str, list[Any]]:
    """One page of groups, in standard SQL (SQLite and PostgreSQL alike): `columns`, then
    `AGGREGATES`, ordered by the columns, from the group after `after`, one row more than
    `limit` (which says whether more follow). The columns come from `GROUP_COLUMNS`."""
    columns = selection.columns
    where, params = _window(selection, placeholder)
    if selection.after is not None and columns:
        # A row value: the groups whose key sorts after the last one of the previous page.
        where.append(f"({', '.join(columns)}) > ({', '.join(placeholder for _ in columns)})")
        params.extend(selection.after)
    sql = f"SELECT {', '.join([*columns, *AGGREGATES])} FROM {{table}}"
    if where:
        sql += " WHERE " + " AND ".join(where)
    if columns:
        sql += f" GROUP BY {', '.join(columns)} ORDER BY {', '.join(columns)}"
        if selection.limit is not None:
            sql += f" LIMIT {placeholder}"
            params.append(selection.limit + 1)
    return sql.format(table="usage"), params


def totals_sql(selection: UsageSelection, placeholder: str) -> tuple[str, list[Any]]:
    """The sums over the whole window (every page's)."""
    where, params = _window(selection, placeholder)
    sql = f"SELECT {', '.join(AGGREGATES)} FROM usage"
    if where:
        sql += " WHERE " + " AND ".join(where)
    return sql, params


def paged(selection: UsageSelection, rows: Sequence[Sequence[Any]]) -> bool:
    """Whether `rows` are one page of several (the totals then take a query of their own)."""
    return selection.after is not None or (
        selection.limit is not None and len(rows) > selection.limit
    )


def usage_report(
    selection: UsageSelection,
    rows: Sequence[Sequence[Any]],
    totals: Sequence[Any] | None = None,
) -> UsageReport:
    """The report of one page of grouped rows (`columns`, then `AGGREGATES`) and, when
    the page is not all of them, the window's `totals` (`AGGREGATES`), whatever the store."""
    columns = selection.columns
    limit = selection.limit
    truncated = limit is not None and len(rows) > limit
    page = rows[:limit] if truncated else rows
    result = [row for row in (_usage_row(values, columns) for values in page) if row is not None]
    total = _sum(result) if totals is None else _usage_row(totals, [])
    return UsageReport(
        since=selection.since,
        until=selection.until,
        group_by=columns,
        rows=result,
        totals=total,
        truncated=truncated,
        next=encode_cursor(columns, page[-1][: len(columns)]) if truncated else None,
    )


def _usage_row(values: Sequence[Any], columns: list[str]) -> UsageRow | None:
    """A row of `columns`' values, then `AGGREGATES`; None for a group of no records."""
    requests, prompt, completion, estimated, estimated_tokens, cached = values[len(columns) :]
    if not requests:
        return None
    return UsageRow(
        requests=int(requests),
        prompt_tokens=int(prompt or 0),
        completion_tokens=int(completion or 0),
        estimated_requests=int(estimated or 0),
        estimated_tokens=int(estimated_tokens or 0),
        cached_tokens=int(cached or 0),
        **dict(zip(columns, values[: len(columns)], strict=True)),
    )


def _sum(rows: list[UsageRow]) -> UsageRow | None:
    if not rows:
        return None
    return UsageRow(
        requests=sum(row.requests for row in rows),
        prompt_tokens=sum(row.prompt_tokens for row in rows),
        completion_tokens=sum(row.completion_tokens for row in rows),
        estimated_requests=sum(row.estimated_requests for row in rows),
        estimated_tokens=sum(row.estimated_tokens for row in rows),
        cached_tokens=sum(row.cached_tokens for row in rows),
    )


_CursorKey = msgspec.json.Decoder(tuple[list[str], list[str | int | float | None]]).decode


def encode_cursor(columns: list[str], key: Sequence[Any]) -> str:
    """An opaque cursor for the page after the group `key` (URL-safe)."""
    raw = msgspec.json.encode([columns, list(key)])
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def decode_cursor(cursor: str, columns: list[str]) -> tuple[Any, ...]:
    """The group key a cursor continues after; `ValueError` unless it came from a report
    grouped by the same `columns`."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        grouped, key = _CursorKey(raw)
    except (ValueError, msgspec.DecodeError):
        raise ValueError("after: not a cursor from a report's `next`") from None
    if grouped != columns or len(key) != len(columns):
        raise ValueError(
            f"after: this cursor continues a report grouped by {','.join(grouped) or '-'}, "
            f"not by {','.join(columns) or '-'}"
        )
    return tuple(key)
