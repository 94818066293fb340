"""Several Edges sharing Nodes, in-process (design §3 "Several Edges", §13 slot truth).

Two real Edges and real Nodes on 127.0.0.1, each Node linked to both: the provider's
slots are counted on the Node across links, each Edge counts the runs the other holds,
capacity is never exceeded when the Edges race, and nothing drifts when an Edge dies.
The process-level tests (restart, a killed replica behind a balancer) are in
`test_restart.py` and `test_replicas.py`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import openai
import trio
import trio.testing
from trio_websocket import WebSocketConnection

from iop_edge.core.configuration.config import parse_config
from iop_edge.edge import Edge, EdgeAddresses
from iop_node.main import run_node
from iop_node.uplink.edges import EdgeLinks
from schemas import wire
from tests.e2e.stack import (
    NODE_TOKEN,
    WAIT_GUARD_S,
    Stack,
    edge_config,
    sim_provider,
)
from tests.e2e.test_misbehaving_node import _stack as _hand_driven_stack

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
SLOW = {"ttft_ms": 5, "tokens_per_second": 20}
FAST = {"ttft_ms": 2, "tokens_per_second": 4000}


@dataclass
class Edges:
    """Two Edges, each in its own cancel scope (so one can die), and the Node."""

    stacks: dict[str, Stack]
    scopes: dict[str, trio.CancelScope]
    node: EdgeLinks

    def provider(self, name: str) -> dict[str, Any]:
        catalog: dict[str, Any] = msgspec.to_builtins(self.stacks[name].edge.scheduler.catalog())
        [provider] = catalog["providers"]
        return provider

    async def wait_provider(self, name: str, predicate: Callable[[dict[str, Any]], bool]) -> None:
        await self.stacks[name].wait_catalog(lambda c: predicate(c["providers"][0]))

    def node_slots(self) -> dict[str, int]:
        return self.node.statistics().slots.in_flight

    def peak(self) -> int:
        return self.node.statistics().slots.peak["sim-1"]


async def _serve_edge(
    nursery: trio.Nursery, text: str, path: Path, scope: trio.CancelScope
) -> Stack:
    await trio.Path(path).write_text(text, encoding="utf-8")
    edge = Edge(parse_config(text), config_path=path)

    async def serve(*, task_status: trio.TaskStatus[EdgeAddresses]) -> None:
        with scope:
            await edge.serve(task_status=task_status)

    addresses: EdgeAddresses = await nursery.start(serve)
    return Stack(edge=edge, addresses=addresses, nursery=nursery, config_path=path)


async def _two_edges(
    nursery: trio.Nursery, tmp_path: Path, *, capacity: int, adapter: dict[str, Any]
) -> Edges:
    stacks: dict[str, Stack] = {}
    scopes: dict[str, trio.CancelScope] = {}
    for name in ("a", "b"):
        text = edge_config(
            tmp_path / name,
            providers=[sim_provider("sim-1", capacity=capacity, adapter=adapter)],
            models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
        )
        scopes[name] = trio.CancelScope()
        stacks[name] = await _serve_edge(nursery, text, tmp_path / f"{name}.yaml", scopes[name])
    urls = [stacks[name].addresses.node_url for name in ("a", "b")]
    node: EdgeLinks = await nursery.start(partial(run_node, urls, "node-1", NODE_TOKEN))
    for stack in stacks.values():
        await stack.wait_servable("m")
    return Edges(stacks=stacks, scopes=scopes, node=node)


@asynccontextmanager
async def _held_streams(stack: Stack, count: int) -> AsyncIterator[list[Any]]:
    """`count` slow streams on `stack`, each past its first chunk (running on the Node)."""
    async with stack.client() as client:
        streams = []
        for _ in range(count):
            stream = await client.chat.completions.create(
                model="m", stream=True, max_tokens=1000, messages=MESSAGES
            )
            await stream.__anext__()
            streams.append(stream)
        try:
            yield streams
        finally:
            for stream in streams:
                with trio.move_on_after(1, shield=True):
                    await stream.close()


async def test_each_edge_counts_the_runs_the_other_holds(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    edges = await _two_edges(nursery, tmp_path, capacity=2, adapter=SLOW)
    a, b = edges.stacks["a"], edges.stacks["b"]
    async with _held_streams(a, 2) as streams:
        await edges.wait_provider(
            "b", lambda p: p["other_edges_in_flight"] == 2 and p["in_flight"] == 2
        )
        assert edges.provider("b")["load_ratio"] == 1.0
        assert edges.provider("a")["other_edges_in_flight"] == 0

        answer: list[str] = []
        answered = trio.Event()

        async def ask_b() -> None:
            async with b.client() as client:
                completion = await client.chat.completions.create(
                    model="m", max_tokens=2, messages=MESSAGES
                )
                answer.append(completion.choices[0].message.content or "")
                answered.set()

        nursery.start_soon(ask_b)
        # b sees the provider full: the request waits in b's queue, nothing is dispatched.
        await b.wait_catalog(lambda c: c["models"][0]["queued"] == 1)
        assert edges.node_slots() == {"sim-1": 2}

        await streams[0].close()  # a's run ends on the Node; b hears it and dispatches
        with trio.fail_after(WAIT_GUARD_S):
            await answered.wait()
        assert answer[0]
    with trio.fail_after(WAIT_GUARD_S):
        await edges.wait_provider("b", lambda p: p["in_flight"] == 0)
        await edges.wait_provider("a", lambda p: p["in_flight"] == 0)
    assert edges.peak() == 2


async def test_capacity_holds_when_edges_race(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Both Edges admit as fast as they can; the Node answers the losers of a race for
    the last slot `busy`, and they wait in their queues instead of failing."""
    edges = await _two_edges(nursery, tmp_path, capacity=2, adapter=FAST)
    results: list[str] = []

    async def caller(stack: Stack) -> None:
        async with stack.client() as client:
            for _ in range(6):
                completion = await client.chat.completions.create(
                    model="m", max_tokens=4, messages=MESSAGES
                )
                results.append(completion.choices[0].finish_reason or "")

    async with trio.open_nursery() as callers:
        for _ in range(4):
            for name in ("a", "b"):
                callers.start_soon(caller, edges.stacks[name])
    assert len(results) == 48
    assert edges.peak() <= 2
    assert edges.node_slots() == {"sim-1": 0}
    for name in ("a", "b"):
        await edges.wait_provider(name, lambda p: p["in_flight"] == 0)
        assert edges.provider(name)["consecutive_failures"] == 0


