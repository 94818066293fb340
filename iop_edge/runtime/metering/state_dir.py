"""Whether `edge.state_dir` can take the Edge's writes, checked before anything is served.

The usage journal, the SQLite ledger and the refresh audit log are written there. An Edge
started on a full disk used to die on its first SQLite statement with a traceback, and
`check-config` said OK to the same config; both now name the problem and the fix.

Rules:
1. `serve` (`ensure_writable`) creates the folder when missing, then writes, fsyncs and
   removes a probe file of `PROBE_BYTES`: a path that is not a folder, a folder it may
   not write, or a disk (or quota) without that much room fails, named.
2. `check-config` (`inspect`) changes nothing: the disk the folder is on (or would be
   created on) must have at least `PROBE_BYTES` free. (Whether it is a folder the Edge
   may write is a rule of the config itself, `runtime.lifecycle.host_checks`.)
3. Both are blocking file I/O: run them in a worker thread, or before the event loop.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path
from typing import Final

__all__ = ["PROBE_BYTES", "StateDirUnusable", "ensure_writable", "inspect"]

#: Room the Edge wants in `state_dir` before it serves: a few thousand usage records and
#: the SQLite ledger's next pages.
PROBE_BYTES: Final = 1024 * 1024
_FULL_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT})


class StateDirUnusable(Exception):
    """`edge.state_dir` cannot take the Edge's writes; the message (which begins with the
    folder) says why and what to do."""


def ensure_writable(state_dir: Path) -> None:
    """Rule 1; raises `StateDirUnusable`."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _unusable(state_dir, exc) from None
    if not state_dir.is_dir():
        raise StateDirUnusable(f"{state_dir} is not a folder")
    probe = state_dir / f".iop-space-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            block = bytes(64 * 1024)
            for _ in range(PROBE_BYTES // len(block)):
                view = memoryview(block)
                while view:
                    view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _unusable(state_dir, exc) from None
    finally:
        probe.unlink(missing_ok=True)


def inspect(state_dir: Path) -> None:
    """Rule 2; raises `StateDirUnusable`."""
    existing = state_dir.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        stats = os.statvfs(existing)
    except OSError as exc:
        raise _unusable(state_dir, exc) from None
    if stats.f_blocks == 0:  # proc, sysfs: no disk behind it, not a full one
        raise StateDirUnusable(
            f"{state_dir} cannot be written: {existing} is on a filesystem that stores no "
            "files (like /proc or /sys). Set edge.state_dir to a folder on a disk"
        )
    free = stats.f_bavail * stats.f_frsize
    if free < PROBE_BYTES:
        raise _unusable(state_dir, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), free=free)


def _unusable(state_dir: Path, exc: OSError, *, free: int | None = None) -> StateDirUnusable:
    reason = exc.strerror or str(exc)
    if exc.errno in _FULL_ERRNOS:
        if free is None:
            try:
                stats = os.statvfs(state_dir)
                free = stats.f_bavail * stats.f_frsize
            except OSError:
                free = None
        room = "" if free is None else f", {_size(free)} free"
        return StateDirUnusable(
            f"{state_dir}: the disk is full ({reason}{room}; the Edge wants "
            f"at least {_size(PROBE_BYTES)}): the usage ledger and the refresh audit log are "
            "written there. Free space on that disk, or set edge.state_dir to a folder on "
            "another one"
        )
    return StateDirUnusable(
        f"{state_dir} cannot be written ({reason}): the usage ledger and the "
        "refresh audit log are written there. Fix its permissions, or set edge.state_dir "
        "to a folder the Edge may write"
    )


def _size(count: int) -> str:
    if count >= 1024 * 1024:
        return f"{count / (1024 * 1024):.1f} MiB"
    return f"{count / 1024:.0f} KiB"
