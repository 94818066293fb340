"""`python -m bench --parts models`: placement against load-only routing, many models.

In process, on virtual time (Trio's `MockClock`): what is measured is the Edge's routing,
the real code of it (the `Scheduler`, the pool's Rule 8 and `core.routing.holdings`). Each
provider is a runtime that holds at most `holds` of the models at once and loads the
others on demand, as llama.cpp's router does with `--models-max`: a run for a model it
does not hold waits `load_s` for the load, which unloads the least recently used model
with nothing running (and waits for one to be idle when every held one is busy). Its
Node reports what it holds every `report_s` (a probe), not at every change: between
reports the Edge goes by its own account.

Each scenario runs twice in one run: with placement (the runtimes report their models'
states, as the Node reads them from the runtime) and load-only (they report none: load
ratio, priority and round-robin, as for a runtime whose states are unknown). Requests
arrive at random (exponential gaps, seeded: both routings see the same schedule), each
for a model drawn from a Zipf popularity (or strictly alternating), and hold their slot
for an exponential service time.

- *alternating*: two models over two providers that hold one each, the requests
  alternating between the models: placement loads each model once.
- *zipf*: ten models over four providers that hold two each, Zipf popularity (s = 1.1).

Measured: loads per 1,000 requests (and in all), and the wait before a run starts
(queued at the Edge plus waiting for its model's load) at p50 and p99.
"""

from __future__ import annotations

import random
import statistics
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Final

import trio
from rich.console import Group
from rich.table import Table
from trio.testing import MockClock

from iop_edge.core.snapshot import Snapshot
from iop_edge.runtime.runs.scheduler import Scheduler
from schemas.config import (
    AdapterSettings,
    DispatchSection,
    EdgeConfig,
    ModelEntry,
    NodeEntry,
    ProviderConfig,
)
from schemas.wire import ModelState

__all__ = ["SCENARIOS", "Mix", "ModelsResult", "render_models", "run_models", "targets"]

_HASH: Final = "0" * 64
#: The loads placement may cause, against load-only routing's, on the Zipf mix.
TARGET_ZIPF_RATIO: Final = 1 / 3


@dataclass(frozen=True)
class Mix:
    """One scenario: the pool, the models and the requests."""

    name: str
    models: int
    providers: int
    holds: int
    capacity: int = 4
    requests: int = 2_000
    arrival_s: float = 0.5
    """Mean gap between requests."""
    service_s: float = 2.0
    """Mean time a run holds its slot."""
    load_s: float = 10.0
    report_s: float = 5.0
    zipf: float | None = 1.1
    """Popularity exponent; None: the requests alternate between the models."""
    seed: int = 7


SCENARIOS: Final = (
    Mix("alternating", models=2, providers=2, holds=1, requests=400, zipf=None),
    Mix("zipf", models=10, providers=4, holds=2),
)


@dataclass(frozen=True)
class Outcome:
    loads: int
    requests: int
    wait_p50_s: float
    wait_p99_s: float

    @property
    def loads_per_1000(self) -> float:
        return 1000 * self.loads / self.requests


@dataclass(frozen=True)
class Comparison:
    mix: Mix
    load_only: Outcome
    placement: Outcome


@dataclass(frozen=True)
class ModelsResult:
    comparisons: tuple[Comparison, ...]


class _Runtime:
    """A runtime that holds `holds` models and loads others on demand (module doc)."""

    def __init__(self, holds: int, load_s: float) -> None:
        self.holds = holds
        self.load_s = load_s
        self.held: OrderedDict[str, None] = OrderedDict()
        self.running: dict[str, int] = {}
        self.loading: str | None = None
        self.loads = 0
        self._turn = trio.Lock()
        self._idle = trio.Event()

    async def serve(self, model: str, service_s: float, started: trio.Event) -> None:
        """Serve one run: load its model first if need be; `started` once it runs."""
        async with self._turn:
            if model not in self.held:
                while len(self.held) >= self.holds:
                    victim = next((m for m in self.held if not self.running.get(m)), None)
                    if victim is None:
                        await self._idle.wait()
                        continue
                    del self.held[victim]
                self.loading = model
                await trio.sleep(self.load_s)
                self.loading = None
                self.held[model] = None
                self.loads += 1
            self.held.move_to_end(model)
            self.running[model] = self.running.get(model, 0) + 1
        started.set()
        try:
            await trio.sleep(service_s)
        finally:
            self.running[model] -= 1
            self._idle.set()
            self._idle = trio.Event()

    def states(self, models: Sequence[str]) -> list[ModelState]:
        return [
            ModelState(
                name=m,
                state="loaded"
                if m in self.held
                else "loading"
                if m == self.loading
                else "unloaded",
            )
            for m in models
        ]


