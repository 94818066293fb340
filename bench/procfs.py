"""What the kernel counts for a process: its CPU time and its resident memory.

Every cost the bench reports comes from the measured processes' own counters in Linux's
`/proc`, read before and after a window, never from sampling them: the counters cost the
processes nothing and include every thread (the Rust router's runtime threads, the
Edge's worker threads). On another OS there is no `/proc`, and these return None.

CPU time is counted in clock ticks (10 ms), which is why a measured window should last
a few seconds; resident memory (`VmRSS`) is exact at the moment it is read. The
scheduler's run delay (`schedstat`, nanoseconds) is the time a process's threads were
ready to run but waited for a core: on a machine shared with other work it tells a
target starved of CPU from one that is slow by itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

import trio

_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


async def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds `pid` used so far; None when it is gone or there is no /proc."""
    try:
        stat = await trio.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    fields = stat.rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


async def cpu_by_process(processes: Mapping[str, int]) -> dict[str, float] | None:
    """CPU seconds so far of each named process; None when any of them cannot be read."""
    if not processes:
        return None
    seconds: dict[str, float] = {}
    for name, pid in processes.items():
        value = await process_cpu_seconds(pid)
        if value is None:
            return None
        seconds[name] = value
    return seconds


async def cpu_seconds(pids: tuple[int, ...]) -> float | None:
    """User + system CPU seconds the processes used so far, together."""
    by_process = await cpu_by_process({str(pid): pid for pid in pids})
    return None if by_process is None else sum(by_process.values())


async def run_delay_seconds(pid: int) -> float | None:
    """Seconds `pid`'s threads have spent runnable but waiting for a core, so far."""
    try:
        tasks = list(await trio.Path(f"/proc/{pid}/task").iterdir())
        total_ns = 0
        for task in tasks:
            try:
                fields = (await (task / "schedstat").read_text()).split()
            except FileNotFoundError:
                continue  # a thread that ended meanwhile
            total_ns += int(fields[1])
    except OSError:
        return None
    return total_ns / 1e9


async def run_delay_by_process(processes: Mapping[str, int]) -> dict[str, float] | None:
    """Run delay so far of each named process; None when any of them cannot be read."""
    if not processes:
        return None
    delays: dict[str, float] = {}
    for name, pid in processes.items():
        value = await run_delay_seconds(pid)
        if value is None:
            return None
        delays[name] = value
    return delays


async def rss_bytes(pid: int) -> int | None:
    """Resident memory of `pid` right now (`VmRSS`); None when it cannot be read."""
    try:
        status = await trio.Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # reported in kB
    return None


async def rss_by_process(processes: Mapping[str, int]) -> dict[str, int] | None:
    """Resident bytes of each named process; None when any of them cannot be read."""
    if not processes:
        return None
    resident: dict[str, int] = {}
    for name, pid in processes.items():
        value = await rss_bytes(pid)
        if value is None:
            return None
        resident[name] = value
    return resident


def cpu_delta(
    before: Mapping[str, float] | None, after: Mapping[str, float] | None
) -> dict[str, float] | None:
    """Seconds each process added between two readings of a counter (CPU time, run delay);
    None when either reading is missing."""
    if before is None or after is None:
        return None
    return {name: after[name] - before[name] for name in before if name in after}
