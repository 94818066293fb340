"""Durable traces of config refresh: the audit log and the atomic config file write.

Both are blocking file I/O, so both run in a worker thread (`trio.to_thread.run_sync`)
and never stall the event loop that serves requests. Refreshes are rare, so every write
is fsynced: after a crash the audit log and the config file say what actually happened.
A write its caller stops waiting for (a stalled disk, past the refresh's deadline)
finishes in its thread, whole, late; only the line written ahead (`reserve`) is always
waited for, since a line landing after its refresh was refused would audit an apply that
never happened.

An apply's line is written before the new config is swapped in (`reserve`): a refresh
whose audit line cannot be written (a full disk) is refused, never applied unaudited.
What the push to the Nodes then reports is only known after the swap, so `reserve`
leaves room in the line (trailing spaces, which JSON readers skip) and `complete` writes
the whole record over it, in place: one line per attempt, and overwriting blocks a file
already holds needs no free space. Until completed, the line says what the attempt
decided, its Node pushes "interrupted": what the log keeps if the Edge stops meanwhile.

The config write keeps the file whole at every instant: the new text goes to a temp
file in the same directory, is fsynced, and replaces the old one with `os.replace` (an
atomic rename). The previous text is kept beside it as `<file>.prev`, written the same
way, so a bad refresh can be undone by hand.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Final

import msgspec
import trio

from iop_edge.core.configuration.config import utf8_pieces
from iop_edge.runtime.refresh.json_pieces import encode_in_pieces
from schemas.refresh import (
    NodeResult,
    RefreshError,
    RefreshMode,
    RefreshOutcome,
    RefreshReport,
    RefreshVerdict,
)

__all__ = [
    "AUDIT_FILE_NAME",
    "AuditLog",
    "AuditRecord",
    "Reservation",
    "append_line",
    "reserve_room",
    "write_config_atomically",
]

AUDIT_FILE_NAME = "refresh-audit.jsonl"
_NEW_FILE_MODE = 0o644
#: A Node's push result detail is kept to this many characters in the audit log (the
#: report the operator gets has all of it), so a reserved line has a known bound.
DETAIL_CHARS: Final = 256
#: Room a reserved line leaves for what completing it adds: its errors...
_ROOM_BASE: Final = 1024
#: ... and each Node push result.
_ROOM_PER_NODE: Final = 2 * DETAIL_CHARS


def reserve_room(nodes: int) -> int:
    """Bytes a reserved line leaves for `nodes` push results and the errors of a commit."""
    return _ROOM_BASE + _ROOM_PER_NODE * nodes


@dataclass(frozen=True, slots=True)
class Reservation:
    """A line written ahead by `AuditLog.reserve`, to be completed in place."""

    offset: int
    length: int
    """The line's length, its newline included."""


class AuditRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One line of the audit log: one refresh attempt, whatever its outcome.

    Paths only, never values: a changed token hash is recorded as a changed path. Not
    tracked by the cycle collector (`gc=False`), as the refresh records it holds.
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
            nodes=[_bounded(node) for node in report.nodes],
            errors=list(report.errors),
        )


def _bounded(node: NodeResult) -> NodeResult:
    if node.detail is None or len(node.detail) <= DETAIL_CHARS:
        return node
    return msgspec.structs.replace(node, detail=node.detail[: DETAIL_CHARS - 1] + "…")


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

    async def reserve(
        self,
        report: RefreshReport,
        *,
        verdict: RefreshVerdict,
        config_sha256: str | None,
        room: int,
        now: datetime | None = None,
    ) -> Reservation:
        """Write the attempt's line ahead, with `room` bytes to spare (module docstring);
        raises `OSError` if it cannot be written: the attempt must then not go ahead."""
        when = now or datetime.now(UTC)
        await trio.lowlevel.checkpoint()  # the report was built in this step: a fleet's
        # report and its line are milliseconds each, so each gets steps of its own
        record = AuditRecord.of(report, verdict=verdict, config_sha256=config_sha256, now=when)
        line = await _line(self._encoder, record, room=room)
        async with self._lock:
            offset = await trio.to_thread.run_sync(append_line, self.path, line)
        return Reservation(offset=offset, length=len(line))

    async def complete(
        self,
        reservation: Reservation,
        report: RefreshReport,
        *,
        verdict: RefreshVerdict,
        config_sha256: str | None,
        now: datetime | None = None,
    ) -> AuditRecord:
        """Write the attempt's whole record over its reserved line; a record that does not
        fit (cannot happen within `reserve_room`'s bounds) is appended after it instead.
        Raises `OSError` if the log cannot be written."""
        when = now or datetime.now(UTC)
        await trio.lowlevel.checkpoint()  # as in `reserve`
        record = AuditRecord.of(report, verdict=verdict, config_sha256=config_sha256, now=when)
        line = await _line(self._encoder, record, width=reservation.length)
        async with self._lock:
            if len(line) == reservation.length:
                await trio.to_thread.run_sync(
                    _overwrite, self.path, reservation.offset, line, abandon_on_cancel=True
                )
            else:
                await trio.to_thread.run_sync(append_line, self.path, line, abandon_on_cancel=True)
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
        line = await _line(self._encoder, record)
        async with self._lock:
            await trio.to_thread.run_sync(append_line, self.path, line, abandon_on_cancel=True)


