"""What a Node session, a caller's connection and a replaced snapshot leave behind is
freed by reference counting alone: the Edge keeps its heap out of the cyclic collector's
sight (`runtime.lifecycle.heap`), and a reference cycle among them would wait for a full
collection, a pause of seconds with a large fleet.

Each test runs with the collector disabled (`no_collector`): an object in a cycle is then
never freed, and its finalizer never runs. A test waits for the finalizers of the objects
it watches (`Freed`), so one that leaks fails at the guard, naming what stayed alive."""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import trio
import yaml

from iop_edge.http.connection import Connection
from iop_edge.runtime.nodes.session import NodeSession
from iop_edge.runtime.runs.dispatch import Dispatcher, Run, RunPlan
from tests.e2e.stack import (
    Stack,
    hang_up_after,
    one_sim_config,
    open_silent_node,
    start_slow_stack,
    start_stack,
)
from tests.timing import GUARD_S


@pytest.fixture
def no_collector(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The cyclic collector off for the test (restored after), and `gc.collect` a no-op
    (the Edge's heap keeper collects on its own): only reference counting frees
    anything."""
    enabled = gc.isenabled()
    gc.disable()
    monkeypatch.setattr(gc, "collect", lambda generation=2: 0)
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Freed:
    """Finalizers on watched objects; `wait` returns once every one was freed."""

    def __init__(self) -> None:
        self._alive: dict[int, str] = {}
        self.watched: list[str] = []
        """The names of everything watched."""
        self._all_freed = trio.Event()
        self._all_freed.set()

    def watch(self, thing: object, name: str) -> None:
        key = len(self._alive) + id(self)
        while key in self._alive:
            key += 1
        self._alive[key] = name
        self.watched.append(name)
        self._all_freed = trio.Event()
        weakref.finalize(thing, self._freed, key)

    def _freed(self, key: int) -> None:
        self._alive.pop(key, None)
        if not self._alive:
            self._all_freed.set()

    async def wait(self) -> None:
        with trio.move_on_after(GUARD_S):
            await self._all_freed.wait()
        assert not self._alive, f"still alive, with the collector off: {self._alive}"


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> Freed:
    """Watches every caller connection the Edge serves and every run it makes."""
    freed = Freed()
    run = Connection.run

    async def watched_run(connection: Connection) -> None:
        freed.watch(connection, "a caller's connection (iop_edge.http.connection)")
        await run(connection)

    monkeypatch.setattr(Connection, "run", watched_run)
    init = Run.__init__

    def watched_init(run: Run, plan: RunPlan, dispatcher: Dispatcher) -> None:
        init(run, plan, dispatcher)
        freed.watch(run, f"the Edge's Run of {plan.operation} {plan.model_id}")

    monkeypatch.setattr(Run, "__init__", watched_init)
    return freed


async def _session_of(stack: Stack, node_id: str = "node-1") -> NodeSession:
    with trio.fail_after(GUARD_S):
        while (session := stack.edge.hub.session(node_id)) is None:
            await stack.edge.wait_pool_change()
    return session


def _watch_session(freed: Freed, session: NodeSession) -> None:
    freed.watch(session, "the Edge's NodeSession")
    freed.watch(session.websocket, "its WebSocketConnection")


async def _gone(stack: Stack, node_id: str = "node-1") -> None:
    with trio.fail_after(GUARD_S):
        while node_id in stack.edge.connected_nodes():
            await stack.edge.wait_pool_change()


async def _one_request(stack: Stack) -> None:
    async with stack.client() as client:
        reply = await client.chat.completions.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert reply.usage is not None and reply.usage.completion_tokens == 2


@pytest.mark.parametrize("ending", ["node closes", "edge closes", "replaced by a reconnect"])
async def test_an_ended_node_session_is_freed_by_reference_counting(
    no_collector: None, nursery: trio.Nursery, tmp_path: Path, ending: str
) -> None:
    stack = await start_stack(
        nursery, one_sim_config(tmp_path), tmp_path / "edge.yaml", wait_models=("m",)
    )
    await _one_request(stack)  # a run went over the session
    session = await _session_of(stack)
    freed = Freed()
    _watch_session(freed, session)
    if ending == "node closes":
        stack.kill_node()
        await _gone(stack)
    elif ending == "edge closes":
        session.abort("closed by the test")
        await _gone(stack)
    else:
        await stack.start_node("node-1")  # the same id again: the old session is replaced
        with trio.fail_after(GUARD_S):
            while stack.edge.hub.session("node-1") is session:
                await stack.edge.wait_pool_change()
    del session
    await freed.wait()
    # The hub told the heap keeper of the end, and its finalizer saw the session freed
    # (a replaced Node may link again meanwhile: a session of its may be ending).
    assert stack.edge.heap.statistics().sessions_leaked == 0
    assert stack.edge.heap.watching() == 0 or ending == "replaced by a reconnect"
    async with stack.admin() as admin:
        metrics = (await admin.get("/metrics")).text
    assert "iop_heap_sessions_leaked_total 0.0" in metrics
    assert "iop_heap_thaws_total 0.0" in metrics


async def test_a_session_dropped_for_a_missed_heartbeat_is_freed_by_reference_counting(
    no_collector: None, nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await start_stack(
        nursery,
        one_sim_config(tmp_path),
        tmp_path / "edge.yaml",
        nodes=(),
        edge_kwargs={"heartbeat_s": 0.05, "heartbeat_timeout_s": 0.2},
    )
    stream = await open_silent_node(stack)
    session = await _session_of(stack)
    freed = Freed()
    _watch_session(freed, session)
    del session
    await _gone(stack)  # we never read: the Edge's pings go unanswered
    await freed.wait()
    await stream.aclose()


async def test_the_snapshot_a_refresh_replaced_is_freed_by_reference_counting(
    no_collector: None, nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A live change pushed to the Node (removing a Node needs a restart: a refresh never
    ends a session)."""
    text = one_sim_config(tmp_path)
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    # Slotted: no weak reference to it; its reference count instead, held in a list only
    # (a frame's locals may be copied to a dict, which would count).
    replaced = [stack.edge.snapshot]
    candidate: dict[str, Any] = yaml.safe_load(text)
    candidate["nodes"][0]["providers"][0]["capacity"] += 1
    async with stack.admin() as admin:
        response = await admin.post(
            "/refresh", json={"mode": "apply", "config_yaml": yaml.safe_dump(candidate)}
        )
    assert response.status_code == 200, response.text
    assert [node["status"] for node in response.json()["nodes"]] == ["applied"]
    await _one_request(stack)  # on the new snapshot
    swapped = stack.edge.snapshot is not replaced[0]
    # Only the list refers to the replaced snapshot (and `getrefcount`'s argument):
    # emptying it frees the snapshot. (Counted outside an assert: pytest's rewritten
    # asserts keep their operands in the frame.)
    references = sys.getrefcount(replaced[0])
    assert swapped
    assert references == 2


async def test_a_callers_finished_requests_and_connections_are_freed_by_reference_counting(
    no_collector: None, nursery: trio.Nursery, tmp_path: Path, requests: Freed
) -> None:
    stack = await start_stack(
        nursery, one_sim_config(tmp_path), tmp_path / "edge.yaml", wait_models=("m",)
    )
    async with stack.client() as client:
        reply = await client.chat.completions.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
        stream = await client.chat.completions.create(
            model="m", max_tokens=4, stream=True, messages=[{"role": "user", "content": "hi"}]
        )
        chunks = [chunk async for chunk in stream]
        with pytest.raises(openai.NotFoundError):  # a refused request, too
            await client.chat.completions.create(
                model="no-such-model", messages=[{"role": "user", "content": "hi"}]
            )
    assert reply.usage is not None and reply.usage.completion_tokens == 2
    assert chunks
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(2):  # a connection a request, closed by the caller once answered
        async with stack.http() as http:
            response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
    assert {"connection", "Run"} <= {word for name in requests.watched for word in name.split()}
    await requests.wait()


async def test_a_caller_that_hangs_up_mid_stream_leaves_nothing_for_the_collector(
    no_collector: None, nursery: trio.Nursery, tmp_path: Path, requests: Freed
) -> None:
    stack = await start_slow_stack(nursery, tmp_path)
    async with stack.client() as client:
        stream = await client.chat.completions.create(
            model="m", max_tokens=50, stream=True, messages=[{"role": "user", "content": "hi"}]
        )
        await hang_up_after(stream, 1)  # the run is cancelled on the Node, the slot freed
    await requests.wait()
