"""One set of providers for every Edge link (`iop_node.host`, design §3 "Several Edges")."""

from __future__ import annotations

import trio
import trio.testing

from iop_node.host import LinkPort, ProviderHost
from iop_node.runs.runner import Outbound
from schemas.config import NodeConfig, ProviderConfig
from schemas.wire import (
    FailureCode,
    Load,
    ProviderLoad,
    Run,
    RunDone,
    RunFailed,
    Status,
)
from tests.node.test_registry import Factory
from tests.timing import GUARD_S


class Edge:
    """What one link's Edge received from the host."""

    def __init__(self, host: ProviderHost, name: str) -> None:
        self.received: list[Outbound] = []
        self.port: LinkPort = host.attach(self.send, name)

    async def send(self, item: Outbound) -> None:
        self.received.append(item)

    def of(self, kind: type) -> list[object]:
        return [item for item in self.received if isinstance(item, kind)]

    def take(self) -> list[Outbound]:
        items, self.received = self.received, []
        return items


def _config(capacity: int = 1, node_id: str = "n1") -> NodeConfig:
    return NodeConfig(
        node_id=node_id,
        providers=[ProviderConfig(id="p", type="sim", models=["m"], capacity=capacity)],
    )


def _run(run_id: str) -> Run:
    return Run(run_id=run_id, provider_id="p", target="m", operation="chat", body=b"{}")


async def _host(nursery: trio.Nursery, factory: Factory) -> ProviderHost:
    return ProviderHost(nursery, "n1", factory=factory)


async def test_links_share_the_slots_and_a_run_that_finds_none_is_busy(
    nursery: trio.Nursery,
) -> None:
    factory = Factory()
    host = await _host(nursery, factory)
    a, b = Edge(host, "a"), Edge(host, "b")
    assert await host.apply(a.port, 1, _config(capacity=1), 1.0) is None
    assert await host.apply(b.port, 1, _config(capacity=1), 1.0) is None
    await host.start_run(a.port, _run("r1"))
    [adapter] = factory.created
    await adapter.wait_run("r1")

    b.take()
    await host.start_run(b.port, _run("r2"))
    busy, load = b.take()
    assert isinstance(busy, RunFailed) and busy.code == FailureCode.BUSY
    assert busy.retryable and busy.capacity
    assert load == Load(providers=[ProviderLoad(id="p", in_flight=1)])
    assert adapter.runs == ["r1"]

    adapter.release("r1")
    await trio.testing.wait_all_tasks_blocked()
    assert RunDone in [type(item) for item in a.take()]
    await host.start_run(b.port, _run("r3"))
    await adapter.wait_run("r3")
    assert host.statistics().slots.peak == {"p": 1}


async def test_run_ids_are_scoped_by_link(nursery: trio.Nursery) -> None:
    factory = Factory()
    host = await _host(nursery, factory)
    a, b = Edge(host, "a"), Edge(host, "b")
    await host.apply(a.port, 1, _config(capacity=2), 1.0)
    await host.start_run(a.port, _run("same"))
    await host.start_run(b.port, _run("same"))
    [adapter] = factory.created
    await trio.testing.wait_all_tasks_blocked()
    assert adapter.runs == ["same", "same"]
    assert host.cancel_run(a.port, "same")
    await trio.testing.wait_all_tasks_blocked()
    [cancelled] = a.of(RunFailed)
    assert isinstance(cancelled, RunFailed) and cancelled.code == FailureCode.CANCELLED
    assert not b.of(RunFailed)  # b's run with the same id goes on
    assert host.statistics().runs == {a.port.serial: 0, b.port.serial: 1}


async def test_a_cancel_frees_the_slot_before_the_run_unwinds(nursery: trio.Nursery) -> None:
    """The Edge released the slot when it sent `cancel` and may send its next run right
    behind it: that run must not be answered `busy`."""
    factory = Factory()
    host = await _host(nursery, factory)
    a = Edge(host, "a")
    await host.apply(a.port, 1, _config(capacity=1), 1.0)
    await host.start_run(a.port, _run("r1"))
    await factory.created[0].wait_run("r1")
    host.cancel_run(a.port, "r1")
    await host.start_run(a.port, _run("r2"))  # no checkpoint in between
    assert not [item for item in a.of(RunFailed) if item.code == FailureCode.BUSY]  # type: ignore[attr-defined]
    await factory.created[0].wait_run("r2")


