"""The SQLite usage ledger's schema upgrades (design §7): what an Edge does to a ledger
file an older Edge wrote, when it opens it.

Rules:
1. Columns added since the first schema (`ADDED_COLUMNS`) are added with `ALTER TABLE`;
   the older rows take the column's default (`usage_source` "provider", `protocol`
   "chat", `cached_tokens` 0: all an older Edge knew).
2. `GET /usage`'s default grouping (principal, token, model) and every sum it makes are
   served from one covering index (`PRINCIPAL_INDEX`): a page of groups costs what it
   returns, the totals one scan of the index (`bench/usage_views.py`). When the sums
   grow a column the index is rebuilt under a new name and the older one dropped, once
   (a few seconds for a million records), after the columns exist.
"""

from __future__ import annotations

import logging
import sqlite3
from typing import Final

__all__ = ["ADDED_COLUMNS", "PRINCIPAL_INDEX_NAME", "create_index", "migrate"]

log = logging.getLogger(__name__)

#: Columns added since the first schema, with their definitions (Rule 1).
ADDED_COLUMNS: Final = {
    "usage_source": "TEXT NOT NULL DEFAULT 'provider'",
    "protocol": "TEXT NOT NULL DEFAULT 'chat'",
    "cached_tokens": "INTEGER NOT NULL DEFAULT 0",
}
PRINCIPAL_INDEX_NAME: Final = "usage_by_principal_tokens"
#: The covering index of Rule 2; it names every column `usage_store.AGGREGATES` sums.
PRINCIPAL_INDEX: Final = (
    f"CREATE INDEX IF NOT EXISTS {PRINCIPAL_INDEX_NAME} ON usage"
    "(principal_ref, token_ref, model, time, prompt_tokens, completion_tokens,"
    " usage_source, cached_tokens)"
)
#: Indexes of older Edges that `PRINCIPAL_INDEX` replaces (Rule 2).
REPLACED_INDEXES: Final = ("usage_by_principal",)


def migrate(connection: sqlite3.Connection) -> None:
    """Add the columns an older ledger file lacks (Rule 1)."""
    present = {row[1] for row in connection.execute("PRAGMA table_info(usage)")}
    for name, definition in ADDED_COLUMNS.items():
        if name not in present:
            log.info("usage ledger: adding column %s (a ledger from an older Edge)", name)
            with connection:
                connection.execute(f"ALTER TABLE usage ADD COLUMN {name} {definition}")


def create_index(connection: sqlite3.Connection) -> None:
    """`PRINCIPAL_INDEX`, on a ledger from an Edge that had none or an older one (Rule 2)."""
    names = {
        row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
    }
    if PRINCIPAL_INDEX_NAME in names:
        return
    log.info("usage ledger: indexing the records by principal (once)")
    with connection:
        connection.execute(PRINCIPAL_INDEX)
        for old in REPLACED_INDEXES:
            if old in names:
                connection.execute(f"DROP INDEX {old}")
