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

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

import msgspec
import trio

from iop_edge.runtime.metering.usage_ledger.journal import (
    SYNC_INTERVAL_S,
    Segment,
    UsageJournal,
    read_lines,
)
from iop_edge.runtime.metering.usage_ledger.ledger_sqlite import SqliteStore
from iop_edge.runtime.metering.usage_ledger.usage_store import (
    GROUP_COLUMNS,
    LedgerStore,
    LedgerUnavailable,
    UsageRecord,
    UsageReport,
    UsageSelection,
    decode_cursor,
)
from schemas.config import DEFAULT_LEDGER_BUFFER_RECORDS, WhenUnwritable

log = logging.getLogger(__name__)

#: How long the writer gathers records before moving them into the store, in one
#: transaction on a worker thread. A batch's own cost (the thread's hand-off, reading the
#: journal, the commit) is most of the writer's: a quarter second keeps it about a
#: third of what a twentieth costs, per record (measured at ~300 runs a second), while
#: `/usage` still shows a run about a quarter of a second after its end.
BATCH_WINDOW_S = 0.25
#: Pause before retrying a batch the store refused (locked, disk full, unreachable), and
#: before retrying to journal the records waiting in memory.
RETRY_S: Final = 1.0
#: How much of the records waiting in memory goes to the journal in one write.
FLUSH_BYTES: Final = 256 * 1024


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
