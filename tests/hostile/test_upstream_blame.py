"""Hostile upstreams: a runtime whose reply cannot be relayed as it is, one that answers
one request shape with nothing, one that restarts, one that names its own address, one
that gives every response the same id, one that fails every request. What the caller
gets is a clean error in its own protocol, without the Edge's topology; no caller's
request takes a model offline for the others; stored responses never collide; and a
runtime's failures spend none of the caller's request limit."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import trio
import yaml

from tests.adapters.fake_protocols import responses_response
from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import edge_config, principals_section, start_native_upstream, start_stack
from tests.e2e.upstreams import (
    ALIAS,
    MESSAGES,
    MakeStack,
    RunningUpstream,
    provider_of,
    upstream_provider,
    upstream_stacks,
    wait_idle,
)
from tests.timing import GUARD_S

ALICE = "sk-alice-hostile-not-a-secret"


@pytest.fixture
async def make_stack(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[MakeStack]:
    async with upstream_stacks(nursery, tmp_path) as make:
        yield make


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return json.dumps({"id": "c1", "object": "chat.completion.chunk", "choices": [choice]}).encode()


def _tool_call_stream(arguments: list[str]) -> list[bytes]:
    """A streamed tool call whose argument fragments are `arguments`, as they came."""
    first = {"index": 0, "id": "call_1", "function": {"name": "read_file", "arguments": ""}}
    chunks = [_chunk({"role": "assistant", "tool_calls": [first]})]
    chunks += [
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        for piece in arguments
    ]
    return [*chunks, _chunk({}, "tool_calls")]


MALFORMED = ['{"path": ', '"a.txt"']  # never closed: not JSON


async def test_malformed_tool_arguments_end_a_translated_stream_with_an_error_event(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """The whole reply is a 502; the stream, already under way when the arguments turn
    out to be no JSON, ends with the caller's protocol's error event, never a stop."""
    fake = FakeUpstream(scripted=lambda payload: _tool_call_stream(MALFORMED))
    stack = await make_stack([upstream_provider("gpu", await nursery.start(fake.serve))])
    tools: Any = [{"name": "read_file", "input_schema": {"type": "object"}}]
    async with anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url, api_key="open", max_retries=0
    ) as client:
        seen: list[str] = []
        with trio.fail_after(GUARD_S), pytest.raises(anthropic.APIStatusError) as caught:
            stream = await client.messages.create(
                model=ALIAS,
                max_tokens=40,
                messages=[{"role": "user", "content": "read a.txt"}],
                tools=tools,
                stream=True,
            )
            async for event in stream:
                seen.append(event.type)
    assert "message_stop" not in seen and "message_delta" not in seen
    body = caught.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "api_error"
    assert "not a JSON object" in body["error"]["message"]
    async with stack.client() as openai_client:
        with trio.fail_after(GUARD_S):
            events = await openai_client.responses.create(
                model=ALIAS,
                input="read a.txt",
                tools=[{"type": "function", "name": "read_file", "parameters": {}}],
                stream=True,
            )
            kinds = [event.type async for event in events]
    assert kinds[-1] == "response.failed" and "response.completed" not in kinds
    await wait_idle(stack)


# --- what a caller's error says ---------------------------------------------------------


async def test_no_caller_error_names_a_provider_a_node_or_an_address(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """Whatever fails, a caller's error body names no provider, node, host or port (the
    Edge's log has them, under the request id the body ends with)."""
    gone = RunningUpstream(FakeUpstream(), nursery)
    gone_url = await gone.start()
    broken = FakeUpstream(status=500)
    broken_url = await nursery.start(broken.serve)
    broken.error_message = f"the backend at {broken_url} and 127.0.0.1:9 said no"
    providers = [
        upstream_provider("gpu1-llama", gone_url, priority=1),
        upstream_provider("gpu2-llama", broken_url, priority=2),
    ]
    stack = await make_stack(providers, dispatch={"cooldown": {"failures": 1, "seconds": 60}})
    await gone.stop()
    bodies: list[tuple[str, str]] = []
    async with stack.http() as http:
        for path, body in (
            (
                "/v1/chat/completions",
                {"model": ALIAS, "messages": [{"role": "user", "content": "x"}]},
            ),
            (
                "/v1/chat/completions",
                {"model": ALIAS, "stream": True, "messages": [{"role": "user", "content": "x"}]},
            ),
            (
                "/v1/messages",
                {"model": ALIAS, "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
            ),
            ("/v1/responses", {"model": ALIAS, "input": "x", "stream": True}),
        ):
            with trio.fail_after(GUARD_S):
                response = await http.post(path, json=body)
            assert response.status_code in (502, 503), response.text
            bodies.append((response.headers["x-request-id"], response.text))
    for request_id, text in bodies:
        assert f"request id {request_id}" in text, text
        for secret in ("gpu1-llama", "gpu2-llama", "node-1", "127.0.0.1", f":{gone.port}"):
            assert secret not in text, (secret, text)
    assert "said no" in bodies[0][1]  # the upstream's own words stay


# --- empty replies: the request's shape or the provider ----------------------------------


def _empty_when_tools_are_offered(payload: dict[str, Any]) -> list[bytes] | None:
    """llama-cpp-python's function calling with `tool_choice: "auto"`: an empty 200."""
    return [] if payload.get("tools") else None


async def test_one_request_shape_answered_with_nothing_takes_no_model_offline(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(scripted=_empty_when_tools_are_offered)
    stack = await make_stack(
        [upstream_provider("llama", await nursery.start(fake.serve))],
        dispatch={"cooldown": {"failures": 2, "seconds": 60}},
    )
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    async with stack.client() as client:
        for _ in range(5):  # a client retrying the one request its runtime cannot answer
            with trio.fail_after(GUARD_S), pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(
                    model=ALIAS, messages=MESSAGES, tools=tools, tool_choice="auto", stream=True
                )
            assert caught.value.status_code == 502
        entry = provider_of(await stack.catalog(), "llama")
        assert (entry["cooling_down"], entry["consecutive_failures"]) == (False, 0)
        with trio.fail_after(GUARD_S):  # everyone else is served
            answer = await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
    assert answer.choices[0].message.content
    await wait_idle(stack)


async def test_a_runtime_that_answers_everything_with_nothing_does_cool_down(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    fake = FakeUpstream(empty_streams=True)
    stack = await make_stack(
        [upstream_provider("llama", await nursery.start(fake.serve))],
        dispatch={"cooldown": {"failures": 2, "seconds": 60}},
    )
    async with stack.client() as client:
        for n in range(2):  # two different requests fail the same way
            with trio.fail_after(GUARD_S), pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(
                    model=ALIAS, messages=[{"role": "user", "content": f"q{n}"}], stream=True
                )
            assert caught.value.status_code == 502
        assert provider_of(await stack.catalog(), "llama")["cooling_down"] is True
        with trio.fail_after(GUARD_S), pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
    assert caught.value.status_code == 503
    await wait_idle(stack)


# --- a runtime that restarts ------------------------------------------------------------


async def test_a_runtime_that_is_back_serves_at_once_not_at_the_next_periodic_probe(
    nursery: trio.Nursery, make_stack: MakeStack
) -> None:
    """The periodic probe is an hour away: only a probe on demand can find the runtime
    back. While it is still down, callers are refused at once, as before."""
    upstream = RunningUpstream(FakeUpstream(), nursery)
    base_url = await upstream.start()
    await upstream.stop()  # the runtime restarts: down when the Node first probes it
    stack = await make_stack(
        [upstream_provider("llama", base_url, health_interval_s=3600.0)], wait=False
    )
    await stack.wait_catalog(lambda c: provider_of(c, "llama")["health"] == "unavailable")
    async with stack.client() as client:
        with trio.fail_after(GUARD_S), pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
        assert caught.value.status_code == 503
        assert caught.value.code == "no_provider"
        await upstream.start()  # back, on the same port
        with trio.fail_after(GUARD_S):
            answer = await client.chat.completions.create(model=ALIAS, messages=MESSAGES)
    assert answer.choices[0].message.content
    assert provider_of(await stack.catalog(), "llama")["health"] == "available"
    await wait_idle(stack)


# --- a runtime's ids, a runtime's failures ------------------------------------------------


async def test_concurrent_conversations_on_a_runtime_with_one_id_stay_apart(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """The runtime answers every Responses request with the same id; conversations
    going on at once, streamed and not, are each stored under IOP's own ids, and each
    turn can still be continued after the others were stored."""
    fake, native = await start_native_upstream(nursery, "responses")
    text = edge_config(
        tmp_path / "state",
        providers=[native],
        models=[{"id": "m", "providers": {"native": "fake-model"}}],
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    upstream_id = json.loads(responses_response("fake-model", 1))["id"]
    turns: list[str] = []

    async def conversation(client: openai.AsyncOpenAI, index: int) -> None:
        first = await client.responses.create(model="m", input=f"c{index} one")
        turns.append(first.id)
        stream = await client.responses.create(
            model="m", input=f"c{index} two", previous_response_id=first.id, stream=True
        )
        async for event in stream:
            if event.type == "response.completed":
                turns.append(event.response.id)

    async with stack.client() as client:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as conversations:
                for index in range(4):
                    conversations.start_soon(conversation, client, index)
            assert len(turns) == len(set(turns)) == 8 and upstream_id not in turns
            for response_id in turns:
                assert (await client.responses.retrieve(response_id)).id == response_id
            await client.responses.create(model="m", input="again", previous_response_id=turns[0])
    sent = json.loads(fake.requests[-1].body)
    said = [item["content"] for item in sent["input"] if item.get("role") == "user"]
    assert said[-1] == "again" and said[0].endswith(" one")  # the first turn, not another's


async def test_a_caller_retrying_a_failing_runtime_keeps_its_requests_per_minute(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A caller retrying at once, in every protocol, streamed and not, while the
    runtime answers 500: each is a 502 and none spends the caller's
    `requests_per_minute`; once the runtime is back the caller has its whole limit, and
    no more. (Requests sent at once beyond the limit are refused while the others are in
    flight: a request counts until its attempt has failed.)"""
    fake = FakeUpstream(status=500)
    provider = upstream_provider("gpu", await nursery.start(fake.serve), protocols=["chat"])
    text = edge_config(
        tmp_path / "state",
        providers=[provider],
        models=[{"id": ALIAS, "providers": {"gpu": "fake-model"}}],
        openai_section=principals_section({"alice": ALICE}),
        dispatch={"cooldown": {"failures": 100, "seconds": 60}},
    )
    config = yaml.safe_load(text)
    config["principals"] = [{"ref": "alice", "requests_per_minute": 2}]
    stack = await start_stack(
        nursery, yaml.safe_dump(config), tmp_path / "edge.yaml", wait_models=(ALIAS,)
    )
    ask = [{"role": "user", "content": "x"}]
    bodies = [
        ("/v1/chat/completions", {"model": ALIAS, "messages": ask}),
        ("/v1/messages", {"model": ALIAS, "max_tokens": 5, "messages": ask}),
        ("/v1/responses", {"model": ALIAS, "input": "x"}),
    ]
    headers = {"Authorization": f"Bearer {ALICE}"}
    async with stack.http() as http:
        with trio.fail_after(GUARD_S):
            failed = [
                (await http.post(path, json={**body, "stream": stream}, headers=headers))
                for stream in (False, True)
                for path, body in bodies
            ]
            assert [r.status_code for r in failed] == [502] * 6, [r.text for r in failed]
            fake.status = 200  # the runtime is back
            answered = [
                (await http.post(path, json=body, headers=headers)).status_code
                for path, body in bodies
            ]
    assert answered == [200, 200, 429]
