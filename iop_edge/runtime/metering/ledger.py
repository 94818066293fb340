"""Which usage ledger an Edge keeps, from `edge.ledger` (design §7, §13;
`core.configuration.ledger_url`).

- Not set: `UsageLedger`, SQLite at `<state_dir>/usage.sqlite3` (one Edge, or replicas on
  one host sharing a `state_dir`: SQLite takes writers of several processes in turn).
- `postgresql://...`: `UsageLedger` with a `PostgresStore`, one ledger for Edge replicas on
  any hosts (each keeps its own crash-safe journal in its `state_dir`).

Both keep the replica roster (`replicas`) and the Responses store (`response_store`)
beside the usage records; PostgreSQL also the daily budgets replicas reserve against
(`budgets_postgres`). The PostgreSQL modules (and psycopg) are imported only when
configured.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from iop_edge.core.configuration.ledger_url import parse_ledger_url
from iop_edge.runtime.lifecycle.replicas import ReplicaStore, SqliteReplicaStore
from iop_edge.runtime.metering import state_dir as state_dirs
from iop_edge.runtime.metering.response_store import ResponseBackend, SqliteResponses
from iop_edge.runtime.metering.usage_ledger.ledger_sqlite import SqliteStore
from iop_edge.runtime.metering.usage_ledger.shared_budgets import BudgetStore
from iop_edge.runtime.metering.usage_ledger.usage import UsageLedger
from iop_edge.runtime.metering.usage_ledger.usage_store import LedgerStore, LedgerUnavailable
from schemas.config import ConfigError, EdgeSection

__all__ = ["LedgerChoice", "LedgerUnavailable", "choose_ledger", "ledger_problems"]

SQLITE_FILE = "usage.sqlite3"


@dataclass(frozen=True, slots=True)
class LedgerChoice:
    """The ledger, how to open its replica roster, where stored responses live, and how
    to check it before serving."""

    ledger: UsageLedger
    open_replica_store: Callable[[], ReplicaStore]
    responses: ResponseBackend
    """The Responses store's table, in the same database (not connected yet)."""
    open_budgets: Callable[[str], BudgetStore] | None
    """Daily budgets replicas reserve against, for this Edge's instance name (limits
    Rule 7); None for SQLite, whose replicas read each other's usage (Rule 3)."""
    check: Callable[[], None]
    """Blocking, what `serve` does before it serves: make sure `state_dir` takes writes,
    open the store once and set up its schema; raises `LedgerUnavailable`."""
    inspect: Callable[[], list[ConfigError]]
    """Blocking, what `check-config` does: the same questions, changing nothing (the
    folder is not created, a database is connected to but not set up); the problems,
    each at its config path."""
    description: str

    async def check_reachable(self) -> None:
        await trio.to_thread.run_sync(self.check)


def choose_ledger(edge: EdgeSection) -> LedgerChoice:
    """The ledger `edge` configures; raises `LedgerUnavailable` when it cannot be built
    here at all (PostgreSQL without psycopg)."""
    state_dir = Path(edge.state_dir)
    path = state_dir / SQLITE_FILE

    def usage_ledger(store: LedgerStore | None = None) -> UsageLedger:
        return UsageLedger(
            path,
            store=store,
            buffer_records=edge.ledger_buffer_records,
            when_full=edge.ledger_when_unwritable,
        )

    if edge.ledger is None:

        def check_sqlite() -> None:
            _ensure_state_dir(state_dir)
            store = SqliteStore(path)
            try:
                store.open()
            except sqlite3.Error as exc:
                raise LedgerUnavailable(f"cannot open the usage ledger {path}: {exc}") from None
            finally:
                store.close()

        return LedgerChoice(
            ledger=usage_ledger(),
            open_replica_store=lambda: SqliteReplicaStore(path),
            responses=SqliteResponses(path),
            open_budgets=None,
            check=check_sqlite,
            inspect=lambda: _inspect_state_dir(state_dir),
            description=f"SQLite {path}",
        )
    url = parse_ledger_url(edge.ledger)
    try:
        from iop_edge.runtime.metering import response_store_postgres
        from iop_edge.runtime.metering.usage_ledger import budgets_postgres, ledger_postgres
    except ImportError:
        raise LedgerUnavailable(
            "edge.ledger is a PostgreSQL URL, which needs the psycopg package: "
            "pip install 'iop-gateway[postgres]'"
        ) from None
    password_env = edge.ledger_password_env

    def check_postgres() -> None:
        _ensure_state_dir(state_dir)
        store = ledger_postgres.PostgresStore(url, password_env)
        try:
            store.open()  # raises LedgerUnavailable, saying why
        finally:
            store.close()

    def inspect_postgres() -> list[ConfigError]:
        problems = _inspect_state_dir(state_dir)
        try:
            ledger_postgres.connect(url, password_env).close()
        except LedgerUnavailable as exc:
            problems.append(ConfigError(path="edge.ledger", message=str(exc)))
        return problems

    # The journal (crash safety) stays local, in state_dir; the records go to PostgreSQL.
    return LedgerChoice(
        ledger=usage_ledger(ledger_postgres.PostgresStore(url, password_env)),
        open_replica_store=lambda: ledger_postgres.PostgresReplicaStore(url, password_env),
        responses=response_store_postgres.PostgresResponses(url, password_env),
        open_budgets=lambda instance: budgets_postgres.PostgresBudgets(url, password_env, instance),
        check=check_postgres,
        inspect=inspect_postgres,
        description=f"PostgreSQL {url}",
    )


def ledger_problems(edge: EdgeSection) -> list[ConfigError]:
    """What `serve` checks of the ledger `edge` configures before it serves, changing
    nothing: room in `state_dir`, and a PostgreSQL ledger's package, password variable and
    server (connected to, not set up). Each problem names its setting (`check-config` and
    a refresh candidate that moves the ledger)."""
    try:
        choice = choose_ledger(edge)
    except LedgerUnavailable as exc:
        return [ConfigError(path="edge.ledger", message=str(exc))]
    return choice.inspect()


def _ensure_state_dir(path: Path) -> None:
    try:
        state_dirs.ensure_writable(path)
    except state_dirs.StateDirUnusable as exc:
        raise LedgerUnavailable(f"edge.state_dir {exc}") from None


def _inspect_state_dir(path: Path) -> list[ConfigError]:
    try:
        state_dirs.inspect(path)
    except state_dirs.StateDirUnusable as exc:
        return [ConfigError(path="edge.state_dir", message=str(exc))]
    return []
