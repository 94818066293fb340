"""The OpenAI Responses surface through a real Edge + Node, with the official `openai` SDK:
translated on the Node (the sim speaks chat only) and native (a fake upstream that speaks
Responses), stream and not; errors in OpenAI's shape, an Edge failure inside a stream
included; one ledger record per run, with its protocol. Stored responses are in
`test_response_store.py`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest
import trio

from iop_edge.core.responses.protocol_requests import ResponsesRequest, estimate_responses_tokens
from tests.adapters.fake_upstream import FakeUpstream
from tests.e2e.stack import (
    WAIT_GUARD_S,
    Stack,
    edge_config,
    sim_provider,
    start_native_upstream,
    start_slow_stack,
    start_stack,
)
from tests.protocols.conformance import check_response, check_responses_event


@pytest.fixture
async def stack(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    text = edge_config(
        tmp_path / "state",
        providers=[sim_provider("sim-1", capacity=4)],
        models=[
            {
                "id": "codex-local",
                "providers": {"sim-1": "sim-small"},
                "generation": {"max_tokens_limit": 64, "defaults": {"max_tokens": 6}},
            }
        ],
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("codex-local",))


async def test_a_response_and_a_stream_translated_on_the_node(stack: Stack) -> None:
    async with stack.client() as client:
        response = await client.responses.create(
            model="codex-local", input="Say something.", instructions="Be brief.", store=False
        )
        stream = await client.responses.create(
            model="codex-local",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi."}]}],
            stream=True,
            store=False,
        )
        events = [event async for event in stream]
    assert response.model == "codex-local" and response.output_text
    # the model's default `max_tokens: 6` applies as Responses' `max_output_tokens`: the
    # sim generates up to the bound, so the response is cut there
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and 0 < response.usage.output_tokens <= 6
    # the sim always stops at its bound, as `response.incomplete`
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text and final.model == "codex-local"
    assert await stack.requests_by_protocol() == {"responses": 2}


async def test_edge_errors_come_in_openais_shape(stack: Stack) -> None:
    async with stack.client() as client:
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.responses.create(model="gpt-9", input="x")
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.responses.create(model="codex-local", input="x", max_output_tokens=65)
        with pytest.raises(openai.BadRequestError) as wrong_type:
            await client.responses.create(model="codex-local", input=[{"content": 3}])  # type: ignore[list-item]
        tool = {"type": "function", "name": "read", "parameters": {"type": "object"}}
        with pytest.raises(openai.BadRequestError) as unknown_tool:
            await client.responses.create(
                model="codex-local",
                input="x",
                tools=[tool],  # type: ignore[list-item]
                tool_choice={"type": "function", "name": "write"},
            )
        with pytest.raises(openai.BadRequestError) as chat_tool:
            await client.chat.completions.create(
                model="codex-local",
                messages=[{"role": "user", "content": "x"}],
                tool_choice="required",
            )
    assert unknown.value.body == {
        "message": "The model 'gpt-9' does not exist",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert isinstance(too_long.value.body, dict)
    assert too_long.value.body["code"] == "max_tokens_exceeded"
    assert too_long.value.body["param"] == "max_output_tokens"
    assert isinstance(wrong_type.value.body, dict)
    assert wrong_type.value.body["param"] == "input[0].content"
    assert unknown_tool.value.body == {
        "message": "tool_choice names the tool 'write', which is not in tools ('read')",
        "type": "invalid_request_error",
        "param": "tool_choice",
        "code": None,
    }
    assert isinstance(chat_tool.value.body, dict)
    assert chat_tool.value.body["param"] == "tool_choice"
    assert "needs tools, and the request has none" in chat_tool.value.body["message"]
    assert await stack.requests_by_protocol() == {}  # refused before any run: nothing billed


@pytest.mark.parametrize(
    ("setting", "param"),
    [
        ({"metadata": "x"}, "metadata"),
        ({"metadata": {"a": 5}}, "metadata[...]"),  # msgspec: a value of the map
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"truncation": "sometimes"}, "truncation"),
        ({"top_logprobs": "many"}, "top_logprobs"),
        ({"service_tier": 5}, "service_tier"),
        ({"user": {"x": 1}}, "user"),
        ({"temperature": 7}, "temperature"),
        ({"top_p": -0.5}, "top_p"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"presence_penalty": {"x": 1}}, "presence_penalty"),
        ({"frequency_penalty": "high"}, "frequency_penalty"),
        ({"max_tool_calls": -5}, "max_tool_calls"),
        ({"input": [{"type": [], "role": "user", "content": "hi"}]}, "input[0].type"),
        ({"input": [{"type": "message", "id": 5, "role": "user", "content": "hi"}]}, "input[0].id"),
    ],
)
async def test_a_setting_a_response_echoes_is_checked(
    stack: Stack, setting: dict[str, Any], param: str
) -> None:
    """A response object echoes these settings as they were sent: a wrong one is the
    caller's 400 naming it, not a response that breaks the protocol's schema."""
    async with stack.http() as http:
        refused = await http.post(
            "/v1/responses", json={"model": "codex-local", "input": "x", **setting}
        )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == param
    assert await stack.requests_by_protocol() == {}


async def test_a_node_lost_mid_stream_ends_it_with_response_failed(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await start_slow_stack(nursery, tmp_path)
    events: list[Any] = []
    async with stack.client() as client:
        with trio.fail_after(WAIT_GUARD_S):
            stream = await client.responses.create(
                model="m", input="Tell a long story.", max_output_tokens=40, stream=True
            )
            async for event in stream:
                events.append(event)
                if event.type == "response.output_text.delta":
                    stack.kill_node()
    failed = events[-1]
    assert failed.type == "response.failed"
    assert failed.sequence_number == events[-2].sequence_number + 1
    assert failed.response.status == "failed" and failed.response.model == "m"
    assert failed.response.error.code == "server_error"
    assert failed.response.error.message.startswith("node_lost: ")
    assert failed.response.store is False  # a failed response is not stored
    assert await stack.requests_by_protocol() == {"responses": 1}


async def test_a_native_provider_gets_the_body_with_no_state(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    fake, native = await start_native_upstream(nursery, "responses")
    text = edge_config(
        tmp_path / "state",
        providers=[native, sim_provider("sim-1", served="fake-model")],
        models=[{"id": "m", "providers": {"native": "fake-model", "sim-1": "fake-model"}}],
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    async with stack.client() as client:
        for _ in range(2):
            raw = await client.responses.with_raw_response.create(
                model="m", input="hi", store=False, metadata={"trace": "t-1"}
            )
            assert raw.headers["x-iop-provider"] == "native"
            assert raw.parse().model == "m"
    [first, _] = [r for r in fake.requests if r.path == "/v1/responses"]
    body = msgspec.json.decode(first.body)
    assert body["model"] == "fake-model" and body["metadata"] == {"trace": "t-1"}
    assert body["store"] is False and "previous_response_id" not in body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_response_says_the_store_its_caller_asked_for(
    nursery: trio.Nursery, tmp_path: Path, stream: bool
) -> None:
    """The runtime is sent `store: false` (the Edge is the store), natively and translated
    alike; the caller sees `store` as it asked for it: true when it asked or left it to
    the default and the Edge stored the response, false when it said false."""
    fake, native = await start_native_upstream(nursery, "responses")
    text = edge_config(
        tmp_path / "state",
        providers=[native, sim_provider("sim-1")],
        models=[
            {"id": "native-m", "providers": {"native": "fake-model"}},
            {"id": "translated-m", "providers": {"sim-1": "sim-small"}},
        ],
    )
    stack = await start_stack(
        nursery, text, tmp_path / "edge.yaml", wait_models=("native-m", "translated-m")
    )
    asked: list[dict[str, Any]] = [{"store": True}, {}, {"store": False}]  # {}: the default
    async with stack.client() as client:
        for model in ("native-m", "translated-m"):
            for store in asked:
                expected = store.get("store", True)
                if stream:
                    events = await client.responses.create(
                        model=model, input="hi", max_output_tokens=4, stream=True, **store
                    )
                    lifecycle = [e.response async for e in events if hasattr(e, "response")]
                    assert [r.store for r in lifecycle] == [expected] * 3, (model, store)
                    response = lifecycle[-1]
                else:
                    response = await client.responses.create(
                        model=model, input="hi", max_output_tokens=4, **store
                    )
                    assert response.store is expected, (model, store)
                assert response.model == model
                if expected:  # stored as the caller saw it
                    assert (await client.responses.retrieve(response.id)).store is True
    sent = [msgspec.json.decode(r.body) for r in fake.requests if r.path == "/v1/responses"]
    assert [body["store"] for body in sent] == [False] * 3  # the runtime keeps nothing


async def _native_only(nursery: trio.Nursery, tmp_path: Path) -> tuple[FakeUpstream, Stack]:
    """A stack whose model `m` is served by one runtime that speaks Responses natively."""
    fake, native = await start_native_upstream(nursery, "responses")
    text = edge_config(
        tmp_path / "state",
        providers=[native],
        models=[{"id": "m", "providers": {"native": "fake-model"}}],
    )
    return fake, await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))


async def test_a_native_reply_has_iops_id_stored_or_not(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Every Responses reply's id is `resp_<request id>`, whichever runtime answered and
    whether or not the Edge stored it: a caller sees one id scheme."""
    fake, stack = await _native_only(nursery, tmp_path)
    async with stack.client() as client:
        for store in (True, False):
            raw = await client.responses.with_raw_response.create(
                model="m", input="hi", store=store
            )
            assert raw.parse().id == "resp_" + raw.headers["x-request-id"], store
            events = await client.responses.create(model="m", input="hi", store=store, stream=True)
            ids = {e.response.id async for e in events if hasattr(e, "response")}
            assert len(ids) == 1 and ids.pop().startswith("resp_req_"), store
    assert fake.requests_total == 4


