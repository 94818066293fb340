"""`python -m bench --fair-share`: the scheduler sharing a saturated model between principals.

In process, no sockets: what is measured is the Edge's scheduler (`runtime.runs`), the
part fair queueing changes.

- *cost*: CPU per admitted request while a capacity-8 model is saturated by 1, 100 and
  10,000 principals (at least 200 requests waiting, one per principal at 10,000), each
  request taking its slot and giving it back at once. It includes Trio's task switches
  (a waiter wakes for each grant), so it is an upper bound on the scheduler's share.
- *fairness*, on virtual time (Trio's `MockClock`), every run holding its slot for one
  run time, as the sim provider's fixed run time would: how long one request of a
  second principal waits behind a flood of 200 from the first on a capacity-2 model,
  in run times; how weights 3:1 split the served runs under steady load; and how slot
  time is shared by work (`work_share`): one principal keeping 2 huge requests
  outstanding against one keeping 24 small ones, at equal weights, each run holding its
  slot for a time proportional to its estimated tokens.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import trio
import trio.testing
from rich.table import Table
from trio.testing import MockClock

from iop_edge.core.routing.run_work import run_work
from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas.config import (
    DispatchSection,
    EdgeConfig,
    ModelEntry,
    NodeEntry,
    PrincipalLimits,
    ProviderConfig,
)

__all__ = [
    "FairShareResult",
    "WorkShare",
    "one_model_pool",
    "render_fair_share",
    "run_fair_share",
    "work_share",
]

PRINCIPAL_COUNTS: Final = (1, 100, 10_000)
_GRANTS: Final = 20_000
_RUN_S: Final = 1.0


def one_model_pool(
    principals: Sequence[PrincipalLimits] = (),
    *,
    capacity: int,
    long_context_slots: int | None = None,
    max_queue: int = 1_000_000,
    queue_timeout_ms: int = 86_400_000,
) -> Scheduler:
    """A scheduler for one model, `m`, served by one connected Node's provider `p` with
    `capacity` slots, ready to grant: the smallest pool a flood saturates. The fair-share
    tests (tests/unit/test_fair_queue.py) build their pool here too, so what this
    benchmark measures is the pool they check. By default nothing is refused for a full
    queue or a long wait: the measures count grants, not refusals."""
    digest = "0" * 64
    provider = ProviderConfig(
        id="p",
        type="sim",
        models=["served"],
        capacity=capacity,
        long_context_slots=long_context_slots,
    )
    config = EdgeConfig(
        dispatch=DispatchSection(max_queue=max_queue, queue_timeout_ms=queue_timeout_ms),
        models=[ModelEntry(id="m", providers={"p": "served"})],
        nodes=[NodeEntry(id="n", token_hash_sha256=digest, providers=[provider])],
        principals=list(principals),
    )
    scheduler = Scheduler(Snapshot.build(config, revision=1, config_sha256=digest))
    scheduler.node_connected("n")
    scheduler.provider_status("p", "available", ["served"])
    return scheduler


async def _cost_us(principals: int) -> float:
    """CPU microseconds per admitted request with `principals` waiting principals."""
    scheduler = one_model_pool(capacity=8)
    admitted = 0

    async def caller(principal: str) -> None:
        nonlocal admitted
        while admitted < _GRANTS:
            lease = await scheduler.acquire("m", "r", long=False, principal=principal)
            admitted += 1
            await trio.lowlevel.checkpoint()
            lease.release()

    started = time.process_time()
    async with trio.open_nursery() as nursery:
        for index in range(max(200, principals)):
            nursery.start_soon(caller, f"p{index % principals}")
    return (time.process_time() - started) / admitted * 1e6


async def _flood_wait_runs() -> float:
    """Run times a second principal's one request waits behind a flood of 200."""
    scheduler = one_model_pool(capacity=2)
    waited: list[float] = []

    async def one(principal: str) -> None:
        asked = trio.current_time()
        with await scheduler.acquire("m", "r", long=False, principal=principal):
            if principal == "person":
                waited.append(trio.current_time() - asked)
            await trio.sleep(_RUN_S)

    async with trio.open_nursery() as nursery:
        for _ in range(200):
            nursery.start_soon(one, "batch")
        await trio.sleep(_RUN_S * 3.5)
        nursery.start_soon(one, "person")
        await trio.sleep(_RUN_S * 3)
        nursery.cancel_scope.cancel()
    return waited[0] / _RUN_S


