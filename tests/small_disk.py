"""A real small disk for the full-disk tests: a tmpfs of a few MiB in a temporary folder.

Filling it (`fill`) writes a ballast file until the kernel says `ENOSPC`, so what the
Edge meets is a real full disk: short writes, failed creates, SQLite's "database or disk
is full". `free` removes the ballast.

Mounting needs root (CI runs as root). Without it the tests that need a small disk are
skipped, saying why; under CI (`CI=true`) they fail instead, so CI never passes without
running them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.ballast import fill_disk

__all__ = ["SmallDisk", "small_disk"]


class SmallDisk:
    """A mounted tmpfs: `path` is its root."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._ballast = path / "ballast"

    def fill(self) -> None:
        """Write the ballast until the disk is full (`bench.ballast`)."""
        fill_disk(self._ballast)

    def free(self) -> None:
        """Give the ballast's space back."""
        self._ballast.unlink(missing_ok=True)

    def free_bytes(self) -> int:
        stats = os.statvfs(self.path)
        return stats.f_bavail * stats.f_frsize


def _cannot_mount(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must run the full-disk tests, but {reason}")
    pytest.skip(f"full-disk tests skipped: {reason}")


@contextmanager
def small_disk(root: Path, size: str = "4m") -> Iterator[SmallDisk]:
    """Mount a tmpfs of `size` at `root/disk` for the duration (module docstring)."""
    mount_point = root / "disk"
    mount_point.mkdir()
    if os.geteuid() != 0:
        _cannot_mount(
            "mounting a tmpfs needs root: run the suite as root (a container or CI is fine), "
            "e.g. sudo .venv/bin/just test"
        )
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        _cannot_mount(
            f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode} (in a container, "
            "mounting needs CAP_SYS_ADMIN: docker run --privileged, or run the suite in CI)"
        )
    try:
        yield SmallDisk(mount_point)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False, capture_output=True)
