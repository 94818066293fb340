"""The usage ledger's journal: a record is in the kernel's hands before the caller's last byte.

SQLite commits are batched off the request path, so a process killed between a run's
end and the next commit would lose that batch (3 of 628 completed responses in a
SIGKILL test, before this journal). So every record is first appended to a journal
file with one `write()` from the event loop (microseconds, no fsync): once `write()`
returns, the bytes are in the page cache and survive the process being killed. The
ledger's writer then reads the journal, as its queue, into SQLite.

Rules:
1. `append` is one `write()` of one line to a segment opened `O_APPEND`: a record is
   durable against a crash of the process as soon as `append` returns.
2. A line is in the ledger's store exactly when its segment's checkpoint (kept in the
   store, `LedgerStore.checkpoints`) is past it; both change in one transaction, so
   whatever is killed when, a record is inserted once: replay starts at the checkpoint.
3. Each process writes its own segments (`usage-journal-<pid>-<random>.jsonl`) and holds
   an exclusive `flock` on each while it lives; the kernel drops the lock when the
   process dies, however it dies. At start-up, every segment that nobody holds is
   replayed from its checkpoint and deleted.
4. A segment is retired at `ROTATE_BYTES` (a new one takes the appends) and deleted once
   it is checkpointed to its end and the database is synced.
5. The live segment is fsynced at most every `SYNC_INTERVAL_S` by the writer: a power
   failure loses at most the records of that interval (docs/operations.md#reliability).
6. A line that cannot be read back (torn by a power failure, or from a newer Edge) is
   logged and skipped, never retried forever; a line without its newline is not read
   until it has one.
7. An append that fails (a full disk) leaves the segment as it was: a short write's
   bytes are truncated away, so the next append does not glue a good line to a torn one.
   Should that truncation fail too, the segment is marked torn and the next append
   begins with `TORN_END`, which ends the fragment as a line of its own that no decoder
   reads (NUL is not JSON), and the good line stays whole. An append that fails raises
   `OSError` and may simply be retried (`usage.UsageLedger` does, from memory).
8. Rotation never fails an append: a new segment that cannot be created (a full disk)
   leaves the appends on the live one, and is tried again at the next append.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "ROTATE_BYTES",
    "SYNC_INTERVAL_S",
    "Segment",
    "UsageJournal",
    "read_lines",
]

log = logging.getLogger(__name__)

ROTATE_BYTES: Final = 8 * 1024 * 1024
SYNC_INTERVAL_S: Final = 1.0
#: How much of a segment the writer reads into one SQLite transaction.
READ_BYTES: Final = 1024 * 1024
PREFIX: Final = "usage-journal-"
#: Ends a fragment a failed append could not remove (Rule 7).
TORN_END: Final = b"\0\n"


@dataclass(eq=False)
class Segment:
    """One journal file: its lock-holding descriptor and how far it is written and read."""

    path: Path
    fd: int
    written: int = 0
    """Bytes appended (by this process; a replayed segment: its size)."""
    checkpoint: int = 0
    """Bytes already in SQLite (Rule 2)."""
    retired: bool = False
    torn: bool = False
    """A failed append left a fragment at the end (Rule 7)."""

    @property
    def name(self) -> str:
        return self.path.name


class UsageJournal:
    """The segments of one process (see the module docstring). Not thread-safe: `append`
    runs on the event loop; the writer reads segments by path in a worker thread."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.segments: list[Segment] = []
        """This process's segments, oldest first; the last one takes the appends."""
        self.closed = False

    # --- the event loop's side ----------------------------------------------------------

    def open(self) -> None:
        """Start this process's first segment (after the dead ones were replayed)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.segments.append(self._new_segment())

    def append(self, lines: bytes) -> None:
        """Append whole lines (Rule 1): all of them, or none (Rule 7). Raises `OSError`
        (disk full...) and `ValueError` once closed."""
        if self.closed or not self.segments:
            raise ValueError("the journal is closed")
        segment = self._live_segment()
        data = TORN_END + lines if segment.torn else lines
        view = memoryview(data)
        done = 0
        try:
            while done < len(data):  # a regular file takes it all at once, or fails
                done += os.write(segment.fd, view[done:])
        except OSError:
            if done:
                self._undo(segment)
            raise
        segment.written += len(data)
        segment.torn = False

    def _live_segment(self) -> Segment:
        """The segment that takes appends, rotated first when it is full (Rules 4, 8)."""
        segment = self.segments[-1]
        if segment.written < ROTATE_BYTES:
            return segment
        try:
            fresh = self._new_segment()
        except OSError:
            return segment  # Rule 8: the next append tries again
        segment.retired = True
        self.segments.append(fresh)
        return fresh

    @staticmethod
    def _undo(segment: Segment) -> None:
        """Remove what a failed append wrote (Rule 7)."""
        try:
            os.ftruncate(segment.fd, segment.written)
        except OSError as exc:
            segment.torn = True
            segment.written = os.fstat(segment.fd).st_size
            log.error(
                "usage journal %s: a torn line could not be removed (%s); it is ended and "
                "will be skipped",
                segment.name,
                exc.strerror or exc,
            )

    def close(self) -> None:
        """No more appends; the writer finishes reading and deletes what it read."""
        self.closed = True

    def release(self) -> None:
        """Closed for good, the segments left on disk unlocked: the next start-up of an
        Edge on this `state_dir` replays them (as after a crash)."""
        self.closed = True
        for segment in self.segments:
            os.close(segment.fd)
        self.segments = []

    def _new_segment(self) -> Segment:
        path = self.directory / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # Rule 3: ours while we live
        return Segment(path=path, fd=fd)

    # --- the writer's side (worker thread) ----------------------------------------------

    def claim_orphans(self) -> list[Segment]:
        """Segments of dead processes (nobody holds their lock), now locked by us."""
        orphans = []
        for path in sorted(self.directory.glob(f"{PREFIX}*.jsonl")):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # finished by its owner meanwhile
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    continue  # a live Edge writes it
                raise
            orphans.append(Segment(path=path, fd=fd, written=os.fstat(fd).st_size, retired=True))
        return orphans

    def sync(self) -> None:
        """fsync the live segment (Rule 5)."""
        if self.segments:
            os.fsync(self.segments[-1].fd)

    @staticmethod
    def delete(segment: Segment) -> None:
        """Remove a fully read segment; its lock goes with its descriptor."""
        segment.path.unlink(missing_ok=True)
        os.close(segment.fd)


def read_lines(segment: Segment) -> tuple[list[bytes], int]:
    """The complete lines after the segment's checkpoint (at most about `READ_BYTES`),
    and the offset just past them (Rule 6: a partial last line waits for its newline)."""
    with open(segment.path, "rb") as file:
        file.seek(segment.checkpoint)
        data = file.read(READ_BYTES)
    end = data.rfind(b"\n") + 1
    if end == 0:
        if len(data) == READ_BYTES:  # one line longer than a whole read: not ours
            log.error("usage journal %s: an oversized line skipped", segment.name)
            return [], segment.checkpoint + len(data)
        return [], segment.checkpoint
    return data[:end].split(b"\n")[:-1], segment.checkpoint + end
