"""The OpenAI surface through a real Edge + Node + sim, with the official `openai` SDK."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import openai
import pytest
import trio

from tests.e2e.stack import Stack, edge_config, one_sim_config, sim_provider, start_stack
from tests.timing import GUARD_S

CALLER_TOKEN = "caller-token-for-tests"


def _models() -> list[dict[str, object]]:
    return [
        {
            "id": "chat-alias",
            "display_name": "Chat alias",
            "providers": {"sim-1": "sim-small"},
            "generation": {"max_tokens_limit": 64, "defaults": {"temperature": 0.5}},
        },
        {"id": "embed-alias", "providers": {"sim-1": "sim-small"}},
    ]


@pytest.fixture
async def stack(nursery: trio.Nursery, tmp_path: Path) -> Stack:
    text = edge_config(
        tmp_path / "state",
        providers=[sim_provider("sim-1", capacity=4)],
        models=_models(),
        openai_section={"max_request_bytes": 4096},
    )
    return await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("chat-alias",))


async def test_non_stream_chat_returns_alias_and_usage(stack: Stack) -> None:
    async with stack.client() as client:
        response = await client.chat.completions.with_raw_response.create(
            model="chat-alias", max_tokens=8, messages=[{"role": "user", "content": "hello there"}]
        )
    completion = response.parse()
    assert completion.model == "chat-alias"
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens > 0
    assert response.headers["x-request-id"].startswith("req_")
    timing = response.headers["server-timing"]
    assert "queue;dur=" in timing and "edge;dur=" in timing and "upstream;dur=" in timing


async def test_stream_matches_non_stream_and_carries_alias(stack: Stack) -> None:
    messages = [{"role": "user", "content": "tell me a story"}]
    async with stack.client() as client:
        whole = await client.chat.completions.create(
            model="chat-alias", max_tokens=12, messages=messages
        )
        stream = await client.chat.completions.create(
            model="chat-alias", max_tokens=12, messages=messages, stream=True
        )
        pieces: list[str] = []
        finish = None
        async for chunk in stream:
            assert chunk.model == "chat-alias"
            assert chunk.usage is None  # the caller did not ask for usage
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == "length"


async def test_stream_usage_is_passed_when_asked(stack: Stack) -> None:
    async with stack.client() as client:
        stream = await client.chat.completions.create(
            model="chat-alias",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "count"}],
        )
        usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 5


async def test_completion_and_embedding_routes(stack: Stack) -> None:
    async with stack.client() as client:
        completion = await client.completions.create(
            model="chat-alias", prompt="Once", max_tokens=4
        )
        embedding = await client.embeddings.create(model="embed-alias", input=["a", "b"])
    assert completion.model == "chat-alias" and completion.choices[0].text
    assert embedding.model == "embed-alias" and len(embedding.data) == 2


async def test_unknown_model_is_not_found(stack: Stack) -> None:
    async with stack.client() as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(
                model="nope", messages=[{"role": "user", "content": "x"}]
            )
    assert caught.value.status_code == 404
    assert caught.value.code == "model_not_found"


async def test_wrong_types_are_400_naming_the_field(stack: Stack) -> None:
    async with stack.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="chat-alias", messages="not a list")  # type: ignore[arg-type]
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "messages"


@pytest.mark.parametrize(
    ("field", "param"),
    [
        ({"tools": "x"}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tool_choice": "bogus"}, "tool_choice"),
        ({"stop": 5}, "stop"),
        ({"response_format": "json"}, "response_format"),
    ],
)
async def test_tools_and_output_controls_of_the_wrong_shape_are_400_naming_them(
    stack: Stack, field: dict[str, object], param: str
) -> None:
    """Refused here, not passed to a runtime that would do who knows what with them."""
    async with stack.http() as http:
        response = await http.post(
            "/v1/chat/completions",
            json={"model": "chat-alias", "messages": [{"role": "user", "content": "x"}], **field},
        )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


async def test_malformed_json_is_400(stack: Stack) -> None:
    async with stack.http() as http:
        response = await http.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_json"


async def test_body_over_limit_is_413(stack: Stack) -> None:
    big = {"model": "chat-alias", "messages": [{"role": "user", "content": "x" * 5000}]}
    async with stack.http() as http:
        response = await http.post(
            "/v1/chat/completions",
            content=msgspec.json.encode(big),
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


async def test_max_tokens_over_model_limit_is_400(stack: Stack) -> None:
    async with stack.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="chat-alias", max_tokens=65, messages=[{"role": "user", "content": "x"}]
            )
    assert caught.value.code == "max_tokens_exceeded"


async def test_models_list_and_get(stack: Stack) -> None:
    async with stack.client() as client:
        listed = [model.id async for model in client.models.list()]
        one = await client.models.retrieve("chat-alias")
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("missing")
    assert listed == ["chat-alias", "embed-alias"]
    assert one.id == "chat-alias"


async def test_caller_request_id_is_echoed(stack: Stack) -> None:
    async with stack.http() as http:
        response = await http.post(
            "/v1/chat/completions",
            json={
                "model": "chat-alias",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "x"}],
            },
            headers={"x-request-id": "caller-abc-123"},
        )
        missing = await http.post(
            "/v1/chat/completions",
            json={"model": "nope", "messages": []},
            headers={"x-request-id": "caller-err-1"},
        )
    assert response.headers["x-request-id"] == "caller-abc-123"
    assert missing.headers["x-request-id"] == "caller-err-1"


async def test_no_provider_connected_is_immediate_503(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    text = one_sim_config(tmp_path)
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", nodes=())
    async with stack.client() as client:
        with trio.fail_after(GUARD_S):
            with pytest.raises(openai.InternalServerError) as caught:
                await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "x"}]
                )
    assert caught.value.status_code == 503
    assert caught.value.response.headers.get("retry-after")


async def test_principal_tokens_gate_the_api(nursery: trio.Nursery, tmp_path: Path) -> None:
    text = one_sim_config(
        tmp_path,
        openai_section={
            "principal_tokens": [
                {
                    "token_ref": "app",
                    "principal_ref": "team",
                    "token_hash_sha256": hashlib.sha256(CALLER_TOKEN.encode()).hexdigest(),
                }
            ]
        },
    )
    stack = await start_stack(nursery, text, tmp_path / "edge.yaml", wait_models=("m",))
    messages = [{"role": "user", "content": "x"}]
    async with stack.client(api_key="wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="m", messages=messages)
    async with stack.client(api_key=CALLER_TOKEN) as client:
        ok = await client.chat.completions.create(model="m", max_tokens=2, messages=messages)
    assert ok.model == "m"


async def test_run_endpoint_answers_other_methods_with_405(stack: Stack) -> None:
    async with stack.http() as http:
        response = await http.get("/v1/chat/completions", headers={"x-request-id": "m-1"})
        unknown = await http.post("/v1/nowhere", json={})
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.headers["x-request-id"] == "m-1"
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "unknown_url"


async def _send_partial_request(stack: Stack) -> trio.SocketStream:
    """Open a connection and send a request head promising more body than it sends."""
    host, port = stack.addresses.openai_url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\n"
        b"content-type: application/json\r\ncontent-length: 100\r\n\r\n"
        b'{"model": "chat-'
    )
    return stream


async def test_body_that_never_completes_is_408(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("iop_edge.http.request_body.BODY_TIMEOUT_S", 0.2)
    stream = await _send_partial_request(stack)
    async with stream:
        received = b""
        with trio.fail_after(10):
            while b'"request_timeout"' not in received:
                chunk = await stream.receive_some()
                assert chunk, f"connection closed without an answer: {received!r}"
                received += chunk
    assert received.startswith(b"HTTP/1.1 408")


async def test_caller_leaving_mid_body_is_harmless(stack: Stack) -> None:
    stream = await _send_partial_request(stack)
    await stream.aclose()
    async with stack.client() as client:
        completion = await client.chat.completions.create(
            model="chat-alias", max_tokens=2, messages=[{"role": "user", "content": "x"}]
        )
    assert completion.model == "chat-alias"
    async with stack.admin() as admin:
        metrics = (await admin.get("/metrics")).text
    assert 'code="client_closed"' not in metrics  # no run was started, nothing to meter


async def test_a_bug_while_responding_is_a_500_metered_as_internal_error(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_check(data: bytes) -> bool:
        raise RuntimeError("simulated bug")

    monkeypatch.setattr("iop_edge.http.runs._is_json_object", broken_check)
    async with stack.client(max_retries=0) as client:
        with pytest.raises(openai.InternalServerError) as caught:
            await client.chat.completions.create(
                model="chat-alias", max_tokens=2, messages=[{"role": "user", "content": "x"}]
            )
    assert caught.value.status_code == 500
    assert caught.value.code == "internal_error"
    async with stack.admin() as admin:
        metrics = (await admin.get("/metrics")).text
        catalog = (await admin.get("/catalog")).json()
    assert 'status="500"' in metrics and 'code="internal_error"' in metrics
    assert 'code="client_closed"' not in metrics
    assert [p["in_flight"] for p in catalog["providers"]] == [0]  # the slot came back
