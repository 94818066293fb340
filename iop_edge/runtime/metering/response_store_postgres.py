"""The Responses store in PostgreSQL (`iop_responses`), beside the shared usage ledger.

Replicas sharing the ledger share stored responses, so a conversation goes on whichever
replica a caller reaches (design §13, §14). The rules are `response_store`'s; this is the
storage. The table is created when missing, under the ledger's advisory lock so replicas
starting together do not race on the DDL. One connection, opened on first use and again
after a failure (a restarted server); the password comes from the environment as for the
ledger (`ledger_postgres.connect`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import psycopg

from iop_edge.core.ledger_url import PostgresUrl
from iop_edge.core.response_chain import MAX_CHAIN
from iop_edge.runtime.metering.ledger_postgres import SCHEMA_LOCK, LedgerUnavailable, connect
from iop_edge.runtime.metering.response_store import ChainRow, ResponseRow

__all__ = ["PostgresResponses"]

TABLE: Final = "iop_responses"

_CHAIN: Final = f"""
WITH RECURSIVE chain(id, previous_id, input, response, depth) AS (
    SELECT id, previous_id, input, response, 1 FROM {TABLE}
    WHERE id = %(tip)s AND principal_ref = %(principal)s AND used_at >= %(since)s
    UNION ALL
    SELECT r.id, r.previous_id, r.input, r.response, chain.depth + 1
    FROM {TABLE} AS r JOIN chain ON r.id = chain.previous_id
    WHERE r.principal_ref = %(principal)s AND r.used_at >= %(since)s
      AND chain.depth <= %(limit)s
)
SELECT id, previous_id, input, response FROM chain
"""


class PostgresResponses:
    """`ResponseBackend` in PostgreSQL (see the module docstring)."""

    ERRORS: tuple[type[Exception], ...] = (psycopg.Error, LedgerUnavailable)

    def __init__(self, url: PostgresUrl, password_env: str | None) -> None:
        self.url = url
        self.password_env = password_env
        self._connection: psycopg.Connection[Any] | None = None

    def _db(self) -> psycopg.Connection[Any]:
        connection = self._connection
        if connection is None or connection.closed or connection.broken:
            self.close()
            connection = connect(self.url, self.password_env)
            connection.autocommit = True
            try:
                with connection.transaction():
                    connection.execute("SELECT pg_advisory_xact_lock(%s)", [SCHEMA_LOCK])
                    connection.execute(
                        f"CREATE TABLE IF NOT EXISTS {TABLE} ("
                        "id TEXT PRIMARY KEY, principal_ref TEXT NOT NULL, previous_id TEXT, "
                        "created_at DOUBLE PRECISION NOT NULL, "
                        "used_at DOUBLE PRECISION NOT NULL, "
                        "input BYTEA NOT NULL, response BYTEA NOT NULL)"
                    )
                    connection.execute(
                        f"CREATE INDEX IF NOT EXISTS {TABLE}_used_at ON {TABLE} (used_at)"
                    )
            except psycopg.Error:
                connection.close()
                raise
            self._connection = connection
        return connection

    def _failed(self) -> None:
        """Drop a connection that failed; the next call opens another."""
        connection = self._connection
        if connection is not None and (connection.closed or connection.broken):
            self.close()

    def open(self) -> int:
        return self._count(self._db())

    def put(self, row: ResponseRow, continues: Sequence[str], now: float) -> None:
        try:
            connection = self._db()
            with connection.transaction():
                connection.execute(
                    f"INSERT INTO {TABLE} "
                    "(id, principal_ref, previous_id, created_at, used_at, input, response) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET "
                    "previous_id = excluded.previous_id, used_at = excluded.used_at, "
                    "input = excluded.input, response = excluded.response "
                    f"WHERE {TABLE}.principal_ref = excluded.principal_ref",
                    [row.id, row.principal_ref, row.previous_id, now, now, row.input, row.response],
                )
                if continues:
                    connection.execute(
                        f"UPDATE {TABLE} SET used_at = %s "
                        "WHERE id = ANY(%s) AND principal_ref = %s",
                        [now, list(continues), row.principal_ref],
                    )
        except psycopg.Error:
            self._failed()
            raise

    def chain(self, principal_ref: str, tip: str, since: float) -> list[ChainRow]:
        try:
            rows = (
                self._db()
                .execute(
                    _CHAIN,
                    {"tip": tip, "principal": principal_ref, "since": since, "limit": MAX_CHAIN},
                )
                .fetchall()
            )
        except psycopg.Error:
            self._failed()
            raise
        return [(str(i), p, bytes(inp), bytes(resp)) for i, p, inp, resp in rows]

    def get(self, principal_ref: str, response_id: str, since: float) -> bytes | None:
        try:
            row = (
                self._db()
                .execute(
                    f"SELECT response FROM {TABLE} WHERE id = %s AND principal_ref = %s "
                    "AND used_at >= %s",
                    [response_id, principal_ref, since],
                )
                .fetchone()
            )
        except psycopg.Error:
            self._failed()
            raise
        return None if row is None else bytes(row[0])

    def delete(self, principal_ref: str, response_id: str) -> bool:
        try:
            cursor = self._db().execute(
                f"DELETE FROM {TABLE} WHERE id = %s AND principal_ref = %s",
                [response_id, principal_ref],
            )
        except psycopg.Error:
            self._failed()
            raise
        return cursor.rowcount > 0

    def prune(self, before: float, keep: int) -> int:
        try:
            connection = self._db()
            with connection.transaction():
                connection.execute(f"DELETE FROM {TABLE} WHERE used_at < %s", [before])
                connection.execute(
                    f"DELETE FROM {TABLE} WHERE id IN (SELECT id FROM {TABLE} "
                    "ORDER BY used_at DESC, id DESC OFFSET %s)",
                    [keep],
                )
            return self._count(connection)
        except psycopg.Error:
            self._failed()
            raise

    @staticmethod
    def _count(connection: psycopg.Connection[Any]) -> int:
        row = connection.execute(f"SELECT COUNT(*) FROM {TABLE}").fetchone()
        return int(row[0]) if row is not None else 0

    def close(self) -> None:
        if self._connection is not None:
            try:
                self._connection.close()
            finally:
                self._connection = None
