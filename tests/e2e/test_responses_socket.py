"""The Responses API over WebSocket (`iop_edge.http.responses_socket`) through a real Edge
and Node, over real sockets: turns in sequence on one connection, `previous_response_id`
continuing stored and connection-local (`store: false`) responses, the same events as the
HTTP stream, auth at the upgrade, a principal's limits as `error` events, one turn at a
time, and one ledger record per turn."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import yaml
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    WebSocketConnection,
    open_websocket_url,
)

from iop_edge.http import responses_socket
from tests.e2e.stack import (
    WAIT_GUARD_S,
    Stack,
    edge_config,
    principals_section,
    sim_provider,
    start_stack,
)
from tests.protocols.conformance import check_responses_event

TOKEN = "sk-ws-alice-not-a-secret"
_TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


async def _stack(
    nursery: trio.Nursery,
    tmp_path: Path,
    *,
    requests_per_minute: int | None = None,
    tokens_per_second: int = 2000,
    max_conversation_bytes: int | None = None,
) -> Stack:
    config = yaml.safe_load(
        edge_config(
            tmp_path / "state",
            providers=[
                sim_provider(
                    "sim-1", adapter={"ttft_ms": 1, "tokens_per_second": tokens_per_second}
                )
            ],
            models=[{"id": "m", "providers": {"sim-1": "sim-small"}}],
            openai_section=principals_section({"alice": TOKEN}),
        )
    )
    if requests_per_minute is not None:
        config["principals"] = [{"ref": "alice", "requests_per_minute": requests_per_minute}]
    if max_conversation_bytes is not None:
        config["edge"]["responses"] = {"max_conversation_bytes": max_conversation_bytes}
    text = yaml.safe_dump(config, sort_keys=False)
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


@asynccontextmanager
async def _socket(
    stack: Stack, headers: list[tuple[str, str]] | None = None
) -> AsyncIterator[WebSocketConnection]:
    url = stack.addresses.openai_url.replace("http://", "ws://") + "/v1/responses"
    auth = [("Authorization", f"Bearer {TOKEN}")] if headers is None else headers
    extra = [(name.encode(), value.encode()) for name, value in auth]
    async with open_websocket_url(url, extra_headers=extra) as socket:
        yield socket


async def _turn(socket: WebSocketConnection, **body: Any) -> list[dict[str, Any]]:
    """Send one `response.create`; its events up to the terminal one or an error."""
    await socket.send_message(json.dumps({"type": "response.create", "model": "m", **body}))
    events: list[dict[str, Any]] = []
    with trio.fail_after(WAIT_GUARD_S):
        while True:
            event = json.loads(await socket.get_message())
            events.append(event)
            if event["type"] in _TERMINAL or event["type"] == "error":
                return events


def _final(events: list[dict[str, Any]]) -> dict[str, Any]:
    assert events[-1]["type"] in _TERMINAL, events[-1]
    response: dict[str, Any] = events[-1]["response"]
    return response


async def test_turns_continue_stored_and_connection_local_responses(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path)
    async with _socket(stack) as socket:
        first = await _turn(socket, input="Hello.", max_output_tokens=8)
        stored = _final(first)
        assert first[0]["type"] == "response.created"
        assert [event["sequence_number"] for event in first] == list(range(len(first)))
        for event in first:
            check_responses_event(event)
        second = _final(
            await _turn(
                socket,
                input="And then?",
                previous_response_id=stored["id"],
                store=False,
                max_output_tokens=8,
            )
        )
        assert second["previous_response_id"] == stored["id"] and second["store"] is False
        # an unstored response continues on its own connection: the Edge kept it there
        third = _final(
            await _turn(
                socket,
                input="Go on.",
                previous_response_id=second["id"],
                store=False,
                max_output_tokens=8,
            )
        )
        assert third["previous_response_id"] == second["id"]
        # the whole conversation went to the model: three turns' input, two replies
        assert third["usage"]["input_tokens"] > second["usage"]["input_tokens"]
    # ... and nowhere else: not over HTTP, not on another connection
    async with stack.http() as http:
        answer = await http.post(
            "/v1/responses",
            json={"model": "m", "input": "x", "previous_response_id": second["id"]},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
    assert answer.status_code == 404
    async with _socket(stack) as socket:
        [error] = await _turn(socket, input="x", previous_response_id=second["id"])
        assert error["type"] == "error" and error["status"] == 404
        assert error["error"]["code"] == "previous_response_not_found"
        # the connection goes on after an error
        assert _final(await _turn(socket, input="x", max_output_tokens=4))["model"] == "m"
    assert await stack.requests_by_protocol() == {"responses": 4}  # one record per turn


async def test_a_turn_that_made_no_response_leaves_the_conversation_to_continue(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A turn answered with an `error` event alone, refused on the Edge or failed on the
    Node before its stream began, made no response: the connection's unstored
    conversation stays, and the caller may send the turn again."""
    stack = await _stack(nursery, tmp_path)
    async with _socket(stack) as socket:
        first = _final(await _turn(socket, input="Hello.", store=False, max_output_tokens=8))
        continued = {"previous_response_id": first["id"], "store": False, "max_output_tokens": 8}
        [refused] = await _turn(socket, input="x", temperature=9, **continued)
        assert (refused["type"], refused["status"]) == ("error", 400)  # the Edge's
        orphan = [{"type": "function_call_output", "call_id": "nope", "output": "42"}]
        [failed] = await _turn(socket, input=orphan, **continued)
        assert (failed["type"], failed["status"]) == ("error", 400)  # the Node's
        assert "nope" in failed["error"]["message"]
        again = _final(await _turn(socket, input="Go on.", **continued))
        assert again["previous_response_id"] == first["id"]


