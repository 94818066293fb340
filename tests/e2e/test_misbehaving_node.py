"""A Node that sends garbage cannot break a caller's stream, leak a slot or lie in metering."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import httpx2
import trio
from trio_websocket import WebSocketConnection

from schemas import wire
from tests.e2e.stack import Stack, one_sim_config, start_stack
from tests.hostile.peers import OnMessage, hand_driven_node
from tests.timing import GUARD_S

GOOD_EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}],"model":"m"}\n\n'


async def _stack(nursery: trio.Nursery, tmp_path: Path, on_message: OnMessage) -> Stack:
    text = one_sim_config(tmp_path)
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", nodes=())
    await nursery.start(hand_driven_node, stack.addresses.node_url, on_message)
    await stack.wait_servable("m")
    return stack


async def _statuses(stack: Stack) -> list[int]:
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    with sqlite3.connect(stack.edge.ledger.path) as db:
        return [row[0] for row in db.execute("SELECT status FROM usage")]


async def test_bad_chunk_ends_the_stream_with_an_error_and_cancels_the_run(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    cancelled = trio.Event()

    async def on_message(ws: WebSocketConnection, message: wire.EdgeToNode) -> None:
        if isinstance(message, wire.Run):
            for data in (GOOD_EVENT, b"not framed as events"):
                batch = wire.RunEvents(chunks=[(message.run_id, data)])
                await ws.send_message(wire.encode(batch))
        elif isinstance(message, wire.Cancel):
            cancelled.set()

    stack = await _stack(nursery, tmp_path, on_message)
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    async with stack.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[0] == 'data: {"choices":[{"index":0,"delta":{"content":"hi"}}],"model":"m"}'
    assert '"code":"bad_chunk"' in events[1]
    assert events[2:] == ["data: [DONE]"]
    with trio.fail_after(GUARD_S):
        await cancelled.wait()  # the Node still ran it: the Edge told it to stop
    assert stack.edge.scheduler.statistics().providers["sim-1"].in_flight == 0
    assert await _statuses(stack) == [502]


async def test_a_malformed_batch_ends_only_its_own_run(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Two streams share each batch; one run's bytes are broken, the other's flow on."""
    runs: dict[str, str] = {}  # "good"/"bad" -> run id

    async def on_message(ws: WebSocketConnection, message: wire.EdgeToNode) -> None:
        if not isinstance(message, wire.Run):
            return
        runs["bad" if b'"bad"' in message.body else "good"] = message.run_id
        if len(runs) < 2:
            return
        good, bad = runs["good"], runs["bad"]
        batch = wire.RunEvents(chunks=[(good, GOOD_EVENT), (bad, b"garbage")])
        await ws.send_message(wire.encode(batch))
        ends = [wire.RunDone(run_id=good), wire.RunDone(run_id=bad)]
        await ws.send_message(wire.encode(wire.RunEvents(chunks=[(good, GOOD_EVENT)], ends=ends)))

    stack = await _stack(nursery, tmp_path, on_message)

    async def stream(content: str, into: list[str]) -> None:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": content}]}
        async with (
            stack.http() as http,
            http.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            into.extend([line async for line in r.aiter_lines() if line.startswith("data: ")])

    good_events: list[str] = []
    bad_events: list[str] = []
    async with trio.open_nursery() as callers:
        callers.start_soon(stream, "good", good_events)
        callers.start_soon(stream, "bad", bad_events)
    assert good_events == [GOOD_EVENT.decode().strip()] * 2 + ["data: [DONE]"]
    assert '"code":"bad_chunk"' in bad_events[0] and bad_events[1:] == ["data: [DONE]"]
    assert sorted(await _statuses(stack)) == [200, 502]


async def test_last_events_not_framed_as_events_end_the_stream_with_an_error(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The last events a run's end carries (`run_done.tail`) are checked as its chunks are:
    unframed, they never reach the caller, whose stream ends with the Edge's error."""
    start = b'event: message_start\ndata: {"type":"message_start","message":{}}\n\n'
    held: list[bool] = []

    async def on_message(ws: WebSocketConnection, message: wire.EdgeToNode) -> None:
        if isinstance(message, wire.Run):
            held.append(message.hold_tail)
            done = wire.RunDone(run_id=message.run_id, usage=wire.Usage(), tail=b"<oops>")
            batch = wire.RunEvents(chunks=[(message.run_id, start)], ends=[done])
            await ws.send_message(wire.encode(batch))

    stack = await _stack(nursery, tmp_path, on_message)
    body = {
        "model": "m",
        "max_tokens": 4,
        "stream": True,
        "messages": [{"role": "user", "content": "x"}],
    }
    async with stack.http() as http, http.stream("POST", "/v1/messages", json=body) as r:
        text = b"".join([part async for part in r.aiter_bytes()])
    assert held == [True]  # a stream asks the Node to hold its last events for its end
    assert text.startswith(start) and b"<oops>" not in text
    assert text[len(start) :].startswith(b"event: error\n") and b"bad_chunk" in text
    assert await _statuses(stack) == [502]


async def test_bad_non_stream_response_is_a_502_and_metered_as_such(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    async def on_message(ws: WebSocketConnection, message: wire.EdgeToNode) -> None:
        if isinstance(message, wire.Run):
            done = wire.RunDone(run_id=message.run_id, response=b"<html>oops</html>")
            await ws.send_message(wire.encode(wire.RunEvents(ends=[done])))

    stack = await _stack(nursery, tmp_path, on_message)
    async with httpx2.AsyncClient(base_url=stack.addresses.openai_url, timeout=10) as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "bad_response"
    assert await _statuses(stack) == [502]


async def test_a_node_that_reports_no_usage_still_gets_its_runs_metered(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """An older Node sends no usage: the Edge estimates from what it relayed (one token
    per chunk, a whole answer by its text) and flags the records `estimated`."""

    async def on_message(ws: WebSocketConnection, message: wire.EdgeToNode) -> None:
        if not isinstance(message, wire.Run):
            return
        if message.stream:
            # three events: one batch with two, one with one
            for events in (GOOD_EVENT * 2, GOOD_EVENT):
                batch = wire.RunEvents(chunks=[(message.run_id, events)])
                await ws.send_message(wire.encode(batch))
            ends = [wire.RunDone(run_id=message.run_id)]
            await ws.send_message(wire.encode(wire.RunEvents(ends=ends)))
        else:
            answer = b'{"choices":[{"index":0,"message":{"content":"' + b"x" * 40 + b'"}}]}'
            done = wire.RunDone(run_id=message.run_id, response=answer)
            await ws.send_message(wire.encode(wire.RunEvents(ends=[done])))

    stack = await _stack(nursery, tmp_path, on_message)
    # 3 tokens of text + the template (5 a message, 3 a request, 20 implied system) = 31
    messages = [{"role": "user", "content": "x" * 12}]
    async with httpx2.AsyncClient(base_url=stack.addresses.openai_url, timeout=10) as http:
        for stream in (True, False):
            body = {"model": "m", "messages": messages, "stream": stream}
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    with sqlite3.connect(stack.edge.ledger.path) as db:
        rows = db.execute(
            "SELECT prompt_tokens, completion_tokens, usage_source FROM usage ORDER BY time"
        ).fetchall()
    assert rows == [(31, 3, "estimated"), (31, 10, "estimated")]
    # Prometheus tells the estimated part of the token counts apart (all of it, here).
    stack.edge.books.settle()  # the metrics of runs that ended are entered in batches
    metrics = stack.edge.metrics.registry
    for kind, tokens in (("prompt", 62), ("completion", 13)):
        for name in ("iop_tokens_total", "iop_estimated_tokens_total"):
            samples = [
                sample.value
                for metric in metrics.collect()
                for sample in metric.samples
                if sample.name == name and sample.labels.get("kind") == kind
            ]
            assert sum(samples) == tokens, (name, kind)
