"""A provider's loads and unloads, one at a time, whoever asks (`iop_node.runs.model_control`)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop_node.adapters.base import Emit, ModelCommandFailed, RunResult
from iop_node.runs.model_control import ModelControl
from schemas.config import AdapterSettings, ProviderConfig
from schemas.wire import ModelAction, ProviderStatus, Run


class Runtime:
    """An adapter whose runtime loads a model when the test says it is done."""

    def __init__(self, provider_id: str = "p", *, load_timeout_s: float = 300.0) -> None:
        self.provider = ProviderConfig(
            id=provider_id,
            type="openai_api",
            models=["a", "b"],
            capacity=1,
            adapter=AdapterSettings(
                base_url="http://127.0.0.1:9/v1", load_timeout_s=load_timeout_s
            ),
        )
        self.calls: list[tuple[str, str]] = []
        self.running: list[tuple[str, str]] = []
        self.release = trio.Event()
        self.refuse: str | None = None
        self.bug: Exception | None = None
        """Raised in place of an answer: an adapter's bug."""

    async def _do(self, action: str, model: str) -> None:
        self.calls.append((action, model))
        self.running.append((action, model))
        try:
            await self.release.wait()
        finally:
            self.running.remove((action, model))
        if self.bug is not None:
            raise self.bug
        if self.refuse is not None:
            raise ModelCommandFailed(self.refuse)

    async def load_model(self, model: str) -> None:
        await self._do("load", model)

    async def unload_model(self, model: str) -> None:
        await self._do("unload", model)

    async def probe(self) -> ProviderStatus:
        return ProviderStatus(id=self.provider.id, health="available")

    async def execute(self, run: Run, emit: Emit) -> RunResult:
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


async def _run_into(
    control: ModelControl,
    runtime: Runtime,
    action: ModelAction,
    model: str,
    answers: list[str | None],
) -> None:
    answers.append(await control.run(runtime, action, model))  # type: ignore[arg-type]


async def test_two_edges_asking_for_the_same_load_cause_one_load() -> None:
    control, runtime, answers = ModelControl(), Runtime(), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_run_into, control, runtime, "load", "a", answers)
        nursery.start_soon(_run_into, control, runtime, "load", "a", answers)
        await trio.testing.wait_all_tasks_blocked()
        runtime.release.set()
    assert runtime.calls == [("load", "a")]
    assert answers == [None, None]


async def test_a_provider_runs_one_command_at_a_time_in_arrival_order() -> None:
    control, runtime, answers = ModelControl(), Runtime(), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_run_into, control, runtime, "load", "a", answers)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_run_into, control, runtime, "unload", "b", answers)
        await trio.testing.wait_all_tasks_blocked()
        assert runtime.running == [("load", "a")]  # the unload waits its turn
        runtime.release.set()
    assert runtime.calls == [("load", "a"), ("unload", "b")]


async def test_providers_do_not_wait_for_each_other() -> None:
    control, first, second, answers = ModelControl(), Runtime("p1"), Runtime("p2"), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_run_into, control, first, "load", "a", answers)
        nursery.start_soon(_run_into, control, second, "load", "a", answers)
        await trio.testing.wait_all_tasks_blocked()
        assert first.running == second.running == [("load", "a")]
        first.release.set()
        second.release.set()


async def test_a_refusal_reaches_everyone_who_joined() -> None:
    control, runtime, answers = ModelControl(), Runtime(), []
    runtime.refuse = "out of memory"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_run_into, control, runtime, "load", "a", answers)
        nursery.start_soon(_run_into, control, runtime, "load", "a", answers)
        await trio.testing.wait_all_tasks_blocked()
        runtime.release.set()
    assert answers == ["out of memory", "out of memory"]


async def test_an_adapter_that_raises_fails_the_command_and_the_provider_runs_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whatever an adapter raises fails the command with what it said (the Node, whose
    nursery runs the command, is not taken down), and the provider's next command runs."""
    control, runtime, answers = ModelControl(), Runtime(), []
    runtime.bug = KeyError("status")
    runtime.release.set()
    await _run_into(control, runtime, "load", "a", answers)
    runtime.bug = None
    await _run_into(control, runtime, "load", "b", answers)
    assert answers == ["load of a failed: KeyError: 'status'", None]
    assert "load of a raised" in caplog.text


async def test_a_load_past_its_timeout_fails_and_frees_the_provider(
    autojump_clock: trio.abc.Clock,
) -> None:
    control, runtime, answers = ModelControl(), Runtime(load_timeout_s=30), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_run_into, control, runtime, "load", "a", answers)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_run_into, control, runtime, "load", "b", answers)
        await trio.sleep(31)
        assert answers == ["load of a did not finish within 30s (adapter.load_timeout_s)"]
        assert runtime.running == [("load", "b")]
        runtime.release.set()
    assert answers[1] is None


async def test_a_joined_command_whose_leader_is_cancelled_is_not_told_it_succeeded() -> None:
    control, runtime, answers = ModelControl(), Runtime(), []
    leader_scope = trio.CancelScope()

    async def leader() -> None:
        with leader_scope:
            await control.run(runtime, "load", "a")  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(leader)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(_run_into, control, runtime, "load", "a", answers)
        await trio.testing.wait_all_tasks_blocked()
        leader_scope.cancel()
    assert answers == ["the command was cancelled before the runtime answered"]
    assert runtime.calls == [("load", "a")]


@pytest.mark.parametrize("action", ["load", "unload"])
async def test_a_runtime_that_cannot_load_on_request_is_refused_at_once(
    action: ModelAction,
) -> None:
    class ListingOnly:
        provider = Runtime().provider

    answer = await ModelControl().run(ListingOnly(), action, "a")  # type: ignore[arg-type]
    assert answer == "provider 'p' (openai_api) cannot load models on request"