async def test_an_edge_that_dies_takes_only_its_runs(nursery: trio.Nursery, tmp_path: Path) -> None:
    edges = await _two_edges(nursery, tmp_path, capacity=2, adapter=SLOW)
    a, b = edges.stacks["a"], edges.stacks["b"]
    async with _held_streams(b, 1) as b_streams:
        failed = 0
        async with a.client() as client:
            stream = await client.chat.completions.create(
                model="m", stream=True, max_tokens=1000, messages=MESSAGES
            )
            await stream.__anext__()
            await edges.wait_provider("b", lambda p: p["other_edges_in_flight"] == 1)
            edges.scopes["a"].cancel()  # edge a is gone: sockets closed, no goodbye
            try:
                async for _chunk in stream:
                    pass
            except openai.APIError:
                failed += 1
        assert failed == 1
        # The Node ended a's run and freed its slot; b heard it.
        await edges.wait_provider(
            "b", lambda p: p["other_edges_in_flight"] == 0 and p["in_flight"] == 1
        )
        assert edges.node_slots() == {"sim-1": 1}
        # b's own stream never noticed.
        chunk = await b_streams[0].__anext__()
        assert chunk.choices[0].delta.content is not None
        # and b may now use the whole capacity
        async with _held_streams(b, 1):
            assert edges.node_slots() == {"sim-1": 2}