async def test_a_connection_local_conversation_is_bounded_as_a_stored_one(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path, max_conversation_bytes=5_000)
    text = "A long paragraph of context. " * 80  # 2,320 bytes
    async with _socket(stack) as socket:
        previous = None
        for _ in range(2):
            turn = await _turn(
                socket,
                input=text,
                previous_response_id=previous,
                store=False,
                max_output_tokens=4,
            )
            previous = _final(turn)["id"]
        [error] = await _turn(socket, input=text, previous_response_id=previous, store=False)
        assert error["status"] == 400
        assert error["error"]["code"] == "conversation_too_large"
        assert error["error"]["param"] == "previous_response_id"
        assert "edge.responses.max_conversation_bytes" in error["error"]["message"]
        assert _final(await _turn(socket, input="x", max_output_tokens=4))["model"] == "m"


async def test_a_warm_up_generates_nothing_and_the_next_turn_continues_it(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """`generate: false` (as Codex opens a session): a Response with no output at once,
    no run; the turn that names it reads its input."""
    stack = await _stack(nursery, tmp_path)
    instructions = "Answer in the fewest words a careful reader needs, and no more. " * 8
    async with _socket(stack) as socket:
        warm = await _turn(socket, instructions=instructions, input=[], store=False, generate=False)
        assert [event["type"] for event in warm] == ["response.created", "response.completed"]
        for event in warm:
            check_responses_event(event)
        warmed = _final(warm)
        assert warmed["status"] == "completed" and warmed["output"] == []
        assert warmed["usage"]["output_tokens"] == 0 and warmed["store"] is False
        turn = _final(
            await _turn(
                socket,
                instructions=instructions,
                input="Hello.",
                previous_response_id=warmed["id"],
                store=False,
                max_output_tokens=8,
            )
        )
        assert turn["previous_response_id"] == warmed["id"] and turn["output"]
        # a warm-up that asks for a summary, or says `generate` in another type, is refused
        trigger = [{"type": "compaction_trigger"}]
        for refused, param in [({"input": trigger}, "generate"), ({"input": "x"}, "generate")]:
            generate: Any = False if refused["input"] is trigger else "no"
            [error] = await _turn(socket, **refused, generate=generate)
            assert error["type"] == "error" and error["error"]["param"] == param
        # stored when `store` asks: another connection, and HTTP, continue it
        stored = _final(await _turn(socket, input="Remember this.", generate=False))
        assert stored["store"] is True
    async with stack.http() as http:
        answer = await http.post(
            "/v1/responses",
            json={"model": "m", "input": "And?", "previous_response_id": stored["id"]},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
    assert answer.status_code == 200, answer.text
    assert await stack.requests_by_protocol() == {"responses": 2}  # warm-ups run nothing


async def test_a_compaction_turn_that_was_not_stored_continues_on_its_connection(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path)
    async with _socket(stack) as socket:
        first = _final(await _turn(socket, input="Tell me about cats.", store=False))
        compacted = _final(
            await _turn(
                socket,
                input=[{"type": "compaction_trigger"}],
                previous_response_id=first["id"],
                store=False,
            )
        )
        assert [item["type"] for item in compacted["output"]] == ["compaction"]
        after = _final(
            await _turn(
                socket,
                input="Go on.",
                previous_response_id=compacted["id"],
                store=False,
                max_output_tokens=8,
            )
        )
        assert after["previous_response_id"] == compacted["id"] and after["output"]


async def test_the_events_are_the_http_streams(nursery: trio.Nursery, tmp_path: Path) -> None:
    stack = await _stack(nursery, tmp_path)
    body = {"model": "m", "input": "Say something.", "max_output_tokens": 6, "store": False}
    async with stack.http() as http:
        answer = await http.post(
            "/v1/responses",
            json={**body, "stream": True},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
    over_http = [
        json.loads(line[len("data: ") :])
        for line in answer.text.splitlines()
        if line.startswith("data: ")
    ]
    async with _socket(stack) as socket:
        over_socket = await _turn(socket, **{k: v for k, v in body.items() if k != "model"})

    def shape(events: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
        return [(e["type"], e["sequence_number"], e.get("delta", "")) for e in events]

    assert shape(over_socket) == shape(over_http)

    def text(events: list[dict[str, Any]]) -> list[Any]:
        return [item["content"] for item in _final(events)["output"]]

    assert text(over_socket) == text(over_http) and text(over_http)


async def test_the_upgrade_needs_the_callers_token(nursery: trio.Nursery, tmp_path: Path) -> None:
    stack = await _stack(nursery, tmp_path)
    for headers in ([], [("Authorization", "Bearer sk-wrong")], [("x-api-key", "sk-wrong")]):
        with pytest.raises(ConnectionRejected) as refused:
            async with _socket(stack, headers):
                pass
        assert refused.value.status_code == 401 and refused.value.body is not None
        assert (
            json.loads(refused.value.body)["error"]["type"] == "invalid_request_error"
            or (json.loads(refused.value.body)["error"]["code"])
        )
    async with _socket(stack, [("x-api-key", TOKEN)]) as socket:
        assert _final(await _turn(socket, input="x", max_output_tokens=4))["model"] == "m"


async def test_a_principal_at_its_limit_gets_an_error_event(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path, requests_per_minute=1)
    async with _socket(stack) as socket:
        assert _final(await _turn(socket, input="x", max_output_tokens=4))
        for _ in range(2):  # refused, and the connection stays usable
            [error] = await _turn(socket, input="x", max_output_tokens=4)
            assert error["type"] == "error" and error["status"] == 429
            assert error["error"]["type"] == "rate_limit_error" or error["error"]["code"]
    # as over HTTP, a request refused at admission is no run: the ledger has the one
    assert await stack.requests_by_protocol() == {"responses": 1}


async def test_one_turn_at_a_time_and_bad_events(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stack = await _stack(nursery, tmp_path, tokens_per_second=2)  # a turn of 10 s
    async with _socket(stack) as socket:
        await socket.send_message(json.dumps({"type": "response.cancel"}))
        unsupported = json.loads(await socket.get_message())
        assert unsupported["type"] == "error" and unsupported["status"] == 400
        assert unsupported["error"]["code"] == "unsupported_event"
        await socket.send_message("{not json")
        assert json.loads(await socket.get_message())["error"]["code"] == "invalid_json"
        deep = '{"type": "response.create", "input": ' + "[" * 100 + "]" * 100 + "}"
        await socket.send_message(deep)  # refused before anything walks it, as over HTTP
        too_deep = json.loads(await socket.get_message())["error"]
        assert too_deep["code"] == "invalid_json" and "nests deeper" in too_deep["message"]
        await socket.send_message(
            json.dumps({"type": "response.create", "model": "m", "background": True})
        )
        background = json.loads(await socket.get_message())["error"]
        assert background["code"] == "unsupported_parameter"
        assert background["param"] == "background"
        create = {"type": "response.create", "model": "m", "input": "x", "max_output_tokens": 20}
        await socket.send_message(json.dumps(create))
        with trio.fail_after(WAIT_GUARD_S):
            assert json.loads(await socket.get_message())["type"] == "response.created"
            await socket.send_message(json.dumps(create))
            while True:
                event = json.loads(await socket.get_message())
                assert event["type"] not in _TERMINAL
                if event["type"] == "error":
                    break
        assert event["error"]["code"] == "conversation_already_has_active_response"
    # hanging up ends the running turn: it is metered as the caller leaving
    assert await stack.requests_by_protocol() == {"responses": 1}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_a_message_over_the_size_limit_closes_with_1009(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await _stack(nursery, tmp_path)
    limit = stack.edge.snapshot.config.openai.max_request_bytes
    async with _socket(stack) as socket:
        big = json.dumps({"type": "response.create", "model": "m", "input": "x" * (limit + 1)})
        await socket.send_message(big)
        with trio.fail_after(WAIT_GUARD_S):
            error = json.loads(await socket.get_message())
            assert error["status"] == 413 and error["error"]["code"] == "request_too_large"
            with pytest.raises(ConnectionClosed) as closed:
                await socket.get_message()
    reason = closed.value.reason
    assert reason is not None and reason.code == 1009


async def test_a_connection_ends_at_its_time_limit(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At its limit (60 minutes; shortened here) the connection gets an error event and a
    normal close, after the turns it ran."""
    stack = await _stack(nursery, tmp_path)
    monkeypatch.setattr(responses_socket, "MAX_CONNECTION_S", 0.5)
    async with _socket(stack) as socket:
        with trio.fail_after(WAIT_GUARD_S):
            error = json.loads(await socket.get_message())
            assert error["type"] == "error"
            assert error["error"]["code"] == "websocket_connection_limit_reached"
            with pytest.raises(ConnectionClosed) as closed:
                await socket.get_message()
    reason = closed.value.reason
    assert reason is not None and reason.code == 1000


async def test_a_damaged_compaction_is_named_in_the_turns_own_input(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """An unstored response continued on its connection puts its conversation before the
    turn's input; the error still counts the caller's own items."""
    stack = await _stack(nursery, tmp_path)
    two = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    async with _socket(stack) as socket:
        first = (await _turn(socket, input=two, store=False))[-1]["response"]
        damaged = {"type": "compaction", "encrypted_content": "iopc1.YQ.AAAA"}
        [refused] = await _turn(
            socket, input=[damaged], previous_response_id=first["id"], store=False
        )
    assert refused["type"] == "error"
    assert (refused["error"]["code"], refused["error"]["param"]) == (
        "invalid_compaction",
        "input[0].encrypted_content",
    )


async def test_a_turn_that_meets_a_bug_of_ours_is_its_error_event(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn that fails on the Edge's own defect ends with an `error` event (a 500 over
    HTTP) and the connection serves the next turn; a caller's namespace tool whose `tools`
    is no list is echoed by a warm-up as it came."""
    stack = await _stack(nursery, tmp_path)
    real = responses_socket.input_items
    calls = 0

    def input_items_once_broken(items: Any) -> list[Any]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a defect")
        return real(items)

    monkeypatch.setattr(responses_socket, "input_items", input_items_once_broken)
    namespace = [{"type": "namespace", "name": "ns", "tools": 5}]
    async with _socket(stack) as socket:
        failed = await _turn(socket, input="x")
        assert failed[-1]["type"] == "error"
        assert (failed[-1]["status"], failed[-1]["error"]["code"]) == (500, "internal_error")
        warm = await _turn(socket, input="y", store=False, generate=False, tools=namespace)
        assert _final(warm)["tools"] == namespace
        refused = await _turn(socket, input=[{"type": [], "role": "user", "content": "hi"}])
        assert refused[-1]["error"]["param"] == "input[0].type"
        assert _final(await _turn(socket, input="z"))["id"].startswith("resp_")
