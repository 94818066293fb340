"""The usage ledger in PostgreSQL, shared by Edge replicas (SPEC §7, §13).

Everything but the storage is `UsageLedger`'s: `record` queues without waiting, one
writer task inserts batches from a worker thread, a failed batch is counted as dropped
and logged, never raised into the gateway. Here:

- The table's columns are `UsageRecord`'s fields (`iop_usage`), created when missing and
  extended when a newer Edge adds a field (`ADD COLUMN IF NOT EXISTS`), under an advisory
  lock so replicas starting together do not race on the DDL.
- The writer keeps one connection and opens a fresh one after a failure (a restarted
  server, a dropped connection): the batch that failed is lost, the next one goes on.
  Queries (`GET /usage`) open their own short connection, as the SQLite ledger does.
- The password comes from the environment variable `edge.ledger_password_env` names, or
  from libpq's own `PGPASSWORD` / `~/.pgpass`; never from the config (`core.ledger_url`).

psycopg (3) is imported here only, so an Edge without a PostgreSQL ledger never needs it
(`pip install 'iop[postgres]'`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Final

import psycopg
from psycopg import sql

from iop_edge.core.ledger_url import PostgresUrl
from iop_edge.runtime.replicas import FORGET_AFTER_S, STALE_AFTER_S
from iop_edge.runtime.usage import UsageLedger, UsageRecord, UsageReport, UsageRow

__all__ = ["LedgerUnavailable", "PostgresLedger", "PostgresReplicaStore", "connect"]

log = logging.getLogger(__name__)

TABLE: Final = "iop_usage"
#: One number for every replica's schema setup (pg_advisory_xact_lock).
_SCHEMA_LOCK: Final = 0x1017_0001
CONNECT_TIMEOUT_S: Final = 10

_SQL_TYPES: Final = {str: "TEXT", int: "BIGINT", float: "DOUBLE PRECISION", bool: "BOOLEAN"}


class LedgerUnavailable(Exception):
    """The PostgreSQL ledger cannot be reached or set up; the message says why."""


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
    for field in dataclasses.fields(UsageRecord):
        kind = hints[field.name]
        nullable = False
        if isinstance(kind, types.UnionType):
            members = [member for member in typing.get_args(kind) if member is not type(None)]
            nullable = len(members) < len(typing.get_args(kind))
            kind = members[0]
        columns.append((field.name, _SQL_TYPES.get(kind, "TEXT"), nullable))
    return columns


class _Writer:
    """The writer's connection, reopened after a failure."""

    def __init__(self, url: PostgresUrl, password_env: str | None) -> None:
        self._url = url
        self._password_env = password_env
        self._connection: psycopg.Connection[Any] | None = None

    def connection(self) -> psycopg.Connection[Any]:
        if self._connection is None or self._connection.closed or self._connection.broken:
            self.close()
            self._connection = connect(self._url, self._password_env)
        return self._connection

    def failed(self) -> None:
        self.close()

    def close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.close()
            finally:
                self._connection = None


class PostgresLedger(UsageLedger):
    """`UsageLedger` with its records in PostgreSQL (see the module docstring)."""

    WRITE_ERRORS: ClassVar[tuple[type[Exception], ...]] = (psycopg.Error, LedgerUnavailable)

    def __init__(self, url: PostgresUrl, password_env: str | None) -> None:
        super().__init__(Path(os.devnull))
        self.url = url
        self.password_env = password_env

    def __repr__(self) -> str:
        return f"<PostgresLedger {self.url}>"

    # --- storage hooks of UsageLedger ---------------------------------------------------

    def _connect(self) -> _Writer:  # type: ignore[override]
        writer = _Writer(self.url, self.password_env)
        try:
            self._create_schema(writer.connection())
        except psycopg.Error as exc:
            writer.close()
            raise LedgerUnavailable(
                f"cannot set up the ledger at {self.url}: {_reason(exc)}"
            ) from None
        return writer

    @staticmethod
    def _insert(writer: _Writer, batch: Sequence[UsageRecord]) -> None:  # type: ignore[override]
        names = [name for name, _, _ in _columns()]
        statement = sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            sql.Identifier(TABLE),
            sql.SQL(", ").join(map(sql.Identifier, names)),
            sql.SQL(", ").join(sql.Placeholder() * len(names)),
        )
        try:
            connection = writer.connection()
            with connection.transaction(), connection.cursor() as cursor:
                cursor.executemany(statement, [dataclasses.astuple(record) for record in batch])
        except (psycopg.OperationalError, LedgerUnavailable):
            writer.failed()  # the next batch reconnects
            raise

    def _aggregate(
        self, since: float | None, until: float | None, columns: list[str]
    ) -> UsageReport:
        where: list[sql.Composable] = []
        params: list[float] = []
        if since is not None:
            where.append(sql.SQL("time >= %s"))
            params.append(since)
        if until is not None:
            where.append(sql.SQL("time < %s"))
            params.append(until)
        keys = [sql.Identifier(column) for column in columns]
        totals = sql.SQL("COUNT(*), SUM(prompt_tokens), SUM(completion_tokens)")
        query = sql.SQL("SELECT {} FROM {}").format(
            sql.SQL(", ").join([*keys, totals]), sql.Identifier(TABLE)
        )
        if where:
            query += sql.SQL(" WHERE ") + sql.SQL(" AND ").join(where)
        if keys:
            grouping = sql.SQL(", ").join(keys)
            query += sql.SQL(" GROUP BY {} ORDER BY {}").format(grouping, grouping)
        with connect(self.url, self.password_env) as connection:
            rows = connection.execute(query, params).fetchall()
        result = []
        for row in rows:
            group = dict(zip(columns, row[: len(columns)], strict=True))
            requests, prompt, completion = row[len(columns) :]
            if requests:
                result.append(
                    UsageRow(
                        requests=requests,
                        prompt_tokens=int(prompt or 0),
                        completion_tokens=int(completion or 0),
                        **group,
                    )
                )
        return UsageReport(since=since, until=until, group_by=columns, rows=result)

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
            connection.execute("SELECT pg_advisory_xact_lock(%s)", [_SCHEMA_LOCK])
            connection.execute(
                sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                    sql.Identifier(TABLE), definitions
                )
            )
            for name, kind, _ in columns:  # a newer Edge's fields, on an older table
                connection.execute(
                    sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS {} {}").format(
                        sql.Identifier(TABLE), sql.Identifier(name), sql.SQL(kind)
                    )
                )
            connection.execute(
                sql.SQL("CREATE INDEX IF NOT EXISTS {} ON {} (time)").format(
                    sql.Identifier(f"{TABLE}_time"), sql.Identifier(TABLE)
                )
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
            connection.execute("SELECT pg_advisory_xact_lock(%s)", [_SCHEMA_LOCK])
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
