"""Durable traces of config refresh: the audit log and the atomic config file write.

Both are blocking file I/O, so both run in a worker thread (`trio.to_thread.run_sync`)
and never stall the event loop that serves requests. Refreshes are rare, so every write
is fsynced: after a crash the audit log and the config file say what actually happened.

The config write keeps the file whole at every instant: the new text goes to a temp
file in the same directory, is fsynced, and replaces the old one with `os.replace` (an
atomic rename). The previous text is kept beside it as `<file>.prev`, written the same
way, so a bad refresh can be undone by hand.
"""

from __future__ import annotations

import os
import stat
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import trio

from schemas.refresh import (
    NodeResult,
    RefreshError,
    RefreshMode,
    RefreshOutcome,
    RefreshReport,
    RefreshVerdict,
)

__all__ = ["AUDIT_FILE_NAME", "AuditLog", "AuditRecord", "write_config_atomically"]

AUDIT_FILE_NAME = "refresh-audit.jsonl"
_NEW_FILE_MODE = 0o644


class AuditRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One line of the audit log: one refresh attempt, whatever its outcome.

    Paths only, never values: a changed token hash is recorded as a changed path.
    """

    time: str
    """ISO 8601, UTC."""
    mode: RefreshMode | None
    """None when the request itself could not be read (see `AuditLog.append_unreadable`)."""
    outcome: RefreshOutcome
    verdict: RefreshVerdict
    """How the attempt was answered (`accepted`, `invalid`, `conflict`)."""
    base_revision: int
    revision: int
    config_sha256: str | None
    """sha256 of the candidate text; None when no candidate could be read."""
    changed_paths: list[str]
    pending_restart: list[str]
    nodes: list[NodeResult]
    errors: list[RefreshError]

    @classmethod
    def of(
        cls,
        report: RefreshReport,
        *,
        verdict: RefreshVerdict,
        config_sha256: str | None,
        now: datetime,
    ) -> AuditRecord:
        return cls(
            time=now.astimezone(UTC).isoformat(),
            mode=report.mode,
            outcome=report.outcome,
            verdict=verdict,
            base_revision=report.base_revision,
            revision=report.revision,
            config_sha256=config_sha256,
            changed_paths=[change.path for change in report.changes],
            pending_restart=list(report.pending_restart),
            nodes=list(report.nodes),
            errors=list(report.errors),
        )


class AuditLog:
    """Appends one JSON line per refresh attempt to `<state_dir>/refresh-audit.jsonl`.

    Appends are serialised by a lock, so concurrent attempts (one applying, one turned
    away as busy) never interleave their lines.
    """

    def __init__(self, state_dir: Path) -> None:
        self.path = Path(state_dir) / AUDIT_FILE_NAME
        self._lock = trio.Lock()
        self._encoder = msgspec.json.Encoder()

    async def append(
        self,
        report: RefreshReport,
        *,
        verdict: RefreshVerdict,
        config_sha256: str | None,
        now: datetime | None = None,
    ) -> AuditRecord:
        """Record one attempt durably; raises `OSError` if the log cannot be written."""
        record = AuditRecord.of(
            report, verdict=verdict, config_sha256=config_sha256, now=now or datetime.now(UTC)
        )
        await self._write(record)
        return record

    async def append_unreadable(
        self, problem: str, *, revision: int, now: datetime | None = None
    ) -> AuditRecord:
        """Record an attempt whose request could not even be read (bad JSON, wrong
        fields): rejected as invalid, its mode unknown, `problem` as its one error."""
        record = AuditRecord(
            time=(now or datetime.now(UTC)).astimezone(UTC).isoformat(),
            mode=None,
            outcome="rejected",
            verdict="invalid",
            base_revision=revision,
            revision=revision,
            config_sha256=None,
            changed_paths=[],
            pending_restart=[],
            nodes=[],
            errors=[RefreshError(path="", message=problem)],
        )
        await self._write(record)
        return record

    async def _write(self, record: AuditRecord) -> None:
        line = self._encoder.encode(record) + b"\n"
        async with self._lock:
            await trio.to_thread.run_sync(_append_line, self.path, line)


def _append_line(path: Path, line: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab") as file:
        file.write(line)
        file.flush()
        os.fsync(file.fileno())


async def write_config_atomically(path: Path, text: str) -> None:
    """Replace the config file at `path` with `text`, keeping the old one as `.prev`.

    A symlinked config is followed, so the link stays and its target is replaced.
    Raises `OSError` when the directory is not writable; the old file is then intact.
    """
    await trio.to_thread.run_sync(_write_config, Path(path), text)


def _write_config(path: Path, text: str) -> None:
    target = path.resolve()
    try:
        previous = target.read_bytes()
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        previous, mode = None, _NEW_FILE_MODE
    if previous is not None:
        _replace(target.with_name(f"{target.name}.prev"), previous, mode)
    _replace(target, text.encode("utf-8"), mode)
    _fsync_directory(target.parent)


def _replace(path: Path, data: bytes, mode: int) -> None:
    """Write `data` to a fsynced temp file beside `path`, then rename it over `path`."""
    fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fchmod(file.fileno(), mode)
            os.fsync(file.fileno())
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def _fsync_directory(directory: Path) -> None:
    """Persist the renames themselves (POSIX: a rename lives in the directory entry)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
