"""A ballast file that fills a disk for real: written until the kernel says `ENOSPC`.

The soak's full-disk window (`bench.soak`) and the full-disk tests (tests/small_disk.py)
fill a small tmpfs this way, so what the Edge meets is a real full disk (short writes,
failed creates, SQLite's "database or disk is full"), not an error made up for it.
Removing the file gives the space back. `state_disk` mounts the soak's small disk.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

__all__ = ["fill_disk", "state_disk"]

_WRITE_SIZES: Final = (1 << 20, 1 << 16, 1 << 12, 1 << 9, 1)
"""Large writes fill the disk quickly; the smaller ones then take what is left of it."""


def fill_disk(ballast: Path) -> None:
    """Append to `ballast` until its disk is full: every free block taken, down to the
    last byte (slack in the last block of a file already written stays, as on any disk).
    Any error other than `ENOSPC` is raised."""
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for size in _WRITE_SIZES:
            block = bytes(size)
            while True:
                try:
                    os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)


@contextmanager
def state_disk(folder: Path, wanted_s: float, size: str) -> Iterator[float]:
    """Mount a tmpfs of `size` at `folder/disk` for the state when a full-disk window is
    wanted and this process may mount; yields the window's length (0: none)."""
    if not wanted_s:
        yield 0.0
        return
    disk = folder / "disk"
    disk.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(disk)],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    if not mounted:
        print("soak: no full-disk window (mounting a tmpfs for state_dir needs root)")
        yield 0.0
        return
    try:
        yield wanted_s
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, check=False)