def _snapshot(mix: Mix, providers: Sequence[str], models: Sequence[str]) -> Snapshot:
    settings = AdapterSettings(load_timeout_s=mix.load_s * 3)
    config = EdgeConfig(
        dispatch=DispatchSection(max_queue=100_000, queue_timeout_ms=86_400_000),
        models=[ModelEntry(id=m, providers=dict.fromkeys(providers, m)) for m in models],
        nodes=[
            NodeEntry(
                id=f"node-{pid}",
                token_hash_sha256=_HASH,
                providers=[
                    ProviderConfig(
                        id=pid,
                        type="sim",
                        models=list(models),
                        capacity=mix.capacity,
                        adapter=settings,
                    )
                ],
            )
            for pid in providers
        ],
    )
    return Snapshot.build(config, revision=1, config_sha256=_HASH)


async def _run(mix: Mix, *, placement: bool) -> Outcome:
    models = [f"m{n}" for n in range(mix.models)]
    ids = [f"gpu-{n}" for n in range(mix.providers)]
    scheduler = Scheduler(_snapshot(mix, ids, models))
    runtimes = {pid: _Runtime(mix.holds, mix.load_s) for pid in ids}
    for pid in ids:
        scheduler.node_connected(f"node-{pid}")

    def report(pid: str) -> None:
        states = runtimes[pid].states(models) if placement else None
        scheduler.provider_status(
            pid,
            "available",
            models,
            model_states=states,
            max_loaded=mix.holds if placement else None,
        )

    for pid in ids:
        report(pid)
    rng = random.Random(mix.seed)
    if mix.zipf is None:
        picks = [models[n % len(models)] for n in range(mix.requests)]
    else:
        weights = [1 / (rank + 1) ** mix.zipf for rank in range(len(models))]
        picks = rng.choices(models, weights=weights, k=mix.requests)
    gaps = [rng.expovariate(1 / mix.arrival_s) for _ in picks]
    services = [rng.expovariate(1 / mix.service_s) for _ in picks]
    waits: list[float] = []

    async def one(n: int, model: str) -> None:
        asked = trio.current_time()
        with await scheduler.acquire(model, f"r{n}", long=False) as lease:
            started = trio.Event()  # the wait ends when the runtime serves: after any load
            async with trio.open_nursery() as serving:
                serving.start_soon(runtimes[lease.provider_id].serve, model, services[n], started)
                await started.wait()
                waits.append(trio.current_time() - asked)

    async def reporter() -> None:
        while True:
            await trio.sleep(mix.report_s)
            for pid in ids:
                report(pid)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reporter)
        async with trio.open_nursery() as requests:
            for n, model in enumerate(picks):
                await trio.sleep(gaps[n])
                requests.start_soon(one, n, model)
        nursery.cancel_scope.cancel()
    ordered = sorted(waits)
    return Outcome(
        loads=sum(runtime.loads for runtime in runtimes.values()),
        requests=len(picks),
        wait_p50_s=statistics.median(ordered),
        wait_p99_s=ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    )


def _compare(mix: Mix) -> Comparison:
    outcomes = {
        placement: trio.run(
            partial(_run, mix, placement=placement), clock=MockClock(autojump_threshold=0)
        )
        for placement in (False, True)
    }
    return Comparison(mix=mix, load_only=outcomes[False], placement=outcomes[True])


def run_models(scenarios: Sequence[Mix] = SCENARIOS) -> ModelsResult:
    return ModelsResult(comparisons=tuple(_compare(mix) for mix in scenarios))


# --- the report -------------------------------------------------------------------------


def render_models(result: ModelsResult) -> Group:
    table = Table(
        title="Many models: load-only -> placement (in process, virtual time)", title_justify="left"
    )
    for column in ("scenario", "loads", "loads / 1,000 requests", "wait p50", "wait p99"):
        table.add_column(column, justify="left" if column == "scenario" else "right")
    for comparison in result.comparisons:
        mix, off, on = comparison.mix, comparison.load_only, comparison.placement
        table.add_row(
            f"{mix.name}: {mix.models} models over {mix.providers} providers holding "
            f"{mix.holds}, {mix.requests:,} requests",
            f"{off.loads:,} -> {on.loads:,}",
            f"{off.loads_per_1000:.0f} -> {on.loads_per_1000:.0f}",
            f"{off.wait_p50_s:.2f} -> {on.wait_p50_s:.2f} s",
            f"{off.wait_p99_s:.2f} -> {on.wait_p99_s:.2f} s",
        )
    return Group(table, *targets(result))


def targets(result: ModelsResult) -> list[str]:
    """The targets as PASS/MISS lines."""
    lines = []
    for comparison in result.comparisons:
        off, on = comparison.load_only, comparison.placement
        if comparison.mix.zipf is None:
            passed = on.loads == comparison.mix.models
            lines.append(
                _verdict(
                    passed,
                    f"{comparison.mix.name}: {on.loads} loads in all == {comparison.mix.models}",
                )
            )
        else:
            ratio = on.loads / off.loads if off.loads else 0.0
            lines.append(
                _verdict(
                    ratio <= TARGET_ZIPF_RATIO,
                    f"{comparison.mix.name}: placement's loads {ratio:.2f}x load-only's <= 0.33x",
                )
            )
    return lines


def _verdict(passed: bool, text: str) -> str:
    return f"{'PASS' if passed else 'MISS'} {text}"
