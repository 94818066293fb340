"""An authenticated Node that reports nonsense: the caller is served, the ledger keeps its
row, the Edge corrects what it must and keeps going (design §7)."""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import httpx2
import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from iop_edge.core.node_input import MAX_REPORTED_TOKENS, MAX_TEXT_CHARS
from schemas import wire
from tests.e2e.stack import Stack, one_sim_config, start_stack
from tests.hostile.peers import OnMessage, hand_driven_node
from tests.timing import GUARD_S

RESPONSE = b'{"object":"chat.completion","model":"sim-small","choices":[]}'
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


async def _stack(
    nursery: trio.Nursery, tmp_path: Path, on_message: OnMessage, status: wire.Status | None = None
) -> Stack:
    text = one_sim_config(tmp_path)
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", nodes=())
    await nursery.start(
        lambda task_status: hand_driven_node(
            stack.addresses.node_url, on_message, status=status, task_status=task_status
        )
    )
    await stack.wait_servable("m")
    return stack


async def _rows(stack: Stack) -> list[tuple[int, int, int]]:
    with trio.fail_after(GUARD_S):
        await stack.edge.ledger.wait_flushed()
    with sqlite3.connect(stack.edge.ledger.path) as db:
        return list(db.execute("SELECT status, prompt_tokens, completion_tokens FROM usage"))


def _answering(usage: wire.Usage) -> OnMessage:
    async def on_message(ws: WebSocketConnection, message: wire.EdgeToNode) -> None:
        if isinstance(message, wire.Run):
            done = wire.RunDone(run_id=message.run_id, usage=usage, response=RESPONSE)
            await ws.send_message(wire.encode(wire.RunEvents(ends=[done])))

    return on_message


