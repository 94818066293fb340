"""The OpenAI Responses store (design §14): responses kept for `previous_response_id`.

A Responses request with `store: true` (the protocol's default) leaves its response here:
the request's own input items and the final response object its Node returned
(`run.keep_output`). A later request naming it as `previous_response_id` is sent on with
the whole conversation (`core.responses.response_chain`); `GET /v1/responses/{id}` returns it and
`DELETE` removes it. The store lives in the usage ledger's database: a table beside the
usage records in the SQLite file in `state_dir`, or in the PostgreSQL database Edge
replicas share, so a conversation goes on across restarts and across replicas.

Rules:
1. Everything is scoped by principal: a principal reads, continues and deletes only its
   own responses; another principal's id is unknown to it, exactly like an id that does
   not exist (404, never 403: ids do not leak).
2. Bounds (`edge.responses`): a response is kept `max_age_s` after it was stored or
   last continued (continuing a conversation renews every turn of it, so a live
   conversation never loses its beginning), and at most `max_stored` responses and
   `max_bytes` bytes (request items and response object as stored) are kept, the least
   recently used going first. An expired response is unknown at once; its row is
   deleted at the next prune. A prune runs when the store opens and whenever this
   Edge's puts take the count or the bytes past their bound (then down to the bound less
   a small slack, so a full store does not prune on every put); replicas sharing
   PostgreSQL each prune what they see, so together they may pass the bound by what one
   of them stored since its last count.
3. One principal's share (`max_bytes_per_principal`) is refused, not evicted: a response
   that would take its principal's live responses past it is not stored (Rule 5), so one
   principal filling the store never pushes out the others' conversations. A single
   response larger than that share is never stored. Whether a principal is at its share
   is counted in the database before a response is refused (expired and deleted ones,
   and other replicas' puts, are seen then); below it by this Edge's count, a put goes
   ahead, so replicas sharing PostgreSQL may together pass a share by what the others
   stored for that principal since this Edge last counted.
4. Metering comes first: with SQLite, the store keeps `min_free_bytes` of room in
   `state_dir` for the usage journal and ledger beside it. Room is the disk's free space
   plus the free pages inside the database file, which the next rows of any table take
   before the file grows. A response that would leave less is not stored (`disk_low`).
   And the ledger grows with every run, into that reserve: every `ROOM_CHECK_S`
   (`keep_room`) a store that finds less room drops its least recently used responses
   until there is the reserve and an eighth more again, or it holds none; the ledger's
   rows go on into the pages they held (`iop_responses_dropped_for_metering_total`; a
   warning, then info lines while it goes on: `GIVE_BACK_QUIET_S`). Its deletes do not
   write what they free again to zero it (`secure_delete=FAST`), so a drop takes next to
   no room in the WAL. So a store that filled the disk up to its reserve never leaves
   metering to run out of disk as the usage records accumulate.
5. Not storing is never the caller's failure for a response already produced: `keep`
   logs why with the request id, counts the reason (`statistics`) and returns it, and
   the HTTP layer tells the caller (`store: false`, `x-iop-response-stored: false`).
   Reasons: `unavailable` (the database failed: down, disk full), `principal_full`,
   `too_large`, `disk_low`, `id_conflict` (an id already stored: never overwritten),
   `no_response` (the run's final response object did not come or has no id).
6. A write completes before the caller's response does (the HTTP layer awaits `keep`
   before its last bytes), so a caller that saw its response can continue it at once,
   on any replica. Every database call runs in a worker thread, one at a time per Edge
   (`to_thread` with a limiter of one: SQLite takes one writer anyway), never on the
   event loop. Reading or continuing a response while the database fails raises
   `StoreUnavailable` (503).
7. A conversation is loaded up to `max_conversation_bytes`: the database stops following
   `previous_id` once the turns loaded pass it, and the request is refused
   (`ConversationTooLarge`, a 400), so a long chain costs one bounded read, never the
   Edge's memory.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, Protocol, TypeVar

import msgspec
import trio

from iop_edge.core.responses.response_chain import (
    MAX_CHAIN,
    ChainBroken,
    ConversationTooLarge,
    StoredTurn,
    order_chain,
    read_final_response,
    read_response_id,
)
from iop_edge.runtime.metering.sqlite_file import open_shared
from schemas.config import ResponsesSection

__all__ = [
    "UNSTORED_REASONS",
    "ChainBroken",
    "ConversationTooLarge",
    "ResponseBackend",
    "ResponseRow",
    "ResponseStore",
    "SqliteResponses",
    "StoreStatistics",
    "StoreUnavailable",
    "Tally",
    "Unstored",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: How long a stopping Edge waits for the store's connection to close.
CLOSE_TIMEOUT_S: Final = 5.0
#: How often the store checks that metering has its room (Rule 4). A ledger writing a
#: thousand runs a second takes about 1.3 MB of it in that time: a twenty-fifth of the
#: default reserve.
ROOM_CHECK_S: Final = 5.0
#: A store the usage records keep pressing gives room back at every few checks while
#: callers store into what it gave: the first drop after this long without one is a
#: warning, the others are info lines (the metric counts them all).
GIVE_BACK_QUIET_S: Final = 600.0

_encode: Final = msgspec.json.Encoder().encode
_decode_items: Final = msgspec.json.Decoder(list[msgspec.Raw]).decode


class StoreUnavailable(Exception):
    """The store's database cannot be read or written now; the message says why."""


