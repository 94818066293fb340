"""Registry build, swap and drain (`iop_node.registry`, design §5 step 7)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop_node.adapters.base import Emit, RunResult
from iop_node.adapters.sim.adapter import SimAdapter
from iop_node.registry import (
    AdapterRegistry,
    RegistryBuildError,
    RegistryManager,
    create_adapter,
)
from schemas.config import AdapterSettings, NodeConfig, ProviderConfig, ProviderType
from schemas.wire import Message, ProviderStatus, Run, RunDone, RunFailed, Usage


class GatedAdapter:
    """Each run blocks until the test releases it; `aclose` is recorded."""

    def __init__(self, provider: ProviderConfig) -> None:
        self.provider = provider
        self.closed = False
        self.runs: list[str] = []
        self._gates: dict[str, trio.Event] = {}
        self._arrived = trio.Event()

    def _gate(self, run_id: str) -> trio.Event:
        return self._gates.setdefault(run_id, trio.Event())

    async def execute(self, run: Run, emit: Emit) -> RunResult:
        self.runs.append(run.run_id)
        self._arrived.set()
        await self._gate(run.run_id).wait()
        return RunResult(usage=Usage(completion_tokens=1, total_tokens=1))

    def release(self, run_id: str) -> None:
        self._gate(run_id).set()

    async def wait_run(self, run_id: str) -> None:
        while run_id not in self.runs:
            self._arrived = trio.Event()
            await self._arrived.wait()

    async def probe(self) -> ProviderStatus:
        return ProviderStatus(id=self.provider.id, health="available")

    async def aclose(self) -> None:
        self.closed = True


class Factory:
    """Builds `GatedAdapter`s, or fails for the provider ids in `fail_for`."""

    def __init__(self) -> None:
        self.created: list[GatedAdapter] = []
        self.fail_for: set[str] = set()

    def __call__(self, provider: ProviderConfig) -> GatedAdapter:
        if provider.id in self.fail_for:
            raise ValueError("upstream base_url is missing")
        adapter = GatedAdapter(provider)
        self.created.append(adapter)
        return adapter


def _config(capacity: int = 1, *provider_ids: str) -> NodeConfig:
    return NodeConfig(
        node_id="n1",
        providers=[
            ProviderConfig(id=provider_id, type="sim", models=["m"], capacity=capacity)
            for provider_id in provider_ids or ("p1",)
        ],
    )


def _run(run_id: str, provider_id: str = "p1") -> Run:
    return Run(run_id=run_id, provider_id=provider_id, target="m", operation="chat", body=b"{}")


class Harness:
    def __init__(
        self, nursery: trio.Nursery, *, drain_timeout_s: float = 30.0, max_retiring: int = 4
    ) -> None:
        self.factory = Factory()
        self._send, self._receive = trio.open_memory_channel[Message](100)
        self.manager = RegistryManager(
            nursery,
            self._send.send,
            drain_timeout_s=drain_timeout_s,
            max_retiring=max_retiring,
            factory=self.factory,
        )

    async def next_message(self) -> Message:
        return await self._receive.receive()

    async def retire_with_a_run(self, run_id: str) -> None:
        """Start `run_id` on a live registry, then make that registry a retiring one (a new
        config applied) while the run goes on."""
        await self.manager.apply(1, _config(1))
        await self.manager.start_run(_run(run_id))
        await self.factory.created[0].wait_run(run_id)
        await self.manager.apply(2, _config(2))

    def pending(self) -> list[Message]:
        messages = []
        while True:
            try:
                messages.append(self._receive.receive_nowait())
            except trio.WouldBlock:
                return messages


def test_create_adapter_imports_sim() -> None:
    provider = ProviderConfig(id="s", type="sim", models=["m"], capacity=1)
    assert isinstance(create_adapter(provider), SimAdapter)


@pytest.mark.parametrize(
    ("provider_type", "class_name"),
    [
        ("vllm", "OpenAICompatAdapter"),
        ("sglang", "OpenAICompatAdapter"),
        ("lemonade", "OpenAICompatAdapter"),
        ("openai_api", "OpenAICompatAdapter"),
        ("ollama", "OllamaAdapter"),
        ("lmstudio", "LmStudioAdapter"),
        ("cli", "CliAdapter"),
    ],
)
async def test_create_adapter_maps_every_type(provider_type: ProviderType, class_name: str) -> None:
    settings = AdapterSettings(base_url="http://127.0.0.1:9/v1", command=["echo", "{model}"])
    provider = ProviderConfig(
        id="p", type=provider_type, models=["m"], capacity=1, adapter=settings
    )
    adapter = create_adapter(provider)
    try:
        assert type(adapter).__name__ == class_name
        assert adapter.provider is provider
    finally:
        await adapter.aclose()


async def test_build_failure_names_provider_and_closes_what_was_built() -> None:
    factory = Factory()
    factory.fail_for = {"p2"}
    with pytest.raises(RegistryBuildError, match=r"'p2' \(sim\): ValueError: upstream base_url"):
        await AdapterRegistry.build(1, _config(1, "p1", "p2"), factory)
    [built] = factory.created
    assert built.closed


async def test_duplicate_provider_ids_fail_the_build() -> None:
    with pytest.raises(RegistryBuildError, match="configured twice"):
        await AdapterRegistry.build(1, _config(1, "p1", "p1"), Factory())


async def test_swap_routes_new_runs_and_stops_old_registry_after_its_runs(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with trio.open_nursery() as nursery:
        harness = Harness(nursery)
        manager = harness.manager
        first = await manager.apply(1, _config(1))
        await manager.start_run(_run("r1"))
        [old_adapter] = harness.factory.created
        await old_adapter.wait_run("r1")

        second = await manager.apply(2, _config(2))
        assert manager.current is second and second.revision == 2
        assert first.statistics().state == "retiring"
        assert manager.statistics().retiring == (first,)
        await manager.start_run(_run("r2"))
        new_adapter = harness.factory.created[1]
        await new_adapter.wait_run("r2")
        assert old_adapter.runs == ["r1"] and new_adapter.runs == ["r2"]

        await trio.testing.wait_all_tasks_blocked()
        assert not old_adapter.closed  # its run is still active

        old_adapter.release("r1")
        assert await harness.next_message() == RunDone(
            run_id="r1", usage=Usage(completion_tokens=1, total_tokens=1), usage_source="provider"
        )
        await first.wait_closed()
        assert old_adapter.closed and not new_adapter.closed
        assert first.statistics().state == "closed" and manager.statistics().retiring == ()
        assert trio.current_time() == 0  # drained, not timed out
        nursery.cancel_scope.cancel()
    assert new_adapter.closed  # the session ended: every adapter is closed


async def test_drain_timeout_cancels_stragglers_with_registry_retired(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with trio.open_nursery() as nursery:
        harness = Harness(nursery, drain_timeout_s=30)
        first = await harness.manager.apply(1, _config(1))
        await harness.manager.start_run(_run("r1"))
        [old_adapter] = harness.factory.created
        await old_adapter.wait_run("r1")
        await harness.manager.apply(2, _config(2))

        failed = await harness.next_message()
        assert trio.current_time() == pytest.approx(30)
        assert isinstance(failed, RunFailed)
        assert (failed.run_id, failed.code) == ("r1", "registry_retired")
        assert "revision 1" in failed.message and "refresh" in failed.message
        await first.wait_closed()
        assert old_adapter.closed
        nursery.cancel_scope.cancel()


async def test_build_failure_keeps_the_old_registry(autojump_clock: trio.abc.Clock) -> None:
    async with trio.open_nursery() as nursery:
        harness = Harness(nursery)
        first = await harness.manager.apply(1, _config(1))
        harness.factory.fail_for = {"p2"}
        with pytest.raises(RegistryBuildError, match="p2"):
            await harness.manager.apply(2, _config(1, "p1", "p2"))
        assert harness.manager.current is first and first.statistics().state == "live"
        assert harness.manager.statistics().retiring == ()
        await harness.manager.start_run(_run("r1"))
        await harness.factory.created[0].wait_run("r1")
        # The adapter built for the failed candidate was closed; the live one was not.
        assert [adapter.closed for adapter in harness.factory.created] == [False, True]
        nursery.cancel_scope.cancel()


async def test_too_many_retiring_registries_cut_the_oldest_short(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with trio.open_nursery() as nursery:
        harness = Harness(nursery, max_retiring=1)
        manager = harness.manager
        first = await manager.apply(1, _config(1))
        await manager.start_run(_run("r1"))
        await harness.factory.created[0].wait_run("r1")
        second = await manager.apply(2, _config(2))
        await manager.start_run(_run("r2"))
        await harness.factory.created[1].wait_run("r2")
        await trio.testing.wait_all_tasks_blocked()
        assert harness.pending() == []  # one retiring registry is within the bound

        await manager.apply(3, _config(3))
        failed = await harness.next_message()
        assert isinstance(failed, RunFailed)
        assert (failed.run_id, failed.code) == ("r1", "registry_retired")
        assert trio.current_time() == 0  # cut short now, not after the drain timeout
        await first.wait_closed()
        assert second.statistics().state == "retiring" and manager.statistics().retiring == (
            second,
        )
        nursery.cancel_scope.cancel()


async def test_runs_of_every_registry_show_in_one_activity_record() -> None:
    """The health monitor of the current registry must see the runs still draining on a
    retired one: they keep the same runtime busy."""
    async with trio.open_nursery() as nursery:
        harness = Harness(nursery)
        manager = harness.manager
        await manager.apply(1, _config(2))
        await manager.start_run(_run("r1"))
        await harness.factory.created[0].wait_run("r1")
        await manager.apply(2, _config(3))  # r1 drains on the retired registry
        await manager.start_run(_run("r2"))
        await harness.factory.created[1].wait_run("r2")
        assert manager.current is not None and manager.current.activity is manager.activity
        assert manager.activity.in_flight("p1") == 2
        for adapter, run_id in zip(harness.factory.created, ("r1", "r2"), strict=True):
            adapter.release(run_id)
            await harness.next_message()
        await trio.testing.wait_all_tasks_blocked()
        assert manager.activity.in_flight("p1") == 0
        assert manager.activity.progress("p1").state == "idle"
        nursery.cancel_scope.cancel()


async def test_cancel_reaches_a_run_on_a_retiring_registry(autojump_clock: trio.abc.Clock) -> None:
    async with trio.open_nursery() as nursery:
        harness = Harness(nursery)
        await harness.retire_with_a_run("r1")
        assert harness.manager.cancel_run("r1")
        failed = await harness.next_message()
        assert isinstance(failed, RunFailed)
        assert (failed.code, failed.message) == ("cancelled", "cancelled by the edge")
        await trio.testing.wait_all_tasks_blocked()  # the run's own bookkeeping is done
        assert not harness.manager.cancel_run("r1")
        assert not harness.manager.cancel_run("never-started")
        nursery.cancel_scope.cancel()


async def test_same_config_keeps_the_live_registry() -> None:
    async with trio.open_nursery() as nursery:
        harness = Harness(nursery)
        first = await harness.manager.apply(1, _config(1))
        assert await harness.manager.apply(2, _config(1)) is first
        assert first.revision == 2 and harness.manager.statistics().retiring == ()
        assert len(harness.factory.created) == 1
        nursery.cancel_scope.cancel()


async def test_duplicate_run_id_is_refused_and_the_first_run_continues() -> None:
    async with trio.open_nursery() as nursery:
        harness = Harness(nursery)
        await harness.manager.apply(1, _config(1))
        await harness.manager.start_run(_run("r1"))
        await harness.manager.start_run(_run("r1"))
        failed = await harness.next_message()
        assert isinstance(failed, RunFailed)
        assert (failed.run_id, failed.code) == ("r1", "duplicate_run")
        adapter = harness.factory.created[0]
        adapter.release("r1")
        assert isinstance(await harness.next_message(), RunDone)
        assert adapter.runs == ["r1"]
        nursery.cancel_scope.cancel()


async def test_a_run_id_active_on_a_retiring_registry_is_a_duplicate(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with trio.open_nursery() as nursery:
        harness = Harness(nursery)
        await harness.retire_with_a_run("r1")
        assert harness.manager.statistics().retiring  # r1 keeps the old registry draining
        assert harness.manager.has_run("r1") and not harness.manager.has_run("r2")
        await harness.manager.start_run(_run("r1"))
        failed = await harness.next_message()
        assert isinstance(failed, RunFailed)
        assert (failed.run_id, failed.code) == ("r1", "duplicate_run")
        assert harness.factory.created[1].runs == []  # the live registry never saw it
        nursery.cancel_scope.cancel()


async def test_unknown_provider_on_the_current_registry() -> None:
    async with trio.open_nursery() as nursery:
        harness = Harness(nursery)
        await harness.manager.apply(1, _config(1))
        await harness.manager.start_run(_run("r1", provider_id="elsewhere"))
        failed = await harness.next_message()
        assert isinstance(failed, RunFailed)
        assert (failed.code, failed.retryable) == ("unknown_provider", True)
        nursery.cancel_scope.cancel()


async def test_aclose_drains_then_refuses_new_runs(autojump_clock: trio.abc.Clock) -> None:
    async with trio.open_nursery() as nursery:
        harness = Harness(nursery, drain_timeout_s=10)
        registry = await harness.manager.apply(1, _config(1))
        await harness.manager.start_run(_run("r1"))
        await harness.manager.start_run(_run("r2"))
        adapter = harness.factory.created[0]
        await adapter.wait_run("r2")

        async def finish_one_later() -> None:
            await trio.sleep(1)
            adapter.release("r1")

        nursery.start_soon(finish_one_later)
        await harness.manager.aclose()
        assert trio.current_time() == pytest.approx(10)
        assert registry.statistics().state == "closed" and adapter.closed
        done, straggler = harness.pending()
        assert isinstance(done, RunDone) and done.run_id == "r1"
        assert isinstance(straggler, RunFailed)
        assert (straggler.run_id, straggler.code, straggler.retryable) == (
            "r2",
            "node_stopping",
            True,
        )

        await harness.manager.start_run(_run("r3"))
        refused = await harness.next_message()
        assert isinstance(refused, RunFailed)
        assert (refused.run_id, refused.code, refused.retryable) == ("r3", "node_stopping", True)
        with pytest.raises(RegistryBuildError, match="stopping"):
            await harness.manager.apply(2, _config(2))


async def test_registry_refuses_runs_once_retired() -> None:
    async with trio.open_nursery() as nursery:
        registry = AdapterRegistry(1, _config(1), {})
        await nursery.start(registry.serve)
        registry.retire()
        with pytest.raises(RuntimeError, match="retiring"):
            registry.start_run(_run("r1"), _discard)
        await registry.wait_closed()
        assert registry.statistics().state == "closed"


async def _discard(message: Message) -> None:
    raise AssertionError(f"unexpected {message!r}")
