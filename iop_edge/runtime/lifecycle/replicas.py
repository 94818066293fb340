"""Which Edge processes share this ledger, and which config each runs (design §13).

Replicas of an Edge run the same config, but each applies a refresh on its own: an
operator refreshes them one by one (docs/operations.md#replicas). To tell which
replicas run which config, every Edge keeps one row about itself in the shared ledger
(SQLite for replicas on one host sharing a `state_dir`; PostgreSQL across hosts):
instance (`HOST/PID`), state (serving or draining), revision, config sha256, pending
restart paths, its URLs, and when it last wrote. `GET /status` lists the rows and every
refresh report carries them, each marked `same_config` or not.

Rules:
1. A row is written at start, after every refresh, when the Edge starts draining, and
   every `HEARTBEAT_S` in between; it is removed when the Edge stops.
2. A row not written for `STALE_AFTER_S` is not listed (a replica that was killed);
   one older than `FORGET_AFTER_S` is deleted by whichever replica reads it.
3. The roster never takes the gateway down: a ledger it cannot reach leaves the list
   empty or stale, and says so in the log.
4. A restart's successor stops listing its predecessor once it serves in its place
   (`retire`): the old Edge takes no new request from then on, though its row may say
   `serving` until its drain publishes (or, when its last writes were lost, until the
   row goes stale), and the limits split between the replicas serving must not halve
   for that while.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final, Protocol, TypeVar

import msgspec
import trio

from schemas.refresh import ReplicaStatus

__all__ = ["ReplicaRoster", "ReplicaStore", "SqliteReplicaStore"]

log = logging.getLogger(__name__)

HEARTBEAT_S: Final = 10.0
STALE_AFTER_S: Final = 3 * HEARTBEAT_S
#: How long a stopping Edge waits for its row's removal.
REMOVE_GRACE_S: Final = 5.0
FORGET_AFTER_S: Final = 24 * 3600.0

T = TypeVar("T")

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(ReplicaStatus).decode


class ReplicaStore(Protocol):
    """Rows in the shared ledger; every method blocks (the roster calls them in a thread)."""

    def publish(self, instance: str, document: bytes, seen_at: float) -> None: ...

    def remove(self, instance: str) -> None: ...

    def read(self, now: float) -> list[tuple[bytes, float]]:
        """Documents written within `STALE_AFTER_S` of `now`, with when (Rule 2)."""
        ...

    def close(self) -> None: ...


class SqliteReplicaStore:
    """The `replicas` table in the SQLite ledger file."""

    _SCHEMA = """
    CREATE TABLE IF NOT EXISTS replicas (
        instance TEXT PRIMARY KEY,
        document TEXT NOT NULL,
        seen_at REAL NOT NULL
    );
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._connection = sqlite3.connect(path, check_same_thread=False, timeout=5)
        self._connection.execute("PRAGMA journal_mode=WAL")
        self._connection.executescript(self._SCHEMA)

    def publish(self, instance: str, document: bytes, seen_at: float) -> None:
        with self._connection:
            self._connection.execute(
                "INSERT INTO replicas VALUES (?, ?, ?) ON CONFLICT(instance) DO UPDATE "
                "SET document = excluded.document, seen_at = excluded.seen_at",
                (instance, document.decode(), seen_at),
            )

    def remove(self, instance: str) -> None:
        with self._connection:
            self._connection.execute("DELETE FROM replicas WHERE instance = ?", (instance,))

    def read(self, now: float) -> list[tuple[bytes, float]]:
        with self._connection:
            self._connection.execute(
                "DELETE FROM replicas WHERE seen_at < ?", (now - FORGET_AFTER_S,)
            )
            rows = self._connection.execute(
                "SELECT document, seen_at FROM replicas WHERE seen_at >= ? ORDER BY instance",
                (now - STALE_AFTER_S,),
            ).fetchall()
        return [(document.encode(), seen_at) for document, seen_at in rows]

    def close(self) -> None:
        self._connection.close()