#: Why a `store: true` response was not stored (Rule 5).
Unstored = Literal[
    "unavailable", "principal_full", "too_large", "disk_low", "id_conflict", "no_response"
]
UNSTORED_REASONS: Final[tuple[Unstored, ...]] = (
    "unavailable",
    "principal_full",
    "too_large",
    "disk_low",
    "id_conflict",
    "no_response",
)


@dataclass(frozen=True, slots=True)
class Tally:
    """What the database holds, as a prune counted it."""

    rows: int
    bytes: int
    held: dict[str, int]
    """Bytes per principal."""


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """The store as this Edge sees it, for `/metrics`."""

    rows: int
    bytes: int
    unstored: dict[str, int]
    """`store: true` responses not stored since start, by reason (Rule 5)."""
    dropped_for_metering: int = 0
    """Responses dropped since start to give metering its room back (Rule 4)."""


@dataclass(frozen=True, slots=True)
class ResponseRow:
    """One stored response, as its database row holds it."""

    id: str
    principal_ref: str
    previous_id: str | None
    input: bytes
    """The request's own input items, a JSON array."""
    response: bytes
    """The final response object, JSON, as the Node returned it."""

    @property
    def size(self) -> int:
        """The bytes it holds, as the bounds count them (Rules 2, 3)."""
        return len(self.input) + len(self.response)


ChainRow = tuple[str, str | None, bytes, bytes, int]
"""(id, previous_id, input, response, bytes of the conversation from the tip to this
turn) of one turn of a conversation."""


class ResponseBackend(Protocol):
    """Where stored responses live. Every method blocks and runs in a worker thread; the
    store calls one at a time. `since` is the oldest `used_at` still alive (Rule 2)."""

    ERRORS: tuple[type[Exception], ...]
    """What a failing database raises."""

    def open(self) -> int:
        """Connect, create the table when missing; returns how many rows it holds."""
        ...

    def put(self, row: ResponseRow, continues: Sequence[str], now: float) -> bool:
        """Insert `row` (used at `now`) and renew `continues`, the ids of the conversation
        it continues, in one transaction; False (nothing written) when its id is
        already stored, whoever's it is."""
        ...

    def chain(self, principal_ref: str, tip: str, since: float, max_bytes: int) -> list[ChainRow]:
        """The principal's live turns reached from `tip` by following `previous_id`, at
        most `MAX_CHAIN` + 1 of them, and none past the first whose running bytes pass
        `max_bytes`, in no particular order."""
        ...

    def held(self, principal_ref: str, since: float) -> int:
        """The bytes of the principal's live responses."""
        ...

    def room_bytes(self) -> int | None:
        """Where the database writes on this host's disk, the bytes it may still take:
        the disk's free space and the free pages inside the database (Rule 4); None
        for a database elsewhere."""
        ...

    def get(self, principal_ref: str, response_id: str, since: float) -> bytes | None: ...

    def delete(self, principal_ref: str, response_id: str) -> bool: ...

    def prune(self, before: float, keep: int, keep_bytes: int) -> Tally:
        """Delete rows last used before `before`, then all but the `keep` most recently
        used, then the least recently used past `keep_bytes`; returns what is left."""
        ...

    def close(self) -> None: ...


