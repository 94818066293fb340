"""The Anthropic Messages surface through a real Edge + Node, with the official `anthropic`
SDK: translated on the Node (the sim speaks chat only) and native (a fake upstream that
speaks Messages), stream and not; count_tokens; the model list; auth; errors in
Anthropic's shape, an Edge failure inside a stream included; one ledger record per run,
with its protocol."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import msgspec
import openai
import pytest
import trio

from tests.e2e.stack import (
    WAIT_GUARD_S,
    Stack,
    edge_config,
    principals_section,
    sim_provider,
    start_native_upstream,
    start_slow_stack,
    start_stack,
)
from tests.protocols.conformance import check_messages_event

CALLER_TOKEN = "caller-token-for-tests"
OTHER_TOKEN = "another-callers-token"
MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]


def _client(stack: Stack, **kwargs: Any) -> anthropic.AsyncAnthropic:
    kwargs.setdefault("api_key", CALLER_TOKEN)
    return anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url, max_retries=0, timeout=WAIT_GUARD_S, **kwargs
    )


@pytest.fixture
async def stack(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    text = edge_config(
        tmp_path / "state",
        providers=[sim_provider("sim-1", capacity=4)],
        models=[
            {
                "id": "claude-local",
                "display_name": "Local Claude",
                "providers": {"sim-1": "sim-small"},
                "generation": {"max_tokens_limit": 64},
            },
            {"id": "second", "providers": {"sim-1": "sim-small"}},
        ],
        openai_section=principals_section({"alice": CALLER_TOKEN, "bob": OTHER_TOKEN}),
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("claude-local",))


async def test_a_message_and_a_stream_translated_on_the_node(stack: Stack) -> None:
    async with _client(stack) as client:
        message = await client.messages.create(
            model="claude-local", max_tokens=8, system="Be brief.", messages=MESSAGES
        )
        async with client.messages.stream(
            model="claude-local", max_tokens=8, messages=MESSAGES
        ) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
    assert message.model == "claude-local" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.model == "claude-local" and final.content[0].type == "text"
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert await stack.requests_by_protocol() == {"messages": 2}


async def test_count_tokens_and_the_beta_path(stack: Stack) -> None:
    async with _client(stack) as client:
        counted = await client.messages.count_tokens(model="claude-local", messages=MESSAGES)
        beta = await client.beta.messages.create(  # POST /v1/messages?beta=true
            model="claude-local", max_tokens=4, messages=MESSAGES
        )
    assert counted.input_tokens > 0
    assert beta.content and beta.model == "claude-local"


async def test_models_in_anthropics_shape_and_in_openais(stack: Stack) -> None:
    async with _client(stack) as client:
        listed = [model async for model in client.models.list()]
        one = await client.models.retrieve("claude-local")
        page = await client.models.list(limit=1)
    assert [(m.id, m.display_name, m.type) for m in listed] == [
        ("claude-local", "Local Claude", "model"),
        ("second", "second", "model"),
    ]
    assert one.id == "claude-local" and one.created_at.year >= 2024
    assert (page.has_more, page.first_id, page.last_id) == (True, "claude-local", "claude-local")
    async with stack.client(api_key=CALLER_TOKEN) as client:
        openai_models = await client.models.list()
    assert [m.id for m in openai_models.data] == ["claude-local", "second"]
    assert openai_models.data[0].object == "model"


async def test_x_api_key_and_bearer_are_the_same_principal_and_401_is_anthropics(
    stack: Stack,
) -> None:
    async with _client(stack, api_key=None, auth_token=CALLER_TOKEN) as client:
        bearer = await client.messages.create(model="claude-local", max_tokens=2, messages=MESSAGES)
    assert bearer.content
    async with _client(stack, api_key="wrong") as client:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            await client.messages.create(model="claude-local", max_tokens=2, messages=MESSAGES)
        with pytest.raises(anthropic.AuthenticationError):
            await client.models.list()
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "authentication_error"


async def test_edge_errors_come_in_anthropics_shape(stack: Stack) -> None:
    async with _client(stack) as client:
        with pytest.raises(anthropic.NotFoundError) as unknown:
            await client.messages.create(model="gpt-9", max_tokens=2, messages=MESSAGES)
        with pytest.raises(anthropic.BadRequestError) as too_long:
            await client.messages.create(model="claude-local", max_tokens=65, messages=MESSAGES)
    assert unknown.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "model_not_found: The model 'gpt-9' does not exist",
        },
        "request_id": unknown.value.response.headers["x-request-id"],
    }
    assert "max_tokens=65 exceeds this model's limit of 64" in str(too_long.value)
    async with stack.http() as http:
        missing = await http.post(
            "/v1/messages",
            json={"model": "claude-local", "messages": MESSAGES},
            headers={"x-api-key": CALLER_TOKEN},
        )
        bad_json = await http.post(
            "/v1/messages", content=b"{nope", headers={"x-api-key": CALLER_TOKEN}
        )
        wrong_method = await http.get("/v1/messages", headers={"x-api-key": CALLER_TOKEN})
    assert missing.status_code == 400
    assert missing.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "Invalid request: Object missing required field `max_tokens`",
        },
        "request_id": missing.headers["x-request-id"],
    }
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["type"] == "invalid_request_error"
    assert wrong_method.status_code == 405 and wrong_method.json()["type"] == "error"


@pytest.mark.parametrize(
    "setting",
    [
        {"metadata": "x"},
        {"metadata": {"user_id": 5}},
        {"metadata": {"team": "a"}},
        {"temperature": 1.5},
        {"top_k": -1},
        {"stop_sequences": "END"},
    ],
)
async def test_a_setting_anthropic_refuses_is_refused(
    stack: Stack, setting: dict[str, Any]
) -> None:
    async with stack.http() as http:
        refused = await http.post(
            "/v1/messages",
            json={"model": "claude-local", "max_tokens": 8, "messages": MESSAGES, **setting},
            headers={"x-api-key": CALLER_TOKEN},
        )
    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert next(iter(setting)) in refused.json()["error"]["message"]


async def test_a_tool_choice_no_tool_meets_is_refused_before_a_run(stack: Stack) -> None:
    """A 400 in Anthropic's shape, as from Anthropic, not whatever a runtime makes of it.
    A `system` message between the turns passes: Claude Code sends them."""
    tool = {"name": "read", "description": "Read a file", "input_schema": {"type": "object"}}
    async with _client(stack) as client:
        with pytest.raises(anthropic.BadRequestError) as unknown_tool:
            await client.messages.create(
                model="claude-local",
                max_tokens=8,
                messages=MESSAGES,
                tools=[tool],
                tool_choice={"type": "tool", "name": "write"},
            )
        chosen = await client.messages.create(
            model="claude-local",
            max_tokens=8,
            messages=[*MESSAGES, {"role": "system", "content": "Be brief."}],
            tools=[tool],
            tool_choice={"type": "tool", "name": "read"},
        )
        with pytest.raises(anthropic.BadRequestError) as counted:  # counting asks the same
            await client.messages.count_tokens(
                model="claude-local",
                messages=MESSAGES,
                tools=[tool],
                tool_choice={"type": "tool", "name": "write"},
            )
    assert counted.value.body["error"]["message"] == (  # type: ignore[index]
        "tool_choice names the tool 'write', which is not in tools ('read')"
    )
    assert unknown_tool.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "tool_choice names the tool 'write', which is not in tools ('read')",
        },
        "request_id": unknown_tool.value.response.headers["x-request-id"],
    }
    assert chosen.stop_reason in ("end_turn", "max_tokens", "tool_use")


async def test_head_and_get_root_answer_without_a_token(stack: Stack) -> None:
    async with stack.http() as http:
        head = await http.head("/")
        get = await http.get("/")
    assert head.status_code == 200 and get.status_code == 200
    assert get.json()["status"] == "ok"


async def test_a_node_lost_mid_stream_ends_it_with_an_anthropic_error_event(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    stack = await start_slow_stack(nursery, tmp_path)
    async with anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url, api_key="open", max_retries=0
    ) as client:
        with trio.fail_after(WAIT_GUARD_S):
            async with client.messages.stream(model="m", max_tokens=40, messages=MESSAGES) as s:
                with pytest.raises(anthropic.APIStatusError) as caught:
                    async for event in s:
                        if event.type == "content_block_delta":
                            stack.kill_node()
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["message"].startswith("node_lost: ")
    assert await stack.requests_by_protocol() == {"messages": 1}


async def test_a_native_provider_is_preferred_and_gets_the_body_and_headers_unchanged(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # the worse priority: only the protocol can make it win
    fake, native = await start_native_upstream(nursery, "messages", "vllm", priority=200)
    text = edge_config(
        tmp_path / "state",
        providers=[sim_provider("sim-1", served="fake-model"), native],
        models=[{"id": "m", "providers": {"sim-1": "fake-model", "native": "fake-model"}}],
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    await stack.wait_catalog(lambda c: all(p["health"] == "available" for p in c["providers"]))
    beta = "prompt-caching-2024-07-31"
    async with anthropic.AsyncAnthropic(
        base_url=stack.addresses.openai_url,
        api_key="open",
        max_retries=0,
        default_headers={"anthropic-beta": beta, "anthropic-version": "2023-06-01"},
    ) as client:
        for _ in range(3):
            raw = await client.messages.with_raw_response.create(
                model="m", max_tokens=8, messages=MESSAGES, metadata={"user_id": "u-1"}
            )
            assert raw.headers["x-iop-provider"] == "native"
            assert (await raw.parse()).model == "m"
    sent = [r for r in fake.requests if r.path == "/v1/messages"]
    assert len(sent) == 3
    assert sent[0].headers["anthropic-beta"] == beta
    assert sent[0].headers["anthropic-version"] == "2023-06-01"
    assert "x-api-key" not in sent[0].headers
    body = msgspec.json.decode(sent[0].body)
    assert body["model"] == "fake-model" and body["metadata"] == {"user_id": "u-1"}
    catalog = await stack.catalog()
    protocols = {p["id"]: p["protocols"] for p in catalog["providers"]}
    assert protocols == {"sim-1": ["chat"], "native": ["chat", "messages", "responses"]}


async def test_chat_and_messages_callers_share_the_pool(stack: Stack) -> None:
    async def chat(client: openai.AsyncOpenAI) -> None:
        await client.chat.completions.create(model="claude-local", max_tokens=2, messages=MESSAGES)

    async def message(client: anthropic.AsyncAnthropic) -> None:
        await client.messages.create(model="claude-local", max_tokens=2, messages=MESSAGES)

    async with (
        stack.client(api_key=CALLER_TOKEN) as openai_client,
        _client(stack) as anthropic_client,
        trio.open_nursery() as nursery,
    ):
        for _ in range(3):
            nursery.start_soon(chat, openai_client)
            nursery.start_soon(message, anthropic_client)
    assert await stack.requests_by_protocol() == {"chat": 3, "messages": 3}
    with pytest.raises(openai.NotFoundError):
        async with stack.client(api_key=CALLER_TOKEN) as client:
            await client.models.retrieve("gpt-9")
    async with httpx2.AsyncClient(base_url=stack.addresses.openai_url) as http:
        anthropic_404 = await http.get(
            "/v1/models/gpt-9",
            headers={"x-api-key": CALLER_TOKEN, "anthropic-version": "2023-06-01"},
        )
    assert anthropic_404.status_code == 404
    assert anthropic_404.json()["error"]["type"] == "not_found_error"


async def test_a_refused_token_closes_the_connection_its_unread_body_came_on(
    stack: Stack,
) -> None:
    """A 401 is answered before the body is read, so that connection cannot carry another
    request: the reply says `Connection: close`, and a client that pools connections opens
    a new one for its next request instead of racing the server's close."""
    async with httpx2.AsyncClient(base_url=stack.addresses.openai_url) as http:
        body = {"model": "claude-local", "max_tokens": 2, "messages": MESSAGES}
        for _ in range(3):
            refused = await http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
            assert refused.status_code == 401
            assert refused.headers["connection"] == "close"
            ok = await http.post("/v1/messages", json=body, headers={"x-api-key": CALLER_TOKEN})
            assert ok.status_code == 200


async def test_a_translated_stream_validates_and_starts_with_the_prompts_tokens(
    stack: Stack,
) -> None:
    """Every event of a translated stream has what Anthropic's SDKs declare, and
    `message_start` says how long the prompt is before the runtime has counted it."""
    async with stack.http() as http:
        reply = await http.post(
            "/v1/messages",
            json={"model": "claude-local", "max_tokens": 8, "messages": MESSAGES, "stream": True},
            headers={"x-api-key": CALLER_TOKEN},
        )
    assert reply.status_code == 200, reply.text
    events = [
        json.loads(line[len("data: ") :])
        for line in reply.text.splitlines()
        if line.startswith("data: ")
    ]
    for event in events:
        check_messages_event(event)
    start, delta = events[0], next(e for e in events if e["type"] == "message_delta")
    assert start["message"]["usage"]["input_tokens"] > 0
    assert delta["usage"]["input_tokens"] > 0 and delta["usage"]["output_tokens"] > 0
