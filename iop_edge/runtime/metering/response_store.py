"""The OpenAI Responses store (design §14): responses kept for `previous_response_id`.

A Responses request with `store: true` (the protocol's default) leaves its response here:
the request's own input items and the final response object its Node returned
(`run.keep_output`). A later request naming it as `previous_response_id` is sent on with
the whole conversation (`core.response_chain`); `GET /v1/responses/{id}` returns it and
`DELETE` removes it. The store lives in the usage ledger's database: a table beside the
usage records in the SQLite file in `state_dir`, or in the PostgreSQL database Edge
replicas share, so a conversation goes on across restarts and across replicas.

Rules:
1. Everything is scoped by principal: a principal reads, continues and deletes only its
   own responses; another principal's id is unknown to it, exactly like an id that does
   not exist (404, never 403: ids do not leak).
2. Bounds (`edge.responses`): a response is kept `max_age_s` after it was stored or
   last continued (continuing a conversation renews every turn of it, so a live
   conversation never loses its beginning), and at most `max_stored` responses are kept,
   the least recently used going first. An expired response is unknown at once; its row
   is deleted at the next prune. A prune runs when the store opens and whenever this
   Edge's puts take the count past `max_stored` (then down to `max_stored` less a small
   slack, so a full store does not prune on every put); replicas sharing PostgreSQL each
   prune what they see, so together they may pass the bound by what one of them stored
   since its last count.
3. A write completes before the caller's response does (the HTTP layer awaits `keep`
   before its last bytes), so a caller that saw its response can continue it at once,
   on any replica. Every database call runs in a worker thread, one at a time per Edge
   (`to_thread` with a limiter of one: SQLite takes one writer anyway), never on the
   event loop.
4. The database failing is not the caller's problem for a response already produced:
   `keep` logs it and the response is delivered unstored. Reading or continuing a
   response while the database fails raises `StoreUnavailable` (503).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import msgspec
import trio

from iop_edge.core.response_chain import (
    MAX_CHAIN,
    ChainBroken,
    StoredTurn,
    order_chain,
    read_final_response,
    read_response_id,
)
from schemas.config import ResponsesSection

__all__ = [
    "ChainBroken",
    "ResponseBackend",
    "ResponseRow",
    "ResponseStore",
    "SqliteResponses",
    "StoreUnavailable",
]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: How long a stopping Edge waits for the store's connection to close.
CLOSE_TIMEOUT_S: Final = 5.0

_encode: Final = msgspec.json.Encoder().encode
_decode_items: Final = msgspec.json.Decoder(list[msgspec.Raw]).decode


class StoreUnavailable(Exception):
    """The store's database cannot be read or written now; the message says why."""


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


ChainRow = tuple[str, str | None, bytes, bytes]
"""(id, previous_id, input, response) of one turn of a conversation."""