class ResponseStore:
    """The store's async face (see the module docstring); `run` owns its connection."""

    def __init__(
        self,
        backend: ResponseBackend,
        policy: ResponsesSection,
        *,
        clock: Callable[[], float] = time.time,
        room_check_s: float = ROOM_CHECK_S,
    ) -> None:
        self._backend = backend
        self._policy = policy
        self._clock = clock
        self._room_check_s = room_check_s
        self._limiter = trio.CapacityLimiter(1)
        self._count = 0
        """Rows in the database as this Edge last counted, plus its puts since."""
        self._bytes = 0
        """Their bytes, likewise."""
        self._held: dict[str, int] = {}
        """Bytes per principal, likewise (Rule 3: a refusal counts again first)."""
        self._unstored: dict[str, int] = dict.fromkeys(UNSTORED_REASONS, 0)
        self._dropped_for_metering = 0
        self._room_problem: str | None = None
        """Why the last check of the room failed (logged once until it changes)."""
        self._gave_back_at: float | None = None
        """When (`time.monotonic`) the store last gave metering room back."""

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            rows=self._count,
            bytes=self._bytes,
            unstored=dict(self._unstored),
            dropped_for_metering=self._dropped_for_metering,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the store and keep it open until cancelled (owned by the Edge's nursery),
        checking metering's room every `room_check_s` (Rule 4).

        A database that cannot be reached at start-up is logged, not fatal: the Edge
        serves on, and the store connects again at its next use."""
        try:
            try:
                self._count = await self._call(self._backend.open)
                self._counted(await self._call(self._prune))
            except StoreUnavailable as exc:
                log.error("responses store: %s; stored responses are unavailable", exc)
            task_status.started()
            while True:
                await trio.sleep(self._room_check_s)
                await self.keep_room()
        finally:
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                # Past the deadline the close goes on in its thread: the Edge is stopping.
                await trio.to_thread.run_sync(
                    self._backend.close, limiter=self._limiter, abandon_on_cancel=True
                )

    async def keep(
        self,
        principal_ref: str,
        response: bytes | None,
        input_items: list[Any],
        *,
        previous_id: str | None,
        continues: Sequence[str] = (),
        request_id: str = "",
    ) -> Unstored | None:
        """Store a finished run's response (Rule 6); returns None when it is stored, else
        why it is not (Rule 5: logged with `request_id` and counted)."""
        if response is None:
            return self._not_stored("no_response", request_id, "the run sent no response object")
        try:
            response_id = read_response_id(response)
        except ValueError as exc:
            return self._not_stored("no_response", request_id, str(exc))
        row = ResponseRow(
            id=response_id,
            principal_ref=principal_ref,
            previous_id=previous_id,
            input=_encode(input_items),
            response=response,
        )
        try:
            refused = await self._call(self._put, row, list(continues))
        except StoreUnavailable as exc:
            return self._not_stored("unavailable", request_id, str(exc), response_id)
        if refused is not None:
            reason, detail = refused
            return self._not_stored(reason, request_id, detail, response_id)
        return None

    def _not_stored(
        self, reason: Unstored, request_id: str, detail: str, response_id: str = ""
    ) -> Unstored:
        self._unstored[reason] += 1
        named = f" {response_id}" if response_id else ""
        log.warning(
            "responses store: request %s: response%s not stored (%s): %s",
            request_id or "-",
            named,
            reason,
            detail,
        )
        return reason

    async def keep_room(self) -> None:
        """Give metering its room back when it has less than `min_free_bytes` (Rule 4).
        A database that fails is said once, until it fails otherwise or answers again."""
        try:
            await self._call(self._give_room)
        except StoreUnavailable as exc:
            if str(exc) != self._room_problem:
                log.warning("responses store: cannot check metering's room: %s", exc)
            self._room_problem = str(exc)
        else:
            self._room_problem = None

    async def conversation(self, principal_ref: str, tip: str) -> list[StoredTurn]:
        """The conversation ending at `tip`, oldest turn first; raises `ChainBroken` (the
        caller's 404), `ConversationTooLarge` (Rule 7) or `StoreUnavailable`."""
        since = self._clock() - self._policy.max_age_s
        limit = self._policy.max_conversation_bytes
        rows = await self._call(self._backend.chain, principal_ref, tip, since, limit)
        if any(running > limit for *_, running in rows):
            raise ConversationTooLarge(tip, limit)
        turns: dict[str, StoredTurn] = {}
        for response_id, previous_id, input_json, response, _ in rows:
            try:
                _, output = read_final_response(response)
                items = _decode_items(input_json)
            except (ValueError, msgspec.DecodeError) as exc:
                raise ChainBroken(
                    f"Previous response with id '{tip}' continues response "
                    f"'{response_id}', which cannot be read: {exc}"
                ) from None
            turns[response_id] = StoredTurn(
                id=response_id, previous_id=previous_id, input_items=items, output_items=output
            )
        return order_chain(tip, turns)

    async def read(self, principal_ref: str, response_id: str) -> bytes | None:
        """The stored response object, or None when the principal has none by that id."""
        since = self._clock() - self._policy.max_age_s
        return await self._call(self._backend.get, principal_ref, response_id, since)

    async def delete(self, principal_ref: str, response_id: str) -> bool:
        """Remove the principal's response; False when it has none by that id."""
        return await self._call(self._backend.delete, principal_ref, response_id)

    # --- in the worker thread ---------------------------------------------------------

    def _put(self, row: ResponseRow, continues: list[str]) -> tuple[Unstored, str] | None:
        """Store `row` within the bounds (Rules 2-4); the reason and detail of a refusal."""
        policy = self._policy
        size = row.size
        share = policy.max_bytes_per_principal
        if size > min(share, policy.max_bytes):
            limit = min(share, policy.max_bytes)
            return "too_large", f"it takes {size} bytes, more than the {limit} a principal may hold"
        principal = row.principal_ref
        held = self._held.get(principal, 0)
        if held + size > share:  # count again: some may have expired or gone (Rule 3)
            held = self._backend.held(principal, self._clock() - policy.max_age_s)
            self._held[principal] = held
            if held + size > share:
                return "principal_full", (
                    f"its principal holds {held} bytes of stored responses; {size} more "
                    f"would pass edge.responses.max_bytes_per_principal ({share})"
                )
        room = self._backend.room_bytes()
        if room is not None and room - size < policy.min_free_bytes:
            return "disk_low", (
                f"state_dir has room for {room} bytes; {size} more would leave less than "
                f"edge.responses.min_free_bytes ({policy.min_free_bytes}) for metering"
            )
        if not self._backend.put(row, continues, self._clock()):
            return "id_conflict", f"a response with id {row.id!r} is already stored"
        self._count += 1
        self._bytes += size
        self._held[principal] = held + size
        if self._count > policy.max_stored or self._bytes > policy.max_bytes:
            self._counted(self._prune())
        return None

    def _give_room(self) -> None:
        """Drop the least recently used responses until metering has its room, and an
        eighth more, again (Rule 4). A drop that frees nothing ends the attempt: the
        next check goes on from there."""
        reserve = self._policy.min_free_bytes
        room = self._backend.room_bytes()
        if room is None or room >= reserve or self._count == 0:
            return
        wanted = reserve + reserve // 8
        rows, size, had = self._count, self._bytes, room
        while room < wanted and self._bytes > 0:
            keep_bytes = max(0, self._bytes - (wanted - room))
            self._counted(self._prune_to(self._policy.max_stored, keep_bytes))
            after = self._backend.room_bytes()
            if after is None or after <= room:
                break
            room = after
        dropped = max(0, rows - self._count)
        if not dropped:  # its count was behind: the next check starts from the database's
            return
        self._dropped_for_metering += dropped
        now = time.monotonic()
        first = self._gave_back_at is None or now - self._gave_back_at > GIVE_BACK_QUIET_S
        self._gave_back_at = now
        log.log(
            logging.WARNING if first else logging.INFO,
            "responses store: state_dir had room for %d bytes, less than "
            "edge.responses.min_free_bytes (%d) kept for metering; dropped the %d least "
            "recently used response(s) (%d bytes): room for %d bytes now",
            had,
            reserve,
            dropped,
            max(0, size - self._bytes),
            room,
        )

    def _prune(self) -> Tally:
        """Apply the bounds (Rule 2); returns what is left."""
        policy = self._policy
        return self._prune_to(
            policy.max_stored - policy.max_stored // 64, policy.max_bytes - policy.max_bytes // 64
        )

    def _prune_to(self, keep: int, keep_bytes: int) -> Tally:
        """Drop the expired responses, then the least recently used past `keep` responses
        and `keep_bytes` bytes; returns what is left."""
        return self._backend.prune(self._clock() - self._policy.max_age_s, keep, keep_bytes)

    def _counted(self, tally: Tally) -> None:
        self._count = tally.rows
        self._bytes = tally.bytes
        self._held = dict(tally.held)

    async def _call(self, function: Callable[..., _T], *args: Any) -> _T:
        try:
            return await trio.to_thread.run_sync(function, *args, limiter=self._limiter)
        except self._backend.ERRORS as exc:
            raise StoreUnavailable(_one_line(exc)) from None


def _one_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# --- SQLite ---------------------------------------------------------------------------

_SQLITE_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    principal_ref TEXT NOT NULL,
    previous_id TEXT,
    created_at REAL NOT NULL,
    used_at REAL NOT NULL,
    input BLOB NOT NULL,
    response BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_used_at ON responses(used_at);
CREATE INDEX IF NOT EXISTS responses_principal ON responses(principal_ref);
"""
#: The file's free pages and their size: room the next rows of any table take first
#: (Rule 4).
_SQLITE_FREE_PAGES: Final = "SELECT * FROM pragma_freelist_count(), pragma_page_size()"
#: A row's bytes as the bounds count them (`length` of a BLOB reads no content).
_SQLITE_SIZE: Final = "(length(input) + length(response))"
#: A conversation, tip first, through the principal's live rows (Rules 1, 2, 7).
_SQLITE_CHAIN: Final = f"""
WITH RECURSIVE chain(id, previous_id, input, response, depth, running) AS (
    SELECT id, previous_id, input, response, 1, {_SQLITE_SIZE} FROM responses
    WHERE id = ? AND principal_ref = ? AND used_at >= ?
    UNION ALL
    SELECT r.id, r.previous_id, r.input, r.response, chain.depth + 1,
        chain.running + length(r.input) + length(r.response)
    FROM responses AS r JOIN chain ON r.id = chain.previous_id
    WHERE r.principal_ref = ? AND r.used_at >= ? AND chain.depth <= ? AND chain.running <= ?
)
SELECT id, previous_id, input, response, running FROM chain
"""


class SqliteResponses:
    """`ResponseBackend` in the SQLite ledger file (its own table, its own connection:
    WAL mode lets it and the ledger's writer take turns)."""

    ERRORS: tuple[type[Exception], ...] = (sqlite3.Error,)

    def __init__(self, path: Path) -> None:
        self.path = path
        self._connection: sqlite3.Connection | None = None

    def _db(self) -> sqlite3.Connection:
        """The connection, opened on first use (or again after a failed start-up)."""
        if self._connection is None:
            connection = open_shared(self.path, timeout_s=10.0)
            try:
                # What a delete frees is not written again to zero it (some builds do,
                # `SQLITE_SECURE_DELETE`): responses dropped for metering's room would
                # otherwise take as much of the disk in the WAL as they free (Rule 4).
                connection.execute("PRAGMA secure_delete=FAST")
                connection.executescript(_SQLITE_SCHEMA)
            except sqlite3.Error:
                connection.close()
                raise
            self._connection = connection
        return self._connection

    def open(self) -> int:
        return int(self._db().execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def put(self, row: ResponseRow, continues: Sequence[str], now: float) -> bool:
        connection = self._db()
        with connection:
            cursor = connection.execute(
                "INSERT INTO responses "
                "(id, principal_ref, previous_id, created_at, used_at, input, response) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                (row.id, row.principal_ref, row.previous_id, now, now, row.input, row.response),
            )
            if cursor.rowcount != 1:
                return False
            connection.executemany(
                "UPDATE responses SET used_at = ? WHERE id = ? AND principal_ref = ?",
                [(now, response_id, row.principal_ref) for response_id in continues],
            )
        return True

    def chain(self, principal_ref: str, tip: str, since: float, max_bytes: int) -> list[ChainRow]:
        rows = self._db().execute(
            _SQLITE_CHAIN,
            (tip, principal_ref, since, principal_ref, since, MAX_CHAIN, max_bytes),
        )
        return [(str(i), p, bytes(inp), bytes(resp), int(n)) for i, p, inp, resp, n in rows]

    def held(self, principal_ref: str, since: float) -> int:
        row = (
            self._db()
            .execute(
                f"SELECT COALESCE(SUM({_SQLITE_SIZE}), 0) FROM responses "
                "WHERE principal_ref = ? AND used_at >= ?",
                (principal_ref, since),
            )
            .fetchone()
        )
        return int(row[0])

    def room_bytes(self) -> int | None:
        free = self._disk_free()
        if free is None:
            return None
        free_pages, page_size = self._db().execute(_SQLITE_FREE_PAGES).fetchone()
        return free + int(free_pages) * int(page_size)

    def _disk_free(self) -> int | None:
        """Free space on the database's disk, as an unprivileged writer may take it."""
        try:
            stats = os.statvfs(self.path.parent)
        except OSError:
            return None
        return stats.f_bavail * stats.f_frsize

    def get(self, principal_ref: str, response_id: str, since: float) -> bytes | None:
        row = (
            self._db()
            .execute(
                "SELECT response FROM responses WHERE id = ? AND principal_ref = ? "
                "AND used_at >= ?",
                (response_id, principal_ref, since),
            )
            .fetchone()
        )
        return None if row is None else bytes(row[0])

    def delete(self, principal_ref: str, response_id: str) -> bool:
        connection = self._db()
        with connection:
            cursor = connection.execute(
                "DELETE FROM responses WHERE id = ? AND principal_ref = ?",
                (response_id, principal_ref),
            )
        return cursor.rowcount > 0

    def prune(self, before: float, keep: int, keep_bytes: int) -> Tally:
        connection = self._db()
        with connection:
            connection.execute("DELETE FROM responses WHERE used_at < ?", (before,))
            connection.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses "
                "ORDER BY used_at DESC, id DESC LIMIT -1 OFFSET ?)",
                (keep,),
            )
            connection.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM (SELECT id, "
                f"SUM({_SQLITE_SIZE}) OVER (ORDER BY used_at DESC, id DESC) AS running "
                "FROM responses) WHERE running > ?)",
                (keep_bytes,),
            )
        rows = connection.execute(
            f"SELECT principal_ref, COUNT(*), SUM({_SQLITE_SIZE}) FROM responses "
            "GROUP BY principal_ref"
        ).fetchall()
        return _tally(rows)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def _tally(rows: Sequence[tuple[Any, ...]]) -> Tally:
    """A `Tally` from (principal_ref, rows, bytes) per principal."""
    held = {str(principal): int(size or 0) for principal, _, size in rows}
    return Tally(rows=sum(int(count) for _, count, _ in rows), bytes=sum(held.values()), held=held)