async def test_goaway_to_an_edge_that_still_accepts_nodes(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The Node links again at once; the Edge keeps the old session for the run on it,
    sends new runs on the new one, and closes the old one when its run is done."""
    edges = await _two_edges(nursery, tmp_path, capacity=2, adapter=SLOW)
    a = edges.stacks["a"]
    async with a.client() as client:
        stream = await client.chat.completions.create(
            model="m", stream=True, max_tokens=20, messages=MESSAGES
        )
        await stream.__anext__()
        sessions = edges.node.sessions
        await a.edge.hub.goaway_all("test")
        with trio.fail_after(WAIT_GUARD_S):
            while edges.node.sessions == sessions:
                await a.edge.wait_pool_change()
            await a.wait_servable("m")
        completion = await client.chat.completions.create(
            model="m", max_tokens=2, messages=MESSAGES
        )
        assert completion.choices[0].finish_reason == "length"
        chunks = [chunk async for chunk in stream]  # the old session's run finishes
        assert chunks[-1].choices[0].finish_reason == "length"
    host = edges.node.host
    assert host is not None
    with trio.fail_after(WAIT_GUARD_S):
        while len(host.statistics().links) != 2:  # the old link to a closed
            await host.wait_changed()
    assert edges.node_slots() == {"sim-1": 0}


async def test_busy_sends_the_run_back_to_the_queue_without_blaming_the_provider(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A hand-driven Node answers the first run `busy` (another Edge won the race for its
    last slot): the Edge counts the provider full until the Node's load report says a
    slot came free, then runs the request; no failover, no cooldown."""
    runs: list[str] = []
    node_ws: list[WebSocketConnection] = []

    async def on_message(ws: WebSocketConnection, message: wire.EdgeToNode) -> None:
        node_ws[:] = [ws]
        if not isinstance(message, wire.Run):
            return
        runs.append(message.run_id)
        if len(runs) == 1:
            busy = wire.RunFailed(
                run_id=message.run_id,
                code=wire.FailureCode.BUSY,
                message="all slots taken",
                retryable=True,
                capacity=True,
            )
            await ws.send_message(wire.encode(wire.RunEvents(ends=[busy])))
            full = wire.ProviderLoad(id="sim-1", in_flight=4)
            await ws.send_message(wire.encode(wire.Load(providers=[full])))
            return
        body = b'{"id":"x","object":"chat.completion","model":"m","choices":[]}'
        done = wire.RunDone(run_id=message.run_id, response=body)
        await ws.send_message(wire.encode(wire.RunEvents(ends=[done])))

    stack = await _hand_driven_stack(nursery, tmp_path, on_message)
    statuses: list[int] = []
    answered = trio.Event()

    async def ask() -> None:
        async with stack.http() as http:
            response = await http.post(
                "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}
            )
            statuses.append(response.status_code)
            answered.set()

    nursery.start_soon(ask)
    await stack.wait_catalog(
        lambda c: c["models"][0]["queued"] == 1 and c["providers"][0]["in_flight"] == 4
    )
    assert runs == [runs[0]] and not statuses
    assert (await stack.catalog())["providers"][0]["other_edges_in_flight"] == 4

    # The other Edge's runs ended: the Node says so.
    await node_ws[0].send_message(
        wire.encode(wire.Load(providers=[wire.ProviderLoad(id="sim-1", in_flight=0)]))
    )
    with trio.fail_after(WAIT_GUARD_S):
        await answered.wait()
    assert statuses == [200]
    assert runs == [runs[0], f"{runs[0]}.1"]
    catalog = await stack.catalog()
    [provider] = catalog["providers"]
    assert provider["consecutive_failures"] == 0 and provider["in_flight"] == 0
    metrics = stack.edge.metrics.registry
    labels = {"model": "m", "provider": "sim-1"}
    assert metrics.get_sample_value("iop_busy_answers_total", labels) == 1
    failovers = [s for m in metrics.collect() for s in m.samples if s.name == "iop_failovers_total"]
    assert failovers == []  # waiting again is no failover (whatever its reason)
