"""Daily budgets reserved in the shared PostgreSQL ledger (design §15, limits Rule 7).

Replicas that share a ledger admit against one counter per principal per UTC day, so a
burst spread over them cannot spend a budget once per replica:

- `iop_budget_days (principal, day, used, reserved)`: `used` is what the principal's
  settled runs used that day, `reserved` what its runs in flight (on every replica)
  reserved. A reservation is one `UPDATE ... SET reserved = reserved + n WHERE used +
  reserved < budget RETURNING`: PostgreSQL locks that one row for the statement, so two
  replicas reserving for the same principal take turns on it and no other principal
  waits (no lock wider than the row, none held between statements). A principal's first
  reservation of a day creates the row from what the usage ledger (`iop_usage`) already
  holds for it that day.
- `iop_budget_holds (instance, principal, day, reserved)`: what each replica holds, in
  the same transaction. A replica that was killed leaves holds behind; once it is gone
  from the replica roster (`iop_replicas`, `replicas.STALE_AFTER_S`) any replica gives
  them back (`release_stale`). Its runs' usage reaches the ledger when its journal is
  replayed, and each replica's own reading of the ledger (limits Rule 3) counts it.
- Settling moves a run's reservation to `used` (the tokens it was metered for), row and
  hold together.

Every method blocks (the caller runs it in a worker thread) and is bounded by the
server's statement timeout and libpq's connect timeout. Connections are kept in a small
pool, one per concurrent caller.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Final

import psycopg

from iop_edge.core.configuration.ledger_url import PostgresUrl
from iop_edge.runtime.lifecycle.replicas import STALE_AFTER_S
from iop_edge.runtime.metering.usage_ledger.ledger_postgres import SCHEMA_LOCK, TABLE, connect

__all__ = ["DAYS", "HOLDS", "PostgresBudgets"]

DAYS: Final = "iop_budget_days"
HOLDS: Final = "iop_budget_holds"
#: A reservation waits at most this long for the server (a request path).
STATEMENT_TIMEOUT_MS: Final = 2000

_RESERVE: Final = (
    f"UPDATE {DAYS} SET reserved = reserved + %(tokens)s "
    "WHERE principal = %(principal)s AND day = %(day)s AND used + reserved < %(budget)s "
    "RETURNING used + reserved"
)
_EXISTS: Final = f"SELECT 1 FROM {DAYS} WHERE principal = %(principal)s AND day = %(day)s"
_SEED: Final = (
    f"INSERT INTO {DAYS} (principal, day, used, reserved) "
    "SELECT %(principal)s, %(day)s, "
    "COALESCE(SUM(prompt_tokens + completion_tokens), 0), 0 "
    f"FROM {TABLE} WHERE principal_ref = %(principal)s AND time >= %(day)s "
    "ON CONFLICT (principal, day) DO NOTHING"
)
_HOLD: Final = (
    f"INSERT INTO {HOLDS} (instance, principal, day, reserved) "
    "VALUES (%(instance)s, %(principal)s, %(day)s, %(tokens)s) "
    "ON CONFLICT (instance, principal, day) "
    f"DO UPDATE SET reserved = {HOLDS}.reserved + excluded.reserved"
)
_SETTLE_DAY: Final = (
    f"UPDATE {DAYS} SET reserved = GREATEST(0, reserved - %(released)s), "
    "used = used + %(used)s WHERE principal = %(principal)s AND day = %(day)s"
)
_SETTLE_HOLD: Final = (
    f"UPDATE {HOLDS} SET reserved = GREATEST(0, reserved - %(released)s) "
    "WHERE instance = %(instance)s AND principal = %(principal)s AND day = %(day)s"
)
_RELEASE_STALE: Final = (
    f"WITH gone AS (DELETE FROM {HOLDS} WHERE reserved <= 0 OR (instance <> %(instance)s "
    "AND instance NOT IN (SELECT instance FROM iop_replicas WHERE seen_at >= %(alive)s)) "
    "RETURNING principal, day, reserved), "
    "sums AS (SELECT principal, day, SUM(reserved) AS reserved FROM gone GROUP BY principal, day) "
    f"UPDATE {DAYS} AS d SET reserved = GREATEST(0, d.reserved - sums.reserved) FROM sums "
    "WHERE d.principal = sums.principal AND d.day = sums.day"
)


class PostgresBudgets:
    """Reservations against budgets shared by replicas (see the module docstring).
    `instance` is this Edge's name in the replica roster."""

    def __init__(self, url: PostgresUrl, password_env: str | None, instance: str) -> None:
        self._url = url
        self._password_env = password_env
        self._instance = instance
        self._idle: list[psycopg.Connection[Any]] = []
        self._lock = threading.Lock()
        self._ready = False

    def __repr__(self) -> str:
        return f"PostgreSQL {self._url}"

    # --- connections -----------------------------------------------------------------

    def _take(self) -> psycopg.Connection[Any]:
        with self._lock:
            while self._idle:
                connection = self._idle.pop()
                if not (connection.closed or connection.broken):
                    return connection
        connection = connect(self._url, self._password_env)
        connection.autocommit = True
        connection.execute(f"SET statement_timeout = {STATEMENT_TIMEOUT_MS}")
        if not self._ready:
            self._create_schema(connection)
            self._ready = True
        return connection

    def _give(self, connection: psycopg.Connection[Any]) -> None:
        if connection.closed or connection.broken:
            return
        with self._lock:
            self._idle.append(connection)

    @staticmethod
    def _create_schema(connection: psycopg.Connection[Any]) -> None:
        with connection.transaction():
            connection.execute("SELECT pg_advisory_xact_lock(%s)", [SCHEMA_LOCK])
            connection.execute(
                f"CREATE TABLE IF NOT EXISTS {DAYS} (principal TEXT NOT NULL, "
                "day BIGINT NOT NULL, used BIGINT NOT NULL, reserved BIGINT NOT NULL, "
                "PRIMARY KEY (principal, day))"
            )
            connection.execute(
                f"CREATE TABLE IF NOT EXISTS {HOLDS} (instance TEXT NOT NULL, "
                "principal TEXT NOT NULL, day BIGINT NOT NULL, reserved BIGINT NOT NULL, "
                "PRIMARY KEY (instance, principal, day))"
            )
            connection.execute(
                "CREATE TABLE IF NOT EXISTS iop_replicas ("
                "instance TEXT PRIMARY KEY, document TEXT NOT NULL, "
                "seen_at DOUBLE PRECISION NOT NULL)"
            )

    # --- operations ------------------------------------------------------------------

    def reserve(self, principal: str, day: int, tokens: int, budget: int) -> bool:
        """Reserve `tokens` of `principal`'s `budget` for `day`; False when what every
        replica used and reserved that day has reached the budget (nothing reserved)."""
        params = {
            "principal": principal,
            "day": day,
            "tokens": tokens,
            "budget": budget,
            "instance": self._instance,
        }
        connection = self._take()
        try:
            with connection.transaction():
                row = connection.execute(_RESERVE, params).fetchone()
                if row is None and connection.execute(_EXISTS, params).fetchone() is None:
                    # The principal's first reservation today: make its row, then reserve.
                    connection.execute(_SEED, params)
                    row = connection.execute(_RESERVE, params).fetchone()
                if row is None:
                    return False
                connection.execute(_HOLD, params)
            return True
        finally:
            self._give(connection)

    def settle(self, settlements: Mapping[tuple[str, int], tuple[int, int]]) -> None:
        """Per (principal, day): (tokens reserved to release, tokens used to add)."""
        connection = self._take()
        try:
            with connection.transaction():
                for (principal, day), (released, used) in settlements.items():
                    params = {
                        "principal": principal,
                        "day": day,
                        "released": released,
                        "used": used,
                        "instance": self._instance,
                    }
                    connection.execute(_SETTLE_DAY, params)
                    connection.execute(_SETTLE_HOLD, params)
        finally:
            self._give(connection)

    def release_stale(self, now: float) -> None:
        """Give back the holds of replicas gone from the roster, and drop empty ones."""
        connection = self._take()
        try:
            with connection.transaction():
                connection.execute(
                    _RELEASE_STALE, {"instance": self._instance, "alive": now - STALE_AFTER_S}
                )
        finally:
            self._give(connection)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
