"""Which usage ledger an Edge keeps, from `edge.ledger` (SPEC §7, §13; `core.ledger_url`).

- Not set: `UsageLedger`, SQLite at `<state_dir>/usage.sqlite3` (one Edge, or replicas on
  one host sharing a `state_dir`: SQLite takes writers of several processes in turn).
- `postgresql://...`: `UsageLedger` with a `PostgresStore`, one ledger for Edge replicas on
  any hosts (each keeps its own crash-safe journal in its `state_dir`).

Both keep the replica roster (`replicas`) and the Responses store (`response_store`)
beside the usage records. The PostgreSQL modules (and psycopg) are imported only when
configured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from iop_edge.core.ledger_url import parse_ledger_url
from iop_edge.runtime.lifecycle.replicas import ReplicaStore, SqliteReplicaStore
from iop_edge.runtime.metering.response_store import ResponseBackend, SqliteResponses
from iop_edge.runtime.metering.usage import UsageLedger
from schemas.config import EdgeSection

__all__ = ["LedgerChoice", "LedgerUnavailable", "choose_ledger"]

SQLITE_FILE = "usage.sqlite3"


class LedgerUnavailable(Exception):
    """The configured ledger cannot be used; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class LedgerChoice:
    """The ledger, how to open its replica roster, where stored responses live, and how
    to check it before serving."""

    ledger: UsageLedger
    open_replica_store: Callable[[], ReplicaStore]
    responses: ResponseBackend
    """The Responses store's table, in the same database (not connected yet)."""
    check: Callable[[], None]
    """Blocking: connect once and set up the schema; raises `LedgerUnavailable`."""
    description: str

    async def check_reachable(self) -> None:
        await trio.to_thread.run_sync(self.check)


def choose_ledger(edge: EdgeSection) -> LedgerChoice:
    if edge.ledger is None:
        path = Path(edge.state_dir) / SQLITE_FILE
        return LedgerChoice(
            ledger=UsageLedger(path),
            open_replica_store=lambda: SqliteReplicaStore(path),
            responses=SqliteResponses(path),
            check=lambda: None,
            description=f"SQLite {path}",
        )
    url = parse_ledger_url(edge.ledger)
    try:
        from iop_edge.runtime.metering import ledger_postgres, response_store_postgres
    except ImportError:
        raise LedgerUnavailable(
            "edge.ledger is a PostgreSQL URL, which needs the psycopg package: "
            "pip install 'iop[postgres]'"
        ) from None
    password_env = edge.ledger_password_env

    def check() -> None:
        store = ledger_postgres.PostgresStore(url, password_env)
        try:
            store.open()
        except ledger_postgres.LedgerUnavailable as exc:
            raise LedgerUnavailable(str(exc)) from None
        finally:
            store.close()

    # The journal (crash safety) stays local, in state_dir; the records go to PostgreSQL.
    journal_path = Path(edge.state_dir) / SQLITE_FILE
    return LedgerChoice(
        ledger=UsageLedger(journal_path, store=ledger_postgres.PostgresStore(url, password_env)),
        open_replica_store=lambda: ledger_postgres.PostgresReplicaStore(url, password_env),
        responses=response_store_postgres.PostgresResponses(url, password_env),
        check=check,
        description=f"PostgreSQL {url}",
    )