async def test_the_sdks_stream_helper_reads_a_runtimes_unnumbered_stream(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """llama.cpp's server streams Responses events without `sequence_number`,
    `output_index` or `content_index`; the Node fills them in, so the official SDK's
    `responses.stream()`, which indexes the response by them, reads the relayed stream."""
    fake, stack = await _native_only(nursery, tmp_path)
    fake.indexed_responses = False
    client = stack.client()
    async with client, client.responses.stream(model="m", input="hi") as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text_deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert text_deltas and {(e.output_index, e.content_index) for e in text_deltas} == {(0, 0)}
    assert final.output_text == "".join(e.delta for e in text_deltas)
    item_events = [e for e in events if e.type.startswith("response.output_item.")]
    assert [e.output_index for e in item_events] == [0, 0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_continued_response_echoes_its_previous_response_id(
    nursery: trio.Nursery, tmp_path: Path, stream: bool
) -> None:
    """The Edge sends the stored conversation without the id (the runtime keeps nothing)
    and passes the id beside the body: the reply names the response it continues, natively
    relayed and translated alike, and validates against the schema as a whole."""
    fake, native = await start_native_upstream(nursery, "responses")
    text = edge_config(
        tmp_path / "state",
        providers=[native, sim_provider("sim-1")],
        models=[
            {"id": "native-m", "providers": {"native": "fake-model"}},
            {"id": "translated-m", "providers": {"sim-1": "sim-small"}},
        ],
    )
    stack = await start_stack(
        nursery, text, tmp_path / "edge.yaml", wait_models=("native-m", "translated-m")
    )
    async with stack.http() as http:
        for model in ("native-m", "translated-m"):
            first = await http.post(
                "/v1/responses", json={"model": model, "input": "hi", "max_output_tokens": 4}
            )
            assert first.status_code == 200, first.text
            earlier = first.json()["id"]
            body = {
                "model": model,
                "input": "and then?",
                "max_output_tokens": 4,
                "previous_response_id": earlier,
                "stream": stream,
            }
            reply = await http.post("/v1/responses", json=body)
            assert reply.status_code == 200, reply.text
            if stream:
                events = [
                    json.loads(line[len("data: ") :])
                    for line in reply.text.splitlines()
                    if line.startswith("data: ")
                ]
                responses = [event["response"] for event in events if "response" in event]
                assert [r["previous_response_id"] for r in responses] == [earlier] * 3, model
                if model == "translated-m":
                    for event in events:
                        check_responses_event(event)
            else:
                response = reply.json()
                assert response["previous_response_id"] == earlier, model
                if model == "translated-m":
                    check_response(response)
    sent = [msgspec.json.decode(r.body) for r in fake.requests if r.path == "/v1/responses"]
    assert all("previous_response_id" not in body for body in sent)  # the Edge sent the turns


async def test_input_tokens_counts_a_request_and_the_conversation_it_continues(
    stack: Stack,
) -> None:
    """`POST /v1/responses/input_tokens` answers the Edge's estimate (what admission
    uses), the stored conversation a `previous_response_id` names included; the official
    SDK reads it. It is no longer taken for a response id (405)."""
    request: dict[str, Any] = {"model": "codex-local", "input": "Count me. " * 40}
    async with stack.client() as client:
        counted = await client.responses.input_tokens.count(**request)
        assert counted.object == "response.input_tokens"
        view = msgspec.convert(request, ResponsesRequest)
        assert counted.input_tokens == estimate_responses_tokens(view) > 40
        earlier = await client.responses.create(model="codex-local", input="A long story. " * 50)
        continued = await client.responses.input_tokens.count(
            model="codex-local", input="and then?", previous_response_id=earlier.id
        )
        alone = await client.responses.input_tokens.count(model="codex-local", input="and then?")
        assert continued.input_tokens > alone.input_tokens + 100
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.responses.input_tokens.count(model="nope", input="x")
        assert unknown.value.code == "model_not_found"
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.input_tokens.count(
                model="codex-local", input="x", previous_response_id="resp_missing"
            )
        assert gone.value.code == "previous_response_not_found"


async def test_a_tool_output_no_call_asked_for_reaches_either_route_as_a_user_message(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Codex's thread goal (a `function_call_output` without `call_id`) is served by a
    translating route and a native one alike; the native upstream reads it as a user
    message after the call's output, in a stored turn continued too."""
    fake, native = await start_native_upstream(nursery, "responses")
    text = edge_config(
        tmp_path / "state",
        providers=[native, sim_provider("sim-1", served="fake-model")],
        models=[
            {"id": "native-m", "providers": {"native": "fake-model"}},
            {"id": "sim-m", "providers": {"sim-1": "fake-model"}},
        ],
    )
    stack = await start_stack(
        nursery, text, tmp_path / "edge.yaml", wait_models=("native-m", "sim-m")
    )
    goal = {
        "type": "function_call_output",
        "name": "goal_objective",
        "namespace": "agent",
        "output": "count to three",
    }
    items: list[Any] = [
        {"type": "message", "role": "user", "content": "Set a goal."},
        {"type": "function_call", "call_id": "c1", "name": "create_goal", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "{}"},
        goal,
    ]
    tools = [{"type": "function", "name": "create_goal", "parameters": {"type": "object"}}]
    async with stack.client() as client:
        translated = await client.responses.create(
            model="sim-m", input=items, tools=tools, max_output_tokens=4, store=False
        )
        first = await client.responses.create(model="native-m", input=items, tools=tools)
        await client.responses.create(
            model="native-m", input="Go on.", previous_response_id=first.id, store=False
        )
    assert translated.output_text
    bodies = [msgspec.json.decode(r.body) for r in fake.requests if r.path == "/v1/responses"]
    goal_message = {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "agent.goal_objective:\ncount to three"}],
    }
    assert bodies[0]["input"] == [*items[:3], goal_message]
    assert bodies[1]["input"][:4] == [*items[:3], goal_message]
    assert await stack.requests_by_protocol() == {"responses": 3}


async def test_what_a_caller_cannot_send_is_named_and_not_repeated_whole(stack: Stack) -> None:
    """A number out of any float's range names its field; a model name of megabytes is
    not repeated whole in the 404; the input_tokens action answers another method 405."""
    async with stack.http() as http:
        huge = await http.post(
            "/v1/responses",
            content=b'{"model": "codex-local", "input": "x", "temperature": 1e309}',
            headers={"content-type": "application/json"},
        )
        unknown = await http.post("/v1/responses", json={"model": "m" * 100_000, "input": "x"})
        action = await http.get("/v1/responses/input_tokens")
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "temperature"
    assert unknown.status_code == 404 and len(unknown.content) < 1000
    assert action.status_code == 405 and action.headers["allow"] == "POST"
