"""The usage ledger in PostgreSQL, shared by Edge replicas (design §7, §13).

Everything but the storage is `UsageLedger`'s: `record` appends to this Edge's journal
in its `state_dir` without waiting, one writer task moves the journal into the store in
batches from a worker thread, a refused batch is retried (the journal holds it), and a
killed Edge's journal is replayed at its next start. `PostgresStore` is the storage:

- The table's columns are `UsageRecord`'s fields (`iop_usage`), created when missing and
  extended when a newer Edge adds a field (`ADD COLUMN IF NOT EXISTS`, the older rows
  taking the field's default: `protocol` is `chat` for them, `cached_tokens` 0), under
  an advisory lock so replicas starting together do not race on the DDL.
- Each journal segment's checkpoint (`iop_journal_checkpoint`) moves in the same
  transaction as its records, so a replayed journal inserts every record exactly once.
  Segment names carry the writing process's pid and a random part, so replicas never
  share one.
- The writer keeps one connection and opens a fresh one after a failure (a restarted
  server, a dropped connection); the refused batch is retried from the journal.
  Queries (`GET /usage`) open their own short connection, as the SQLite ledger does.
- The password comes from the environment variable `edge.ledger_password_env` names, or
  from libpq's own `PGPASSWORD` / `~/.pgpass`; never from the config
  (`core.configuration.ledger_url`).

psycopg (3) is imported here only, so an Edge without a PostgreSQL ledger never needs it
(`pip install 'iop-gateway[postgres]'`).
"""

from __future__ import annotations

import logging
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, Final

import msgspec
import psycopg
from psycopg import sql

from iop_edge.core.configuration.ledger_url import PostgresUrl
from iop_edge.runtime.lifecycle.replicas import FORGET_AFTER_S, STALE_AFTER_S
from iop_edge.runtime.metering.usage_ledger.usage_store import (
    AGGREGATES,
    LedgerUnavailable,
    UsageRecord,
    UsageReport,
    UsageSelection,
    paged,
    row_of,
    usage_report,
)

__all__ = ["LedgerUnavailable", "PostgresReplicaStore", "PostgresStore", "connect"]

log = logging.getLogger(__name__)

TABLE: Final = "iop_usage"
#: Each journal segment's checkpoint (journal Rule 2), beside the records it moved.
CHECKPOINTS: Final = "iop_journal_checkpoint"
#: One number for every replica's schema setup (pg_advisory_xact_lock).
SCHEMA_LOCK: Final = 0x1017_0001
CONNECT_TIMEOUT_S: Final = 10

_SQL_TYPES: Final = {str: "TEXT", int: "BIGINT", float: "DOUBLE PRECISION", bool: "BOOLEAN"}


def connect(url: PostgresUrl, password_env: str | None) -> psycopg.Connection[Any]:
    """A connection to the ledger database, the password from the environment."""
    kwargs: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_S}
    if password_env is not None:
        password = os.environ.get(password_env)
        if password is None:
            raise LedgerUnavailable(
                f"edge.ledger_password_env names {password_env}, which is not set"
            )
        kwargs["password"] = password
    try:
        return psycopg.connect(url.url, **kwargs)
    except psycopg.Error as exc:
        raise LedgerUnavailable(f"cannot reach the ledger at {url}: {_reason(exc)}") from None


def _columns() -> list[tuple[str, str, bool]]:
    """(name, SQL type, nullable) of every `UsageRecord` field, in field order."""
    hints = typing.get_type_hints(UsageRecord)
    columns = []
    for field in msgspec.structs.fields(UsageRecord):
        kind = hints[field.name]
        nullable = False
        if isinstance(kind, types.UnionType):
            members = [member for member in typing.get_args(kind) if member is not type(None)]
            nullable = len(members) < len(typing.get_args(kind))
            kind = members[0]
        columns.append((field.name, _SQL_TYPES.get(kind, "TEXT"), nullable))
    return columns


def _defaults() -> dict[str, sql.Literal]:
    """The SQL default of each `UsageRecord` field that has one: what the rows of an older
    table get when the column is added."""
    return {
        field.name: sql.Literal(field.default)
        for field in msgspec.structs.fields(UsageRecord)
        if field.default is not msgspec.NODEFAULT and field.default is not None
    }