#: Spaces a line's room is written from (`_Line`), a block at a time.
_SPACES: Final = b" " * (256 * 1024)
#: The most pieces one write of a line takes (IOV_MAX is 1024 on Linux); a room that
#: would take more is made in memory instead.
_MOST_PIECES: Final = 512


@dataclass(frozen=True, slots=True)
class _Line:
    """One line of the log: its JSON, `padding` spaces (the room), a newline.

    A fleet's room is megabytes: made in memory on the event loop it would be a step of
    milliseconds (fresh pages of memory, each faulted in), so the spaces are written from
    one block (`_SPACES`), as many times as they take, with the JSON in one write."""

    json: bytes | bytearray
    padding: int

    def __len__(self) -> int:
        return len(self.json) + self.padding + 1

    def pieces(self) -> list[bytes | bytearray]:
        whole, rest = divmod(self.padding, len(_SPACES))
        if whole + 3 > _MOST_PIECES:
            return [self.json + b" " * self.padding + b"\n"]
        return [self.json, *([_SPACES] * whole), _SPACES[:rest] + b"\n"]


async def _line(
    encoder: msgspec.json.Encoder, record: AuditRecord, *, room: int = 0, width: int = 0
) -> _Line:
    """`record` as one line: JSON, then `room` spaces, or spaces up to `width` bytes in
    all when it fits, then a newline. A fleet's lists are encoded a piece a step."""
    json = await encode_in_pieces(encoder, record, _LONG_LISTS)
    return _Line(json, max(room, width - 1 - len(json), 0))


#: The lists of a record that grow with the fleet (`encode_in_pieces`).
_LONG_LISTS: Final = ("changed_paths", "nodes")


def append_line(path: Path, line: bytes | bytearray | _Line) -> int:
    """Append `line` (or lines) with one write (another Edge sharing the folder may append
    too) and fsync it; returns the offset it starts at. A write cut short by a full disk
    is taken back and raised as `ENOSPC`: the file never holds a torn line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, _NEW_FILE_MODE)
    try:
        written = os.writev(fd, line.pieces() if isinstance(line, _Line) else [line])
        end = os.lseek(fd, 0, os.SEEK_CUR)  # just past our line, whoever appended before
        if written < len(line):  # a full disk: take the piece back, the line is not there
            if os.fstat(fd).st_size == end:  # unless another Edge appended after it
                os.ftruncate(fd, end - written)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        os.fsync(fd)
    finally:
        os.close(fd)
    return end - len(line)


def _overwrite(path: Path, offset: int, line: _Line) -> None:
    """Write `line` over the bytes at `offset` (a reserved line of the same length)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for piece in line.pieces():
            view = memoryview(piece)
            while view:
                written = os.pwrite(fd, view, offset)
                offset += written
                view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


async def write_config_atomically(path: Path, text: str) -> None:
    """Replace the config file at `path` with `text`, keeping the old one as `.prev`.

    A symlinked config is followed, so the link stays and its target is replaced.
    Raises `OSError` when the directory is not writable; the old file is then intact.
    """
    await trio.to_thread.run_sync(_write_config, Path(path), text, abandon_on_cancel=True)


def _write_config(path: Path, text: str) -> None:
    target = path.resolve()
    try:
        previous = target.read_bytes()
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        previous, mode = None, _NEW_FILE_MODE
    if previous is not None:
        _replace(target.with_name(f"{target.name}.prev"), (previous,), mode)
    # A piece at a time: a fleet's text encoded at once is a copy of megabytes that
    # keeps the GIL, and the event loop waits for it.
    _replace(target, utf8_pieces(text), mode)
    _fsync_directory(target.parent)


def _replace(path: Path, pieces: Iterable[bytes], mode: int) -> None:
    """Write `pieces` to a fsynced temp file beside `path`, then rename it over `path`."""
    fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            for piece in pieces:
                file.write(piece)
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