async def _weighted_split() -> tuple[int, int]:
    """Runs served to principals of weight 3 and 1, both always waiting."""
    weights = [PrincipalLimits(ref="heavy", weight=3), PrincipalLimits(ref="light", weight=1)]
    scheduler = one_model_pool(weights, capacity=2)
    served = {"heavy": 0, "light": 0}

    async def worker(principal: str) -> None:
        while True:
            with await scheduler.acquire("m", "r", long=False, principal=principal):
                served[principal] += 1
                await trio.sleep(_RUN_S)

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(worker, "heavy")
            nursery.start_soon(worker, "light")
        await trio.sleep(_RUN_S * 20)  # both lanes fill
        before = dict(served)
        await trio.sleep(_RUN_S * 200)
        nursery.cancel_scope.cancel()
    return served["heavy"] - before["heavy"], served["light"] - before["light"]


#: The work-share scenario: (requests kept outstanding, input tokens, max_tokens) per
#: principal.
HUGE: Final = (2, 32_000, 4_096)
SMALL: Final = (24, 500, 256)
#: Tokens a slot serves per second of virtual time (a run holds its slot work / this).
_TOKENS_PER_S: Final = 1_000.0
#: The work-share window, in seconds of virtual time: after a start-up, long enough for
#: each huge request to run several times.
_WARM_UP_S: Final = 100.0
_WINDOW_S: Final = 500.0


@dataclass(frozen=True, slots=True)
class WorkShare:
    """Slot time per principal over the window, and the small requests' waits, in
    seconds of virtual time."""

    huge_s: float
    small_s: float
    small_waits: list[float]

    @property
    def ratio(self) -> float:
        """The larger share over the smaller (1.0 is an even split)."""
        low, high = sorted((self.huge_s, self.small_s))
        return high / low if low else float("inf")


async def work_share(capacity: int = 2) -> WorkShare:
    """`HUGE` against `SMALL` at equal weights on one model of `capacity` slots, each
    principal keeping its requests outstanding (a new one as soon as one ends). Every
    run holds its slot for its estimated work (`core.routing.run_work`) at `_TOKENS_PER_S`, so
    slot time follows work. Needs a `MockClock`."""
    scheduler = one_model_pool(capacity=capacity)
    held = {"huge": 0.0, "small": 0.0}
    waits: list[float] = []
    start, end = _WARM_UP_S, _WARM_UP_S + _WINDOW_S

    async def worker(principal: str, prompt: int, max_tokens: int) -> None:
        work = run_work(prompt, max_tokens)
        while True:
            asked = trio.current_time()
            with await scheduler.acquire("m", "r", long=False, principal=principal, work=work):
                began = trio.current_time()
                if principal == "small" and start <= asked < end:
                    waits.append(began - asked)
                try:
                    await trio.sleep(work / _TOKENS_PER_S)
                finally:
                    held[principal] += max(0.0, min(trio.current_time(), end) - max(began, start))

    async with trio.open_nursery() as nursery:
        for principal, (count, prompt, max_tokens) in (("huge", HUGE), ("small", SMALL)):
            for _ in range(count):
                nursery.start_soon(worker, principal, prompt, max_tokens)
            await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(end)
        nursery.cancel_scope.cancel()
    return WorkShare(huge_s=held["huge"], small_s=held["small"], small_waits=waits)


@dataclass(frozen=True, slots=True)
class FairShareResult:
    cost_us: dict[int, float]
    """Principals -> CPU microseconds per admitted request."""
    flood_wait_runs: float
    heavy: int
    light: int
    work: WorkShare


def run_fair_share() -> FairShareResult:
    cost = {count: trio.run(_cost_us, count) for count in PRINCIPAL_COUNTS}
    flood = trio.run(_flood_wait_runs, clock=MockClock(autojump_threshold=0))
    heavy, light = trio.run(_weighted_split, clock=MockClock(autojump_threshold=0))
    work = trio.run(work_share, clock=MockClock(autojump_threshold=0))
    return FairShareResult(cost_us=cost, flood_wait_runs=flood, heavy=heavy, light=light, work=work)


def render_fair_share(result: FairShareResult) -> Table:
    table = Table(title="Fair sharing of a saturated model (in process)", title_justify="left")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    for count, micros in result.cost_us.items():
        table.add_row(f"CPU per admitted request, {count:,} principal(s)", f"{micros:.0f} µs", "")
    table.add_row(
        "one request behind a flood of 200 (capacity 2)",
        f"{result.flood_wait_runs:.2f} run times",
        "≤ about 1",
    )
    ratio = result.heavy / result.light if result.light else float("inf")
    table.add_row(
        "weights 3:1 under steady load",
        f"{result.heavy}:{result.light} = {ratio:.2f}",
        "3 ± 10 %",
    )
    work = result.work
    table.add_row(
        f"slot time, {HUGE[0]} huge vs {SMALL[0]} small requests (capacity 2, weights 1:1)",
        f"{work.huge_s:.1f} s : {work.small_s:.1f} s = {work.ratio:.2f}",
        "≤ 1.5",
    )
    table.add_row(
        "the small requests' wait, median / max",
        f"{statistics.median(work.small_waits):.1f} s / {max(work.small_waits):.1f} s",
        "",
    )
    return table
