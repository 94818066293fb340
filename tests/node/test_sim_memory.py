"""The sim's memory for models (`adapters.sim.sim_memory`): a runtime holding some models."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop_node.adapters.base import AdapterError, ModelCommandFailed
from iop_node.adapters.sim.adapter import SimAdapter
from schemas.config import AdapterSettings, ProviderConfig
from schemas.wire import ModelState, Run


def _sim(max_loaded: int | None = 1, load_ms: int = 2000) -> SimAdapter:
    settings = AdapterSettings(max_loaded=max_loaded, load_ms=load_ms, ttft_ms=0)
    return SimAdapter(
        ProviderConfig(id="s", type="sim", models=["a", "b"], capacity=4, adapter=settings)
    )


def _run(model: str) -> Run:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    return Run(run_id=f"r-{model}", provider_id="s", target=model, operation="chat", body=body)


async def _no_emit(data: bytes, parsed: object = None, /) -> None:
    pass


def _held(sim: SimAdapter) -> dict[str, str]:
    assert sim.memory is not None
    return {state.name: state.state for state in sim.memory.states()}


async def test_a_run_for_a_model_not_held_loads_it_first(autojump_clock: trio.abc.Clock) -> None:
    sim = _sim()
    assert _held(sim) == {"a": "unloaded", "b": "unloaded"}
    start = trio.current_time()
    await sim.execute(_run("a"), _no_emit)
    assert trio.current_time() - start == pytest.approx(2.0, abs=0.1)
    start = trio.current_time()
    await sim.execute(_run("a"), _no_emit)  # held: no load
    assert trio.current_time() - start < 0.1
    await sim.execute(_run("b"), _no_emit)  # evicts a
    assert _held(sim) == {"a": "unloaded", "b": "loaded"}
    assert sim.memory is not None and sim.memory.loads == 2


async def test_runs_for_a_model_being_loaded_wait_for_that_one_load(
    autojump_clock: trio.abc.Clock,
) -> None:
    sim = _sim()
    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(sim.execute, _run("a"), _no_emit)
        await trio.testing.wait_all_tasks_blocked()
        assert _held(sim)["a"] == "loading"
    assert sim.memory is not None and sim.memory.loads == 1


async def test_a_model_with_runs_in_flight_is_never_evicted(
    autojump_clock: trio.abc.Clock,
) -> None:
    sim = _sim(load_ms=0)
    release = trio.Event()

    async def slow_emit(data: bytes, parsed: object = None, /) -> None:
        await release.wait()

    streaming = Run(
        run_id="r",
        provider_id="s",
        target="a",
        operation="chat",
        stream=True,
        body=b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true}',
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sim.execute, streaming, slow_emit)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(AdapterError) as refused:
            await sim.execute(_run("b"), _no_emit)
        assert (refused.value.code, refused.value.capacity) == ("upstream_busy", True)
        with pytest.raises(ModelCommandFailed, match="a has runs in flight"):
            await sim.unload_model("a")
        release.set()
    await sim.unload_model("a")
    await sim.load_model("b")
    assert _held(sim) == {"a": "unloaded", "b": "loaded"}


async def test_its_probe_reports_states_like_a_router() -> None:
    sim = _sim(max_loaded=2)
    status = await sim.probe()
    assert status.model_states == [
        ModelState(name="a", state="unloaded"),
        ModelState(name="b", state="unloaded"),
    ]
    assert (status.max_loaded, status.lifecycle) == (
        2,
        ["list_models", "load_model", "unload_model"],
    )


async def test_a_sim_without_a_memory_holds_everything_and_refuses_commands() -> None:
    sim = _sim(max_loaded=None)
    status = await sim.probe()
    assert (status.model_states, status.max_loaded) == (None, None)
    with pytest.raises(ModelCommandFailed, match="holds every model always"):
        await sim.load_model("a")