class ResponseBackend(Protocol):
    """Where stored responses live. Every method blocks and runs in a worker thread; the
    store calls one at a time. `since` is the oldest `used_at` still alive (Rule 2)."""

    ERRORS: tuple[type[Exception], ...]
    """What a failing database raises."""

    def open(self) -> int:
        """Connect, create the table when missing; returns how many rows it holds."""
        ...

    def put(self, row: ResponseRow, continues: Sequence[str], now: float) -> None:
        """Insert `row` (used at `now`) and renew `continues`, the ids of the conversation
        it continues, in one transaction. An id already stored for another principal is
        left alone."""

    def chain(self, principal_ref: str, tip: str, since: float) -> list[ChainRow]:
        """The principal's live turns reached from `tip` by following `previous_id`, at
        most `MAX_CHAIN` + 1 of them, in no particular order."""
        ...

    def get(self, principal_ref: str, response_id: str, since: float) -> bytes | None: ...

    def delete(self, principal_ref: str, response_id: str) -> bool: ...

    def prune(self, before: float, keep: int) -> int:
        """Delete rows last used before `before`, then all but the `keep` most recently
        used; returns how many rows are left."""
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
    ) -> None:
        self._backend = backend
        self._policy = policy
        self._clock = clock
        self._limiter = trio.CapacityLimiter(1)
        self._count = 0
        """Rows in the database as this Edge last counted, plus its puts since."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the store and keep it open until cancelled (owned by the Edge's nursery).

        A database that cannot be reached at start-up is logged, not fatal: the Edge
        serves on, and the store connects again at its next use."""
        try:
            try:
                self._count = await self._call(self._backend.open)
                self._count = await self._call(self._prune)
            except StoreUnavailable as exc:
                log.error("responses store: %s; stored responses are unavailable", exc)
            task_status.started()
            await trio.sleep_forever()
        finally:
            with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                await trio.to_thread.run_sync(self._backend.close, limiter=self._limiter)

    async def keep(
        self,
        principal_ref: str,
        response: bytes,
        input_items: list[Any],
        *,
        previous_id: str | None,
        continues: Sequence[str] = (),
    ) -> str | None:
        """Store a finished run's response (Rule 3); returns its id, or None when it was
        not stored (Rule 4: said in the log)."""
        try:
            response_id = read_response_id(response)
        except ValueError as exc:
            log.warning("responses store: a response was not stored: %s", exc)
            return None
        row = ResponseRow(
            id=response_id,
            principal_ref=principal_ref,
            previous_id=previous_id,
            input=_encode(input_items),
            response=response,
        )
        try:
            await self._call(self._put, row, list(continues))
        except StoreUnavailable as exc:
            log.error("responses store: response %s was not stored: %s", response_id, exc)
            return None
        return response_id

    async def conversation(self, principal_ref: str, tip: str) -> list[StoredTurn]:
        """The conversation ending at `tip`, oldest turn first; raises `ChainBroken` (the
        caller's 404) or `StoreUnavailable`."""
        since = self._clock() - self._policy.max_age_s
        rows = await self._call(self._backend.chain, principal_ref, tip, since)
        turns: dict[str, StoredTurn] = {}
        for response_id, previous_id, input_json, response in rows:
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

    def _put(self, row: ResponseRow, continues: list[str]) -> None:
        self._backend.put(row, continues, self._clock())
        self._count += 1
        if self._count > self._policy.max_stored:
            self._count = self._prune()

    def _prune(self) -> int:
        """Apply the bounds (Rule 2); returns the rows left."""
        policy = self._policy
        slack = policy.max_stored // 64
        before = self._clock() - policy.max_age_s
        return self._backend.prune(before, policy.max_stored - slack)

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
"""
#: A conversation, tip first, through the principal's live rows (Rule 1, 2).
_SQLITE_CHAIN: Final = """
WITH RECURSIVE chain(id, previous_id, input, response, depth) AS (
    SELECT id, previous_id, input, response, 1 FROM responses
    WHERE id = ? AND principal_ref = ? AND used_at >= ?
    UNION ALL
    SELECT r.id, r.previous_id, r.input, r.response, chain.depth + 1
    FROM responses AS r JOIN chain ON r.id = chain.previous_id
    WHERE r.principal_ref = ? AND r.used_at >= ? AND chain.depth <= ?
)
SELECT id, previous_id, input, response FROM chain
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
            self.path.parent.mkdir(parents=True, exist_ok=True)
            connection = sqlite3.connect(self.path, check_same_thread=False, timeout=10.0)
            try:
                connection.execute("PRAGMA journal_mode=WAL")
                connection.execute("PRAGMA synchronous=NORMAL")
                connection.executescript(_SQLITE_SCHEMA)
            except sqlite3.Error:
                connection.close()
                raise
            self._connection = connection
        return self._connection

    def open(self) -> int:
        return int(self._db().execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def put(self, row: ResponseRow, continues: Sequence[str], now: float) -> None:
        connection = self._db()
        with connection:
            connection.execute(
                "INSERT INTO responses "
                "(id, principal_ref, previous_id, created_at, used_at, input, response) "
                "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                "previous_id = excluded.previous_id, used_at = excluded.used_at, "
                "input = excluded.input, response = excluded.response "
                "WHERE responses.principal_ref = excluded.principal_ref",
                (row.id, row.principal_ref, row.previous_id, now, now, row.input, row.response),
            )
            connection.executemany(
                "UPDATE responses SET used_at = ? WHERE id = ? AND principal_ref = ?",
                [(now, response_id, row.principal_ref) for response_id in continues],
            )

    def chain(self, principal_ref: str, tip: str, since: float) -> list[ChainRow]:
        rows = self._db().execute(
            _SQLITE_CHAIN, (tip, principal_ref, since, principal_ref, since, MAX_CHAIN)
        )
        return [(str(i), p, bytes(inp), bytes(resp)) for i, p, inp, resp in rows]

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

    def prune(self, before: float, keep: int) -> int:
        connection = self._db()
        with connection:
            connection.execute("DELETE FROM responses WHERE used_at < ?", (before,))
            connection.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses "
                "ORDER BY used_at DESC, id DESC LIMIT -1 OFFSET ?)",
                (keep,),
            )
        return int(connection.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