async def test_a_link_that_ends_takes_its_runs_with_it(nursery: trio.Nursery) -> None:
    factory = Factory()
    host = await _host(nursery, factory)
    a, b = Edge(host, "a"), Edge(host, "b")
    await host.apply(a.port, 1, _config(capacity=3), 1.0)
    for run_id in ("a1", "a2"):
        await host.start_run(a.port, _run(run_id))
    await host.start_run(b.port, _run("b1"))
    adapter = factory.created[0]
    await adapter.wait_run("b1")
    assert host.others(b.port) == [ProviderLoad(id="p", in_flight=2)]

    host.detach(a.port)
    assert host.others(b.port) == [ProviderLoad(id="p", in_flight=0)]
    await trio.testing.wait_all_tasks_blocked()
    assert host.statistics().slots.in_flight == {"p": 1}
    assert host.statistics().links == {b.port.serial: "b"}
    assert host.current is not None and host.current.active_runs == 1


async def test_the_newest_config_wins_and_an_older_one_is_refused(nursery: trio.Nursery) -> None:
    factory = Factory()
    host = await _host(nursery, factory)
    a, b = Edge(host, "a"), Edge(host, "b")
    assert await host.apply(a.port, 5, _config(capacity=1), 100.0) is None
    error = await host.apply(b.port, 9, _config(capacity=4), 50.0)
    assert error is not None and "newer config" in error
    assert host.current is not None and host.current.config == _config(capacity=1)
    assert len(factory.created) == 1
    # A refresh taken later wins, from whichever Edge.
    assert await host.apply(b.port, 10, _config(capacity=4), 200.0) is None
    assert host.current.config == _config(capacity=4)


async def test_an_equal_config_keeps_the_registry_and_its_adapters(nursery: trio.Nursery) -> None:
    factory = Factory()
    host = await _host(nursery, factory)
    a = Edge(host, "a")
    await host.apply(a.port, 1, _config(), 10.0)
    registry = host.current
    await trio.testing.wait_all_tasks_blocked()
    b = Edge(host, "b")
    assert await host.apply(b.port, 7, _config(), 5.0) is None  # older, but equal: fine
    assert host.current is registry and len(factory.created) == 1
    # b attached to a registry already probed: it hears the statuses at once.
    assert b.port.first_status.is_set()
    assert [type(item) for item in b.received] == [Status]


async def test_a_config_for_another_node_is_refused(nursery: trio.Nursery) -> None:
    host = await _host(nursery, Factory())
    a = Edge(host, "a")
    error = await host.apply(a.port, 1, _config(node_id="n2"), 1.0)
    assert error == "config is for node 'n2', this node is 'n1'"


async def test_stop_tells_every_link_and_refuses_new_runs(nursery: trio.Nursery) -> None:
    factory = Factory()
    host = await _host(nursery, factory)
    a, b = Edge(host, "a"), Edge(host, "b")
    await host.apply(a.port, 1, _config(capacity=2), 1.0)
    await host.start_run(a.port, _run("r1"))
    await factory.created[0].wait_run("r1")
    await trio.testing.wait_all_tasks_blocked()  # the first health report is out
    a.take()
    b.take()
    nursery.start_soon(host.aclose)
    await trio.testing.wait_all_tasks_blocked()
    for edge in (a, b):
        [status] = edge.of(Status)
        assert isinstance(status, Status)
        assert [provider.health for provider in status.providers] == ["draining"]
    await host.start_run(b.port, _run("r2"))
    [refused] = b.of(RunFailed)
    assert isinstance(refused, RunFailed) and refused.code == FailureCode.NODE_STOPPING
    factory.created[0].release("r1")
    with trio.fail_after(GUARD_S):
        await host.wait_drained()
    assert [type(item) for item in a.received][-1] is RunDone


async def test_an_edge_welcoming_with_an_older_config_hears_the_running_providers(
    nursery: trio.Nursery,
) -> None:
    """A replica not refreshed yet links: the Node keeps the newer config, and that Edge is
    told the providers' real health, not that they could not be built."""
    factory = Factory()
    host = await _host(nursery, factory)
    a = Edge(host, "a")
    await host.apply(a.port, 3, _config(capacity=2), 100.0)
    await trio.testing.wait_all_tasks_blocked()
    b = Edge(host, "b")
    await host.apply_welcome(b.port, 1, _config(capacity=1), 50.0)
    [status] = b.of(Status)
    assert isinstance(status, Status)
    assert [(p.id, p.health) for p in status.providers] == [("p", "available")]
    assert host.current is not None and host.current.config == _config(capacity=2)
