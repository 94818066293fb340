"""The SQLite file in `state_dir` that the usage ledger and the Responses store share.

Both write it, each on a connection of its own (`usage_ledger.ledger_sqlite`,
`response_store`), so both open it the one way this module says.

Rules:
1. WAL mode with `synchronous=NORMAL`: a commit is an append to the write-ahead log, not
   an fsync'd rewrite, and a reader never blocks a writer. A power cut may lose the last
   commits; the usage journal (fsynced every `journal.SYNC_INTERVAL_S`) replays them.
2. The write-ahead log gives its disk back (`WAL_LIMIT_BYTES`). A checkpoint cannot
   restart the log while a reader holds an older snapshot (a long `/usage` report, a
   conversation being loaded), so the log grows past its usual few MiB meanwhile: a
   burst of stored responses can take it to tens of MiB. SQLite reuses the file from its
   start after the next complete checkpoint but, left alone, never shrinks it; with a
   limit it truncates the file to that size then. Room the log kept for good would be
   room the Responses store counts on for metering and no longer finds
   (`response_store` Rule 4).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Final

__all__ = ["WAL_LIMIT_BYTES", "open_shared"]

#: The write-ahead log's size after a checkpoint (Rule 2): twice what SQLite's automatic
#: checkpoint lets it reach between two (1,000 pages of 4 KiB), so the usual traffic
#: never truncates and grows it again.
WAL_LIMIT_BYTES: Final = 8 * 1024 * 1024


def open_shared(path: Path, *, timeout_s: float = 5.0) -> sqlite3.Connection:
    """A writer's connection to the shared file at `path` (created with its folder when
    missing), set up as Rules 1 and 2 say; usable from any one thread at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(path, check_same_thread=False, timeout=timeout_s)
    try:
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=NORMAL")
        connection.execute(f"PRAGMA journal_size_limit={WAL_LIMIT_BYTES}")
    except sqlite3.Error:
        connection.close()
        raise
    return connection