class ReplicaRoster:
    """This Edge's row in the shared ledger, and everyone's (see the module rules)."""

    def __init__(
        self,
        open_store: Callable[[], ReplicaStore],
        describe: Callable[[], ReplicaStatus],
        on_read: Callable[[list[ReplicaStatus]], None] | None = None,
    ) -> None:
        """`on_read` hears every fresh read of the rows (the principals' limits are split
        between the replicas serving)."""
        self._open_store = open_store
        self._on_read = on_read
        self._describe = describe
        self._store: ReplicaStore | None = None
        self._lock = trio.Lock()
        self._cached: list[ReplicaStatus] = []
        self._instance = ""
        self._retired: set[str] = set()
        """Rows of Edges that take no new request, whatever their rows still say (Rule 4)."""

    def cached(self) -> list[ReplicaStatus]:
        """The rows as of the last heartbeat or publish (no I/O)."""
        return list(self._cached)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owned by the Edge's nursery: publish, then heartbeat until cancelled."""
        try:
            self._store = await trio.to_thread.run_sync(self._open_store)
        except Exception as exc:  # Rule 3
            log.error("replica roster disabled: cannot open it in the ledger: %s", exc)
            task_status.started()
            return
        try:
            await self.publish()
            task_status.started()
            while True:
                await trio.sleep(HEARTBEAT_S)
                await self.publish()
        finally:
            # A store bounds its statements (SQLite's busy timeout, PostgreSQL's statement
            # timeout), not a stalled connection: the removal gets `REMOVE_GRACE_S`, then
            # is left to its thread (a row left behind stops being listed, Rule 2), and the
            # connection it may still be using is not closed under it.
            with trio.move_on_after(REMOVE_GRACE_S, shield=True) as cleanup:
                await self._call(lambda store: store.remove(self._instance), abandon=True)
            store, self._store = self._store, None
            if store is not None and not cleanup.cancelled_caught:
                store.close()

    async def publish(self) -> list[ReplicaStatus]:
        """Write this Edge's row now (Rule 1) and return everyone's, fresh."""
        me = self._describe()
        self._instance = me.instance
        document = _encode(msgspec.structs.replace(me, current=False, same_config=True))
        await self._call(lambda store: store.publish(me.instance, document, me.seen_at))
        return await self.read()

    async def retire(self, instance: str) -> None:
        """`instance` takes no new request from now on (this Edge's predecessor, once this
        one serves in its place): it is not listed, and everyone's rows are read again
        at once, so the limits split between the replicas follow now (Rule 4)."""
        if instance:
            self._retired.add(instance)
            await self.read()

    async def read(self) -> list[ReplicaStatus]:
        """Everyone's rows, fresh, marked `current` and `same_config` for this Edge."""
        me = self._describe()
        rows = await self._call(lambda store: store.read(time.time()))
        if rows is None:
            return self.cached()
        replicas = []
        for document, seen_at in rows:
            try:
                replica = _decode(document)
            except msgspec.DecodeError:
                continue
            if replica.instance in self._retired:
                continue
            replicas.append(
                msgspec.structs.replace(
                    replica,
                    seen_at=seen_at,
                    current=replica.instance == me.instance,
                    same_config=replica.config_sha256 == me.config_sha256,
                )
            )
        self._cached = replicas
        if self._on_read is not None:
            self._on_read(list(replicas))
        return list(replicas)

    async def _call(
        self, operation: Callable[[ReplicaStore], T], *, abandon: bool = False
    ) -> T | None:
        """Run one store operation in a thread (one at a time); None when it failed
        (Rule 3). The store bounds each operation itself; `abandon`: a cancel leaves the
        thread to finish alone."""
        store = self._store
        if store is None:
            return None
        try:
            async with self._lock:
                return await trio.to_thread.run_sync(operation, store, abandon_on_cancel=abandon)
        except Exception as exc:
            log.warning("replica roster: %s", exc)
            return None