class PostgresStore:
    """`LedgerStore` in PostgreSQL (see the module docstring)."""

    WRITE_ERRORS: tuple[type[Exception], ...] = (psycopg.Error, LedgerUnavailable)
    shared = True

    def __init__(self, url: PostgresUrl, password_env: str | None) -> None:
        self.url = url
        self.password_env = password_env
        self._connection: psycopg.Connection[Any] | None = None

    def __repr__(self) -> str:
        return f"PostgreSQL {self.url}"

    def _db(self) -> psycopg.Connection[Any]:
        """The writer's connection, reopened after a failure (a restarted server)."""
        connection = self._connection
        if connection is None or connection.closed or connection.broken:
            self.close()
            connection = self._connection = connect(self.url, self.password_env)
            # Every change is in an explicit `transaction()` block; a bare query must not
            # open an implicit transaction that would turn those blocks into savepoints.
            connection.autocommit = True
        return connection

    def open(self) -> None:
        try:
            self._create_schema(self._db())
        except psycopg.Error as exc:
            self.close()
            raise LedgerUnavailable(
                f"cannot set up the ledger at {self.url}: {_reason(exc)}"
            ) from None

    def checkpoints(self) -> dict[str, int]:
        rows = self._db().execute(f'SELECT segment, "offset" FROM {CHECKPOINTS}').fetchall()
        return {str(segment): int(offset) for segment, offset in rows}

    def insert(self, records: Sequence[UsageRecord], segment: str, offset: int) -> None:
        names = [name for name, _, _ in _columns()]
        statement = sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            sql.Identifier(TABLE),
            sql.SQL(", ").join(map(sql.Identifier, names)),
            sql.SQL(", ").join(sql.Placeholder() * len(names)),
        )
        rows = [row_of(record) for record in records]
        try:
            connection = self._db()
            with connection.transaction():
                try:
                    with connection.transaction(), connection.cursor() as cursor:
                        cursor.executemany(statement, rows)
                except psycopg.DataError:
                    # One bad row must not hold back the others: insert them one by one.
                    for row in rows:
                        try:
                            with connection.transaction():
                                connection.execute(statement, row)
                        except psycopg.DataError:
                            log.error("usage ledger: record %s cannot be stored; skipped", row[1])
                connection.execute(
                    f'INSERT INTO {CHECKPOINTS} (segment, "offset") VALUES (%s, %s) '
                    'ON CONFLICT (segment) DO UPDATE SET "offset" = excluded."offset"',
                    [segment, offset],
                )
        except (psycopg.OperationalError, LedgerUnavailable):
            self.close()  # the next batch reconnects
            raise

    def forget(self, segments: Sequence[str]) -> None:
        connection = self._db()  # PostgreSQL commits durably: nothing to sync first
        with connection.transaction():
            for segment in segments:
                connection.execute(f"DELETE FROM {CHECKPOINTS} WHERE segment = %s", [segment])

    def aggregate(self, selection: UsageSelection) -> UsageReport:
        """`usage_store.aggregate_sql`'s page and `usage_store.totals_sql`'s sums, composed
        with the columns as identifiers."""
        where: list[sql.Composable] = []
        params: list[Any] = []
        if selection.since is not None:
            where.append(sql.SQL("time >= %s"))
            params.append(selection.since)
        if selection.until is not None:
            where.append(sql.SQL("time < %s"))
            params.append(selection.until)
        keys = [sql.Identifier(column) for column in selection.columns]
        totals = sql.SQL(", ".join(AGGREGATES))
        table = sql.Identifier(TABLE)
        window = sql.SQL(" WHERE ") + sql.SQL(" AND ").join(where) if where else sql.SQL("")
        total_query = sql.SQL("SELECT {} FROM {}").format(totals, table) + window
        page_where = list(where)
        page_params = list(params)
        if selection.after is not None and keys:
            page_where.append(
                sql.SQL("({}) > ({})").format(
                    sql.SQL(", ").join(keys), sql.SQL(", ").join(sql.Placeholder() * len(keys))
                )
            )
            page_params.extend(selection.after)
        query = sql.SQL("SELECT {} FROM {}").format(sql.SQL(", ").join([*keys, totals]), table)
        if page_where:
            query += sql.SQL(" WHERE ") + sql.SQL(" AND ").join(page_where)
        if keys:
            grouping = sql.SQL(", ").join(keys)
            query += sql.SQL(" GROUP BY {} ORDER BY {}").format(grouping, grouping)
            if selection.limit is not None:
                query += sql.SQL(" LIMIT %s")
                page_params.append(selection.limit + 1)
        with connect(self.url, self.password_env) as connection:
            rows = connection.execute(query, page_params).fetchall()
            total = None
            if paged(selection, rows):
                total = connection.execute(total_query, params).fetchone()
        return usage_report(selection, rows, total)

    def close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.close()
            finally:
                self._connection = None

    # --- schema ---------------------------------------------------------------------------

    @staticmethod
    def _create_schema(connection: psycopg.Connection[Any]) -> None:
        columns = _columns()
        definitions = sql.SQL(", ").join(
            sql.SQL("{} {}{}").format(
                sql.Identifier(name),
                sql.SQL(kind),
                sql.SQL("") if nullable else sql.SQL(" NOT NULL"),
            )
            for name, kind, nullable in columns
        )
        with connection.transaction():
            connection.execute("SELECT pg_advisory_xact_lock(%s)", [SCHEMA_LOCK])
            connection.execute(
                sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                    sql.Identifier(TABLE), definitions
                )
            )
            defaults = _defaults()
            for name, kind, _ in columns:  # a newer Edge's fields, on an older table
                default = defaults.get(name)
                connection.execute(
                    sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}{}").format(
                        sql.Identifier(TABLE),
                        sql.Identifier(name),
                        sql.SQL(kind),
                        sql.SQL("") if default is None else sql.SQL(" DEFAULT {}").format(default),
                    )
                )
            connection.execute(
                sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (time)").format(
                    sql.Identifier(f"{TABLE}_time"), sql.Identifier(TABLE)
                )
            )
            # `GET /usage`'s default grouping in order, every sum from the index alone
            # (as the SQLite ledger's, `ledger_schema` Rule 2): an older Edge's index,
            # which lacks a summed column, gives way to it.
            connection.execute(
                sql.SQL(
                    "CREATE INDEX IF NOT EXISTS {} ON {} (principal_ref, token_ref, model, "
                    "time) INCLUDE (prompt_tokens, completion_tokens, usage_source, "
                    "cached_tokens)"
                ).format(sql.Identifier(f"{TABLE}_by_principal_tokens"), sql.Identifier(TABLE))
            )
            connection.execute(
                sql.SQL("DROP INDEX IF EXISTS {}").format(sql.Identifier(f"{TABLE}_by_principal"))
            )
            connection.execute(
                f"CREATE TABLE IF NOT EXISTS {CHECKPOINTS} "
                '(segment TEXT PRIMARY KEY, "offset" BIGINT NOT NULL)'
            )


