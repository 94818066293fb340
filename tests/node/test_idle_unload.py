"""A Node unloads a model nobody used for `idle_unload_s`, and keeps a pinned one
(`iop_node.idle_keeper` in `iop_node.host`, design §18.4), on a sim that holds models like
llama.cpp's router; the clock is trio's autojump clock (no real waiting)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from iop_node.host import ProviderHost
from iop_node.runs.runner import Outbound
from schemas.config import AdapterSettings, IdleRule, NodeConfig, ProviderConfig
from schemas.wire import (
    ModelAction,
    ModelCommand,
    ModelCommandDone,
    PinAction,
    Run,
    RunDone,
    RunFailed,
    Status,
)

IDLE_S = 300.0


def _config(*rules: IdleRule) -> NodeConfig:
    settings = AdapterSettings(max_loaded=2, load_ms=1000, ttft_ms=0, health_interval_s=5.0)
    provider = ProviderConfig(id="s", type="sim", models=["a", "b"], capacity=2, adapter=settings)
    return NodeConfig(node_id="n1", providers=[provider], idle=list(rules))


def _rule(model: str) -> IdleRule:
    return IdleRule(provider_id="s", model=model, idle_unload_s=IDLE_S)


class Link:
    """One Edge link: what it received, and a wait for the runtime's states."""

    def __init__(self, host: ProviderHost) -> None:
        self.received: list[Outbound] = []
        self.changed = trio.Event()
        self.port = host.attach(self.send, "edge")
        self.refusals_fail = False
        """A refusal's send fails, as on a link that closed meanwhile."""

    async def send(self, item: Outbound) -> None:
        if self.refusals_fail and isinstance(item, RunFailed):
            raise trio.BrokenResourceError("the link closed")
        self.received.append(item)
        self.changed.set()
        self.changed = trio.Event()

    def states(self) -> dict[str, str]:
        statuses = [item for item in self.received if isinstance(item, Status)]
        if not statuses or statuses[-1].providers[0].model_states is None:
            return {}
        return {s.name: s.state for s in statuses[-1].providers[0].model_states or ()}

    async def wait_states(self, wanted: dict[str, str]) -> None:
        while self.states() != wanted:
            await self.changed.wait()

    async def wait_for(self, kind: type, count: int) -> None:
        while sum(isinstance(item, kind) for item in self.received) < count:
            await self.changed.wait()


def _command(action: ModelAction | PinAction, model: str) -> ModelCommand:
    return ModelCommand(command_id=f"{action}-{model}", provider_id="s", action=action, model=model)


async def test_a_model_nobody_used_for_idle_unload_s_is_unloaded_and_a_pinned_one_stays(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    host = ProviderHost(nursery, "n1")
    edge = Link(host)
    assert await host.apply(edge.port, 1, _config(_rule("a"), _rule("b")), 1.0) is None
    await edge.wait_states({"a": "unloaded", "b": "unloaded"})
    host.model_command(edge.port, _command("load", "a"))
    host.model_command(edge.port, _command("pin", "b"))
    await edge.wait_for(ModelCommandDone, 2)
    assert all(item.ok for item in edge.received if isinstance(item, ModelCommandDone))
    loaded_at = trio.current_time()

    # a run of `a` half-way through its idle time starts its clock over
    await trio.sleep_until(loaded_at + IDLE_S / 2)
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    await host.start_run(
        edge.port, Run(run_id="r1", provider_id="s", target="a", operation="chat", body=body)
    )
    await edge.wait_for(RunDone, 1)
    used_at = trio.current_time()

    await edge.wait_states({"a": "unloaded", "b": "loaded"})
    unloaded_at = trio.current_time()
    assert used_at + IDLE_S <= unloaded_at <= used_at + IDLE_S + 5.0 + 1.0  # + one probe

    # the pin holds long after; unpinned, `b` goes once idle for idle_unload_s
    await trio.sleep(10 * IDLE_S)
    assert edge.states() == {"a": "unloaded", "b": "loaded"}
    host.model_command(edge.port, _command("unpin", "b"))
    unpinned_at = trio.current_time()
    await edge.wait_states({"a": "unloaded", "b": "unloaded"})
    assert trio.current_time() >= unpinned_at


async def test_a_pin_ends_with_the_link_that_set_it(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    host = ProviderHost(nursery, "n1")
    edge, other = Link(host), Link(host)
    assert await host.apply(edge.port, 1, _config(_rule("a")), 1.0) is None
    await other.wait_states({"a": "unloaded", "b": "unloaded"})
    host.model_command(edge.port, _command("pin", "a"))
    await other.wait_states({"a": "loaded", "b": "unloaded"})
    await trio.sleep(3 * IDLE_S)
    assert other.states()["a"] == "loaded"
    gone_at = trio.current_time()
    host.detach(edge.port)
    await other.wait_states({"a": "unloaded", "b": "unloaded"})
    assert trio.current_time() >= gone_at


async def test_a_run_that_needs_room_unloads_an_unpinned_model_not_the_pinned_one(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    """The sim, like llama.cpp's router, unloads its least recently used model to load
    another: that would be the pinned `a`, loaded first and never used since."""
    settings = AdapterSettings(max_loaded=2, load_ms=1000, ttft_ms=0, health_interval_s=5.0)
    provider = ProviderConfig(
        id="s", type="sim", models=["a", "b", "c"], capacity=2, adapter=settings
    )
    host = ProviderHost(nursery, "n1")
    edge = Link(host)
    assert (
        await host.apply(edge.port, 1, NodeConfig(node_id="n1", providers=[provider]), 1.0) is None
    )
    await edge.wait_states({"a": "unloaded", "b": "unloaded", "c": "unloaded"})
    host.model_command(edge.port, _command("pin", "a"))
    await edge.wait_for(ModelCommandDone, 1)
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    for index, model in enumerate("bcbc", start=1):
        await host.start_run(
            edge.port,
            Run(run_id=f"r{index}", provider_id="s", target=model, operation="chat", body=body),
        )
        await edge.wait_for(RunDone, index)
        await edge.wait_states(
            {"a": "loaded", model: "loaded", "bc".replace(model, ""): "unloaded"}
        )


async def test_a_run_whose_refusal_could_not_be_sent_leaves_its_model_to_idle(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    """A run refused (here a duplicate) whose refusal's send fails never ran: its model is
    not counted as running for ever, so it still unloads once idle."""
    host = ProviderHost(nursery, "n1")
    edge = Link(host)
    assert await host.apply(edge.port, 1, _config(_rule("a")), 1.0) is None
    await edge.wait_states({"a": "unloaded", "b": "unloaded"})
    host.model_command(edge.port, _command("load", "a"))
    await edge.wait_for(ModelCommandDone, 1)
    messages = '"messages": [{"role": "user", "content": "hi"}]'
    first = Run(
        run_id="r1",
        provider_id="s",
        target="a",
        operation="chat",
        body=b'{%s, "max_tokens": 400}' % messages.encode(),
    )
    await host.start_run(edge.port, first)
    edge.refusals_fail = True
    with pytest.raises(trio.BrokenResourceError):
        await host.start_run(edge.port, first)  # the same id again: refused
    edge.refusals_fail = False
    await edge.wait_for(RunDone, 1)
    ended_at = trio.current_time()
    await edge.wait_states({"a": "unloaded", "b": "unloaded"})
    assert trio.current_time() <= ended_at + IDLE_S + 5.0 + 1.0  # + one probe
