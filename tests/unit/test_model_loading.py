"""Runs of a model that a runtime is loading wait for the load (design §18.4): their queue
wait grows by the provider's `load_timeout_s`, and one that still finds no slot hears
`model_loading`, not a plain queue timeout."""

from __future__ import annotations

import pytest
import trio

from iop_edge.core.snapshot import Snapshot
from iop_edge.http.errors import admission_error
from iop_edge.runtime.runs.admission_errors import ModelLoading, QueueTimeout
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

HASH = "0" * 64


def _scheduler() -> Scheduler:
    """One provider of one slot whose runtime reports model `m-served` unloaded; a queue
    wait of 1 s and a load time of at most 30 s."""
    provider = ProviderConfig(
        id="p1",
        type="sim",
        models=["m-served"],
        capacity=1,
        adapter=AdapterSettings(load_timeout_s=30.0),
    )
    config = EdgeConfig(
        dispatch=DispatchSection(max_queue=8, queue_timeout_ms=1_000),
        models=[ModelEntry(id="m", providers={"p1": "m-served"})],
        nodes=[NodeEntry(id="n1", token_hash_sha256=HASH, providers=[provider])],
    )
    scheduler = Scheduler(Snapshot.build(config, revision=1, config_sha256=HASH))
    scheduler.node_connected("n1")
    _report(scheduler, "unloaded")
    return scheduler


def _report(scheduler: Scheduler, state: str) -> None:
    states = [ModelState(name="m-served", state=state)]  # type: ignore[arg-type]
    scheduler.provider_status("p1", "available", ["m-served"], model_states=states, max_loaded=1)


async def test_a_run_waits_for_the_load_and_then_hears_model_loading(
    autojump_clock: trio.abc.Clock,
) -> None:
    scheduler = _scheduler()
    loading = await scheduler.acquire("m", "r1", long=False)  # its run makes the runtime load
    began = trio.current_time()
    with pytest.raises(ModelLoading) as refused:
        await scheduler.acquire("m", "r2", long=False)
    assert trio.current_time() - began == pytest.approx(31.0)
    assert refused.value.retry_after_s == 10.0
    answer = admission_error(refused.value, request_id="req_1")
    assert (answer.status, answer.code) == (503, "model_loading")
    loading.release()


async def test_a_load_that_finished_makes_a_late_timeout_a_plain_one(
    autojump_clock: trio.abc.Clock,
) -> None:
    scheduler = _scheduler()
    busy = await scheduler.acquire("m", "r1", long=False)
    async with trio.open_nursery() as nursery:
        outcome: list[type[BaseException]] = []

        async def second() -> None:
            try:
                await scheduler.acquire("m", "r2", long=False)
            except QueueTimeout as exc:
                outcome.append(type(exc))

        nursery.start_soon(second)
        await trio.sleep(5)
        _report(scheduler, "loaded")  # the load is done; the one slot stays busy
    assert outcome == [QueueTimeout]
    busy.release()


async def test_a_model_nobody_loads_waits_only_the_queue(autojump_clock: trio.abc.Clock) -> None:
    scheduler = _scheduler()
    _report(scheduler, "loaded")
    busy = await scheduler.acquire("m", "r1", long=False)
    began = trio.current_time()
    with pytest.raises(QueueTimeout) as refused:
        await scheduler.acquire("m", "r2", long=False)
    assert not isinstance(refused.value, ModelLoading)
    assert trio.current_time() - began == pytest.approx(1.0)
    busy.release()
