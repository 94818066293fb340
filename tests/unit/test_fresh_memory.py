"""Memory a large buffer will take is written first, where the GIL is released
(`runtime.lifecycle.fresh_memory`), by the worker that runs the work (`off_loop.run_sync`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from iop_edge.runtime.lifecycle import fresh_memory
from iop_edge.runtime.refresh import off_loop

REPO_ROOT = Path(__file__).resolve().parents[2]


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


#: Run in a process of its own: the allocator's thresholds are the whole process's, and
#: what is resident depends on everything the process did before.
_RESIDENT = """
import json, os, sys
from iop_edge.runtime.lifecycle import fresh_memory

def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = resident()
if sys.argv[1] == "touch":
    fresh_memory.touch(48 << 20)
elif sys.argv[1] == "small":
    fresh_memory.touch(fresh_memory.LEAST_BYTES - 1)
touched = resident()
buffer = b"x" * (24 << 20)  # one C call making a buffer of megabytes
made = resident()
print(json.dumps({"touch_stays": touched - before, "buffer_adds": made - touched}))
"""


def _resident_growth(mode: str) -> dict[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", _RESIDENT, mode],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    growth: dict[str, int] = json.loads(result.stdout)
    return growth


@pytest.mark.skipif(
    not (_glibc() and Path("/proc/self/statm").exists()),
    reason="measures glibc's allocator through /proc/self/statm: needs Linux with glibc "
    "(not musl, e.g. Alpine; not macOS)",
)
def test_touched_memory_stays_resident_and_the_next_buffer_is_made_in_it() -> None:
    touched = _resident_growth("touch")
    assert touched["touch_stays"] >= 40 << 20  # written, freed, and kept by the allocator
    assert touched["buffer_adds"] < 8 << 20  # the buffer took those pages: no fresh ones

    for mode in ("none", "small"):  # glibc's defaults stay: nothing kept, nothing written
        untouched = _resident_growth(mode)
        assert untouched["touch_stays"] < 2 << 20, mode
        assert untouched["buffer_adds"] >= 20 << 20, mode  # every page of it was fresh


def test_nothing_is_touched_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fresh_memory, "_allocator", lambda: None)
    fresh_memory.touch(1 << 30)  # would write a gigabyte: returns at once instead


async def test_the_worker_that_runs_the_work_touches_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[tuple[str, int, int]] = []

    def touch(nbytes: int) -> None:
        events.append(("touch", nbytes, threading.get_ident()))

    def work() -> str:
        events.append(("work", 0, threading.get_ident()))
        return "done"

    monkeypatch.setattr(fresh_memory, "touch", touch)
    assert await off_loop.run_sync(work, fresh_bytes=12 << 20) == "done"

    (touched, size, toucher), (worked, _, worker) = events
    assert (touched, size, worked) == ("touch", 12 << 20, "work")
    assert toucher == worker != threading.get_ident()  # glibc's arenas are per thread
