"""The Edge, with a recorder of how long its event loop is held: `python -m bench.loop_holds
serve ...` runs `iop-edge serve ...` as it is, plus a Trio instrument that times every
task step on the loop's thread and a callback that times every collection of CPython's
cyclic collector.

A caller's request waits at most one step of the loop between two of its own, so the
longest step bounds how long anything the Edge does (a refresh, a sweep, a thaw) can hold
a caller; a collection runs inside whichever step allocated last, so it is timed on its
own too, with its generation (2: a full collection, the heap keeper's thaw among them).

Each step of `RECORDED_S` or more, and each collection of `RECORDED_S` or more or of the
oldest generation, is appended as a JSON line to the file `IOP_BENCH_LOOP_HOLDS` names,
with when it ended on the system's monotonic clock (the bench shares it, so it can tell
the phases apart): `{"at", "step_s", "cpu_s", "task"}` for a step (wall and CPU time of
the loop's thread), `{"at", "gc", "s", "cpu_s", "loop"}` for a collection (`loop`: on
the loop's thread). Shorter ones are not written: a write per step would cost more than the steps.
`read_holds` reads the file back as a summary of a window.
"""

from __future__ import annotations

import gc
import json
import math
import os
import runpy
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Final, TextIO

import trio

#: The environment variable naming the file the recorder appends to.
ENV: Final = "IOP_BENCH_LOOP_HOLDS"
#: Steps and collections at least this long are recorded one by one.
RECORDED_S: Final = 0.01
#: The loop's busy share is written once per window this long (at the first step after).
WINDOW_S: Final = 0.5


class _Holds(trio.abc.Instrument):
    """Times each task step on the loop's thread; writes the long ones."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._began = time.perf_counter()
        self._cpu = time.thread_time()
        self._window_began = self._began
        self._window_cpu = self._cpu
        self._busy = 0.0
        self._steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._began = time.perf_counter()
        self._cpu = time.thread_time()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        now = time.perf_counter()
        took = now - self._began
        self._busy += took
        self._steps += 1
        if took >= RECORDED_S:
            cpu = time.thread_time() - self._cpu
            _write(
                self._out, {"at": time.monotonic(), "step_s": took, "cpu_s": cpu, "task": task.name}
            )
        if now - self._window_began >= WINDOW_S:
            thread_cpu = time.thread_time()
            record = {
                "at": time.monotonic(),
                "window_s": now - self._window_began,
                "busy_s": self._busy,
                "cpu_s": thread_cpu - self._window_cpu,
                "steps": self._steps,
            }
            _write(self._out, record)
            self._window_began, self._window_cpu = now, thread_cpu
            self._busy, self._steps = 0.0, 0


def _write(out: TextIO, record: dict[str, Any]) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


class _Collections:
    """Times each collection of the cyclic collector (`gc.callbacks`)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._began = 0.0
        self._cpu = 0.0
        self._thread = threading.get_ident()

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            self._cpu = time.thread_time()
            return
        took = time.perf_counter() - self._began
        cpu = time.thread_time() - self._cpu
        generation = info["generation"]
        if took >= RECORDED_S or generation == 2:
            loop = threading.get_ident() == self._thread
            record = {"at": time.monotonic(), "gc": generation, "s": took, "cpu_s": cpu}
            _write(self._out, {**record, "loop": loop})


#: A hold callers would feel: the guard's bound.
HOLD_BOUND_S: Final = 0.05


@dataclass(frozen=True, slots=True)
class LoopHolds:
    """The loop's long steps and the collector's collections in one window."""

    longest_s: float
    """The longest step, wall time (a busy machine's preemption included)."""
    longest_cpu_s: float
    """The most CPU time one step took on the loop's thread."""
    over_bound: int
    """Steps that held the loop `HOLD_BOUND_S` or more, wall time."""
    over_bound_cpu: int
    """... CPU time."""
    full_collections: int
    """Collections of the oldest generation (a thaw is one)."""
    longest_collection_s: float
    """The longest collection of any generation on the loop's thread, wall time."""
    longest_collection_cpu_s: float = 0.0
    """... CPU time."""
    longest_task: str = ""
    busy_share: float | None = None
    """The share of the window's wall time the loop spent in task steps (None: no
    window recorded)."""
    cpu_share: float | None = None
    """... the loop's thread spent on a CPU (its steps, its waits' system calls, the
    collector)."""

    def __str__(self) -> str:
        return (
            f"longest step {self.longest_s * 1000:.0f} ms ({self.longest_cpu_s * 1000:.0f} ms "
            f"CPU{', ' + self.longest_task if self.longest_task else ''}), "
            f"{self.over_bound} step(s) >= {HOLD_BOUND_S * 1000:.0f} ms "
            f"({self.over_bound_cpu} by CPU), {self.full_collections} full collection(s), "
            f"longest collection {self.longest_collection_s * 1000:.0f} ms "
            f"({self.longest_collection_cpu_s * 1000:.0f} ms CPU)"
            + (
                ""
                if self.busy_share is None or self.cpu_share is None
                else f", loop busy {self.busy_share:.0%} ({self.cpu_share:.0%} CPU)"
            )
        )


def read_holds(path: str, start: float = -math.inf, end: float = math.inf) -> LoopHolds:
    """What the file at `path` recorded between `start` and `end` (monotonic clock)."""
    steps: list[dict[str, Any]] = []
    collections: list[dict[str, Any]] = []
    windows: list[dict[str, Any]] = []
    try:
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                record = json.loads(line)
                if not start <= record["at"] <= end:
                    continue
                if "window_s" in record:
                    windows.append(record)
                else:
                    (steps if "step_s" in record else collections).append(record)
    except FileNotFoundError:
        pass
    longest = max(steps, key=lambda step: step["step_s"], default=None)
    return LoopHolds(
        longest_s=0.0 if longest is None else longest["step_s"],
        longest_cpu_s=max((step["cpu_s"] for step in steps), default=0.0),
        over_bound=sum(step["step_s"] >= HOLD_BOUND_S for step in steps),
        over_bound_cpu=sum(step["cpu_s"] >= HOLD_BOUND_S for step in steps),
        full_collections=sum(record["gc"] == 2 for record in collections),
        longest_collection_s=max(
            (record["s"] for record in collections if record.get("loop", True)), default=0.0
        ),
        longest_task="" if longest is None else longest["task"],
        longest_collection_cpu_s=max(
            (record.get("cpu_s", 0.0) for record in collections if record.get("loop", True)),
            default=0.0,
        ),
        busy_share=_share(windows, "busy_s"),
        cpu_share=_share(windows, "cpu_s"),
    )


def _share(windows: list[dict[str, Any]], key: str) -> float | None:
    """`key`'s time over the windows' wall time."""
    wall = sum(window["window_s"] for window in windows)
    return sum(window[key] for window in windows) / wall if wall > 0 else None


def main() -> None:
    out = open(os.environ[ENV], "a", encoding="utf-8")  # noqa: SIM115 (the process's life)
    gc.callbacks.append(_Collections(out))
    run = trio.run
    holds = _Holds(out)

    def instrumented(*args: Any, **kwargs: Any) -> Any:
        kwargs["instruments"] = [*kwargs.get("instruments", ()), holds]
        return run(*args, **kwargs)

    trio.run = instrumented  # type: ignore[assignment]
    sys.argv = ["iop-edge", *sys.argv[1:]]
    runpy.run_module("iop_edge", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