def _reason(exc: psycopg.Error) -> str:
    """The server's or libpq's message, one line."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class PostgresReplicaStore:
    """The `iop_replicas` table (see `replicas`); every call bounded by the server's
    statement timeout and libpq's connect timeout."""

    def __init__(self, url: PostgresUrl, password_env: str | None) -> None:
        self._url = url
        self._password_env = password_env
        self._connection: psycopg.Connection[Any] | None = None
        connection = self._connect()
        with connection.transaction():
            connection.execute("SELECT pg_advisory_xact_lock(%s)", [SCHEMA_LOCK])
            connection.execute(
                "CREATE TABLE IF NOT EXISTS iop_replicas ("
                "instance TEXT PRIMARY KEY, document TEXT NOT NULL, "
                "seen_at DOUBLE PRECISION NOT NULL)"
            )

    def _connect(self) -> psycopg.Connection[Any]:
        connection = self._connection
        if connection is None or connection.closed or connection.broken:
            connection = self._connection = connect(self._url, self._password_env)
            connection.autocommit = True
            connection.execute("SET statement_timeout = 5000")
        return connection

    def publish(self, instance: str, document: bytes, seen_at: float) -> None:
        self._connect().execute(
            "INSERT INTO iop_replicas VALUES (%s, %s, %s) ON CONFLICT (instance) "
            "DO UPDATE SET document = excluded.document, seen_at = excluded.seen_at",
            [instance, document.decode(), seen_at],
        )

    def remove(self, instance: str) -> None:
        self._connect().execute("DELETE FROM iop_replicas WHERE instance = %s", [instance])

    def read(self, now: float) -> list[tuple[bytes, float]]:
        connection = self._connect()
        connection.execute("DELETE FROM iop_replicas WHERE seen_at < %s", [now - FORGET_AFTER_S])
        rows = connection.execute(
            "SELECT document, seen_at FROM iop_replicas WHERE seen_at >= %s ORDER BY instance",
            [now - STALE_AFTER_S],
        ).fetchall()
        return [(str(document).encode(), float(seen_at)) for document, seen_at in rows]

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
