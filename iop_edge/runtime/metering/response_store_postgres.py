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

from iop_edge.core.configuration.ledger_url import PostgresUrl
from iop_edge.core.responses.response_chain import MAX_CHAIN
from iop_edge.runtime.metering.response_store import ChainRow, ResponseRow, Tally
from iop_edge.runtime.metering.usage_ledger.ledger_postgres import (
    SCHEMA_LOCK,
    LedgerUnavailable,
    connect,
)

__all__ = ["PostgresResponses"]

TABLE: Final = "iop_responses"

#: A row's bytes as the bounds count them.
_SIZE: Final = "(octet_length(input) + octet_length(response))::bigint"
_CHAIN: Final = f"""
WITH RECURSIVE chain(id, previous_id, input, response, depth, running) AS (
    SELECT id, previous_id, input, response, 1, {_SIZE} FROM {TABLE}
    WHERE id = %(tip)s AND principal_ref = %(principal)s AND used_at >= %(since)s
    UNION ALL
    SELECT r.id, r.previous_id, r.input, r.response, chain.depth + 1,
        chain.running + octet_length(r.input) + octet_length(r.response)
    FROM {TABLE} AS r JOIN chain ON r.id = chain.previous_id
    WHERE r.principal_ref = %(principal)s AND r.used_at >= %(since)s
      AND chain.depth <= %(limit)s AND chain.running <= %(max_bytes)s
)
SELECT id, previous_id, input, response, running FROM chain
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
                    connection.execute(
                        f"CREATE INDEX IF NOT EXISTS {TABLE}_principal ON {TABLE} (principal_ref)"
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

    def put(self, row: ResponseRow, continues: Sequence[str], now: float) -> bool:
        try:
            connection = self._db()
            with connection.transaction():
                cursor = connection.execute(
                    f"INSERT INTO {TABLE} "
                    "(id, principal_ref, previous_id, created_at, used_at, input, response) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING",
                    [row.id, row.principal_ref, row.previous_id, now, now, row.input, row.response],
                )
                if cursor.rowcount != 1:
                    return False
                if continues:
                    connection.execute(
                        f"UPDATE {TABLE} SET used_at = %s "
                        "WHERE id = ANY(%s) AND principal_ref = %s",
                        [now, list(continues), row.principal_ref],
                    )
        except psycopg.Error:
            self._failed()
            raise
        return True

    def chain(self, principal_ref: str, tip: str, since: float, max_bytes: int) -> list[ChainRow]:
        parameters = {
            "tip": tip,
            "principal": principal_ref,
            "since": since,
            "limit": MAX_CHAIN,
            "max_bytes": max_bytes,
        }
        try:
            rows = self._db().execute(_CHAIN, parameters).fetchall()
        except psycopg.Error:
            self._failed()
            raise
        return [(str(i), p, bytes(inp), bytes(resp), int(n)) for i, p, inp, resp, n in rows]

    def held(self, principal_ref: str, since: float) -> int:
        try:
            row = (
                self._db()
                .execute(
                    f"SELECT COALESCE(SUM({_SIZE}), 0) FROM {TABLE} "
                    "WHERE principal_ref = %s AND used_at >= %s",
                    [principal_ref, since],
                )
                .fetchone()
            )
        except psycopg.Error:
            self._failed()
            raise
        return int(row[0]) if row is not None else 0

    def room_bytes(self) -> int | None:
        return None  # the database's disk is not this host's to see

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

    def prune(self, before: float, keep: int, keep_bytes: int) -> Tally:
        try:
            connection = self._db()
            with connection.transaction():
                connection.execute(f"DELETE FROM {TABLE} WHERE used_at < %s", [before])
                connection.execute(
                    f"DELETE FROM {TABLE} WHERE id IN (SELECT id FROM {TABLE} "
                    "ORDER BY used_at DESC, id DESC OFFSET %s)",
                    [keep],
                )
                connection.execute(
                    f"DELETE FROM {TABLE} WHERE id IN (SELECT id FROM (SELECT id, "
                    f"SUM({_SIZE}) OVER (ORDER BY used_at DESC, id DESC) AS running "
                    f"FROM {TABLE}) AS ranked WHERE running > %s)",
                    [keep_bytes],
                )
            rows = connection.execute(
                f"SELECT principal_ref, COUNT(*), SUM({_SIZE}) FROM {TABLE} GROUP BY principal_ref"
            ).fetchall()
        except psycopg.Error:
            self._failed()
            raise
        held = {str(principal): int(size or 0) for principal, _, size in rows}
        return Tally(
            rows=sum(int(count) for _, count, _ in rows), bytes=sum(held.values()), held=held
        )

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