async def test_negative_and_absurd_token_counts_are_clamped_not_fatal(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    usages = iter(
        [
            wire.Usage(prompt_tokens=-5, completion_tokens=-7, total_tokens=-12),
            wire.Usage(prompt_tokens=2**64 - 1, completion_tokens=2**63, total_tokens=1),
        ]
    )

    async def on_message(ws: WebSocketConnection, message: wire.EdgeToNode) -> None:
        if isinstance(message, wire.Run):
            done = wire.RunDone(run_id=message.run_id, usage=next(usages), response=RESPONSE)
            await ws.send_message(wire.encode(wire.RunEvents(ends=[done])))

    stack = await _stack(nursery, tmp_path, on_message)
    async with stack.http() as http:
        for _ in range(2):
            response = await http.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 200, response.text
        async with stack.admin() as admin:
            assert (await admin.get("/metrics")).status_code == 200
    assert sorted(await _rows(stack)) == [
        (200, 0, 0),
        (200, MAX_REPORTED_TOKENS, MAX_REPORTED_TOKENS),
    ]


async def test_a_failure_with_an_impossible_status_and_a_huge_message(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    async def on_message(ws: WebSocketConnection, message: wire.EdgeToNode) -> None:
        if isinstance(message, wire.Run):
            failed = wire.RunFailed(
                run_id=message.run_id,
                code=wire.FailureCode.UPSTREAM_REJECTED,
                message="x" * 1_000_000,
                status=99999,
            )
            await ws.send_message(wire.encode(wire.RunEvents(ends=[failed])))

    stack = await _stack(nursery, tmp_path, on_message)
    async with stack.http() as http:
        response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 502
    assert len(response.json()["error"]["message"]) < MAX_TEXT_CHARS + 200
    assert [row[0] for row in await _rows(stack)] == [502]


async def test_payloads_nested_past_any_decoder_are_relayed_not_parsed(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The Edge never decodes what a Node relays (the Node shaped it): a payload nested far
    past any decoder's stack passes through as bytes, and only bytes that are not framed
    as events end their run (`bad_chunk`)."""
    deep = b'{"choices":[],"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"

    async def on_message(ws: WebSocketConnection, message: wire.EdgeToNode) -> None:
        if isinstance(message, wire.Run) and message.stream:
            chunks = [(message.run_id, b"data: " + deep + b"\n\n")]
            await ws.send_message(wire.encode(wire.RunEvents(chunks=chunks)))
            chunks = [(message.run_id, deep)]  # not framed as an event
            await ws.send_message(wire.encode(wire.RunEvents(chunks=chunks)))
        elif isinstance(message, wire.Run):
            done = wire.RunDone(run_id=message.run_id, response=deep)
            await ws.send_message(wire.encode(wire.RunEvents(ends=[done])))

    stack = await _stack(nursery, tmp_path, on_message)
    async with stack.http() as http:
        response = await http.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 200 and response.content == deep
        body = {**CHAT, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            events = [line async for line in stream.aiter_lines() if line.startswith("data: ")]
    assert events[0] == "data: " + deep.decode()
    assert '"code":"bad_chunk"' in events[1] and events[-1] == "data: [DONE]"
    assert sorted(row[0] for row in await _rows(stack)) == [200, 502]


async def test_an_oversized_status_report_is_cut(nursery: trio.Nursery, tmp_path: Path) -> None:
    models = ["sim-small", "y" * 10_000, *(f"m{i}" for i in range(20_000))]
    status = wire.Status(
        providers=[
            wire.ProviderStatus(id="sim-1", health="available", models=models, detail="d" * 10**6)
        ]
    )
    stack = await _stack(nursery, tmp_path, _answering(wire.Usage()), status=status)
    catalog = await stack.catalog()
    provider = catalog["providers"][0]
    assert len(provider["discovered_models"]) == 4096
    assert "y" * 10_000 not in provider["discovered_models"]
    async with httpx2.AsyncClient(base_url=stack.addresses.openai_url, timeout=10) as http:
        assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_oversized_model_states_are_cut(nursery: trio.Nursery, tmp_path: Path) -> None:
    states = [
        wire.ModelState(name="sim-small", state="loaded", reason="r" * 10**6),
        wire.ModelState(name="y" * 10_000, state="loaded"),
        *(wire.ModelState(name=f"m{i}", state="unloaded") for i in range(20_000)),
    ]
    status = wire.Status(
        providers=[
            wire.ProviderStatus(
                id="sim-1",
                health="available",
                models=["sim-small"],
                model_states=states,
                max_loaded=-3,
            )
        ]
    )
    stack = await _stack(nursery, tmp_path, _answering(wire.Usage()), status=status)
    provider = (await stack.catalog())["providers"][0]
    assert len(provider["model_states"]) == 4096
    assert provider["model_states"][0]["name"] == "sim-small"
    assert len(provider["model_states"][0]["reason"]) == 8192
    assert provider["max_loaded"] is None
    async with httpx2.AsyncClient(base_url=stack.addresses.openai_url, timeout=10) as http:
        assert (await http.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_a_retry_after_that_is_no_number_still_answers_503_with_one(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """An upstream 429 relayed with NaN seconds: the caller gets the 503 of a busy
    provider with a `Retry-After` that is a number, not a 500."""

    async def on_message(ws: WebSocketConnection, message: wire.EdgeToNode) -> None:
        if isinstance(message, wire.Run):
            failed = wire.RunFailed(
                run_id=message.run_id,
                code=wire.FailureCode.UPSTREAM_BUSY,
                message="busy",
                retryable=True,
                capacity=True,
                status=429,
                retry_after_s=float("nan"),
            )
            await ws.send_message(wire.encode(wire.RunEvents(ends=[failed])))

    stack = await _stack(nursery, tmp_path, on_message)
    async with stack.http() as http:
        response = await http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"].isdigit()


async def test_a_status_naming_providers_it_does_not_own_is_one_quoted_line(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """However many strangers a report names, the Edge logs one line, and a newline in
    an id cannot start a line of its own."""
    own = wire.ProviderStatus(id="sim-1", health="available", models=["sim-small"])
    strangers = [wire.ProviderStatus(id=f"x{n}\nFORGED", health="busy") for n in range(1000)]
    status = wire.Status(providers=[own, *strangers])
    caplog.set_level(logging.WARNING, logger="iop_edge.edge")
    await _stack(nursery, tmp_path, _answering(wire.Usage()), status=status)
    lines = [record.getMessage() for record in caplog.records if "does not own" in record.msg]
    assert len(lines) == 1 and "1000 provider(s)" in lines[0]
    assert "\n" not in lines[0] and "x0\\nFORGED" in lines[0]


async def test_a_final_event_nested_past_any_decoder_keeps_the_responses_socket(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A Responses WebSocket turn whose last event is nested far past the decoders'
    stack: the caller gets the event, and the connection serves its next turn."""
    deep = "[" * 5000 + "]" * 5000
    final = '{"type":"response.completed","response":{"id":"resp_1","x":' + deep + "}}"
    tail = b"event: response.completed\ndata: " + final.encode() + b"\n\n"

    async def on_message(ws: WebSocketConnection, message: wire.EdgeToNode) -> None:
        if isinstance(message, wire.Run):
            done = wire.RunDone(run_id=message.run_id, tail=tail)
            await ws.send_message(wire.encode(wire.RunEvents(ends=[done])))

    stack = await _stack(nursery, tmp_path, on_message)
    url = stack.addresses.openai_url.replace("http://", "ws://") + "/v1/responses"
    turn = json.dumps({"type": "response.create", "model": "m", "input": "x", "store": False})
    async with open_websocket_url(url) as socket:
        for _ in range(2):
            await socket.send_message(turn)
            with trio.fail_after(GUARD_S):
                assert await socket.get_message() == final
