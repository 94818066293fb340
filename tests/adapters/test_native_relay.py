"""OpenAICompatAdapter speaking the caller protocols natively (Messages, Responses, token
counts) to the fake upstream, over real loopback sockets."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from iop_node.adapters.base import AdapterError, EmitEvents, NativeUnsupported, RunResult
from iop_node.adapters.native import InBandError, NativeReply, NotAnObject
from iop_node.adapters.openai_compat import OpenAICompatAdapter
from iop_node.adapters.sse import SSEDecoder
from iop_node.protocols.native import ANTHROPIC_VERSION
from iop_node.runs.protocol_run import TRANSLATORS
from schemas.wire import Operation, Run, Usage
from tests.timing import GUARD_S

from .conftest import MODEL, MakeAdapter
from .fake_data import PROMPT_TOKENS
from .fake_protocols import (
    CACHED_TOKENS,
    NATIVE_COUNT,
    completed_response,
    fake_tokens,
    messages_events,
    messages_response,
    responses_events,
    responses_response,
    sse,
)
from .fake_upstream import FakeUpstream

ALIAS = "team-alias"
FAKE_KEY_ENV = "IOP_TEST_NATIVE_KEY"
FAKE_KEY = "sk-test-native-not-real"
#: The fake's counts on the wire: the cached tokens it reports are a part of the prompt.
USAGE = Usage(
    prompt_tokens=PROMPT_TOKENS,
    completion_tokens=3,
    total_tokens=PROMPT_TOKENS + 3,
    cached_tokens=CACHED_TOKENS,
)


def native_run(
    operation: Operation,
    *,
    stream: bool = False,
    keep_output: bool = False,
    headers: dict[str, str] | None = None,
) -> Run:
    if operation == "responses":
        payload: dict[str, Any] = {"model": MODEL, "input": "hi"}
    else:
        payload = {
            "model": MODEL,
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}],
        }
    if stream:
        payload["stream"] = True
    return Run(
        run_id="run-1",
        provider_id="p1",
        target=MODEL,
        operation=operation,
        body=json.dumps(payload, indent=1).encode(),
        stream=stream,
        reply_model=ALIAS,
        caller_headers=headers or {},
        keep_output=keep_output,
    )


class Events:
    """An `EmitEvents` that records what the adapter sends."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.output = 0

    async def __call__(self, events: bytes, output: int, /) -> None:
        self.pieces.append(events)
        self.output += output

    def parsed(self) -> list[tuple[str, dict[str, Any]]]:
        """Every event sent, as (name, data)."""
        found: list[tuple[str, dict[str, Any]]] = []
        for block in b"".join(self.pieces).split(b"\n\n"):
            if not block:
                continue
            name, data = block.split(b"\n")
            assert name.startswith(b"event: ") and data.startswith(b"data: ")
            found.append((name[7:].decode(), json.loads(data[6:])))
        return found


def with_alias(
    events: list[tuple[str, bytes]], where: str, own_id: str | None = None
) -> list[tuple[str, Any]]:
    """The upstream's events as the caller must see them: `model` is the alias in the
    object at `where` (`message` in Messages' `message_start`, `response` in Responses'
    lifecycle events), and its `id` is `own_id` when given (IOP's own, for Responses)."""
    out = []
    for name, data in events:
        value = json.loads(data)
        if isinstance(value.get(where), dict) and "model" in value[where]:
            value[where]["model"] = ALIAS
            if own_id is not None:
                value[where]["id"] = own_id
        out.append((name, value))
    return out


# --- Messages -------------------------------------------------------------------------------


async def test_messages_non_stream_is_relayed_with_the_alias_and_usage(
    upstream: FakeUpstream, make_adapter: MakeAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAKE_KEY_ENV, FAKE_KEY)
    upstream.native = frozenset({"messages"})
    adapter = make_adapter(upstream.base_url, api_key_env=FAKE_KEY_ENV)
    run = native_run("messages", headers={"anthropic-beta": "tools-2024", "Authorization": "x"})
    with trio.fail_after(GUARD_S):
        result = await execute_native(adapter, run, Events())
    sent = json.loads(messages_response(MODEL, 3))
    assert result.response is not None
    assert json.loads(result.response) == {**sent, "model": ALIAS}
    # Nested values pass byte for byte (the upstream's ASCII escape is still there).
    assert b'"caf\\u00e9"' in result.response
    assert result.usage == USAGE  # input + cache reads: the whole prompt
    request = upstream.requests[-1]
    assert (request.method, request.path, request.body) == ("POST", "/v1/messages", run.body)
    assert request.headers["x-api-key"] == FAKE_KEY
    assert request.headers["authorization"] == f"Bearer {FAKE_KEY}"  # never the caller's
    assert request.headers["anthropic-version"] == ANTHROPIC_VERSION
    assert request.headers["anthropic-beta"] == "tools-2024"


async def test_messages_stream_relays_every_event_with_the_alias(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    upstream.native = frozenset({"messages"})
    adapter = make_adapter(upstream.base_url)
    run = native_run("messages", stream=True, headers={"anthropic-version": "2024-01-01"})
    events = Events()
    with trio.fail_after(GUARD_S):
        result = await execute_native(adapter, run, events)
    sent = messages_events(MODEL, 3)
    assert events.parsed() == with_alias(sent, "message")
    # Only `message_start` carries the model: every other event is the upstream's bytes.
    relayed = b"".join(events.pieces)
    for name, data in sent[1:]:
        assert sse(name, data) in relayed
    assert events.output == 3  # one per delta
    assert result.usage == USAGE
    assert result.response is None
    assert upstream.requests[-1].headers["anthropic-version"] == "2024-01-01"
    assert upstream.requests[-1].headers["accept"] == "text/event-stream"


async def test_an_anthropic_error_keeps_the_upstream_status_and_words(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    upstream.native = frozenset({"messages"})
    upstream.status = 400
    upstream.error_message = "max_tokens: must be at most 8192"
    adapter = make_adapter(upstream.base_url)
    with trio.fail_after(GUARD_S), pytest.raises(AdapterError) as info:
        await execute_native(adapter, native_run("messages"), Events())
    error = info.value
    assert (error.code, error.status, error.retryable) == ("upstream_rejected", 400, False)
    assert error.message == "max_tokens: must be at most 8192"


async def test_a_busy_native_upstream_says_how_long_to_rest(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    upstream.native = frozenset({"messages"})
    upstream.status = 503
    upstream.error_headers = {"retry-after": "4"}
    adapter = make_adapter(upstream.base_url)
    with trio.fail_after(GUARD_S), pytest.raises(AdapterError) as info:
        await execute_native(adapter, native_run("messages"), Events())
    error = info.value
    assert (error.code, error.capacity, error.retry_after_s) == ("upstream_busy", True, 4.0)


async def test_a_cut_native_stream_is_a_stream_error_after_output(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    upstream.native = frozenset({"messages"})
    upstream.drop_after_chunks = 5  # past the first delta, before `message_stop`
    adapter = make_adapter(upstream.base_url)
    events = Events()
    with trio.fail_after(GUARD_S), pytest.raises(AdapterError) as info:
        await execute_native(adapter, native_run("messages", stream=True), events)
    assert (info.value.code, info.value.retryable) == ("upstream_stream_error", False)
    assert [name for name, _ in events.parsed()][:4] == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
    ]


@pytest.mark.parametrize(
    ("operation", "relayed"),
    [
        ("messages", ["message_start", "content_block_start", "ping", "content_block_delta"]),
        ("responses", ["response.created", "response.in_progress", "response.output_item.added"]),
    ],
)
async def test_an_in_band_error_ends_the_run_with_the_upstreams_words(
    upstream: FakeUpstream, make_adapter: MakeAdapter, operation: Operation, relayed: list[str]
) -> None:
    upstream.native = frozenset({"messages", "responses"})
    upstream.error_after_chunks = len(relayed)
    upstream.error_message = "the GPU fell over"
    adapter = make_adapter(upstream.base_url)
    events = Events()
    with trio.fail_after(GUARD_S), pytest.raises(AdapterError) as info:
        await execute_native(adapter, native_run(operation, stream=True), events)
    # What came before the error went out; the error itself is the run's failure (the
    # Edge words it in the caller's protocol), not an event relayed as it is.
    assert [name for name, _ in events.parsed()] == relayed
    assert (info.value.code, info.value.retryable) == ("upstream_stream_error", False)
    assert "upstream reported an error: the GPU fell over" in info.value.message


# --- Responses ------------------------------------------------------------------------------


async def test_responses_non_stream_is_relayed_with_the_alias_and_usage(
    upstream: FakeUpstream, make_adapter: MakeAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAKE_KEY_ENV, FAKE_KEY)
    upstream.native = frozenset({"responses"})
    adapter = make_adapter(upstream.base_url, api_key_env=FAKE_KEY_ENV)
    run = native_run("responses")
    with trio.fail_after(GUARD_S):
        result = await execute_native(adapter, run, Events())
    assert result.response is not None
    assert json.loads(result.response) == {
        **json.loads(responses_response(MODEL, 3)),
        "model": ALIAS,
        "id": f"resp_{run.run_id}",  # IOP's own, stored or not
    }
    # Responses' input count already includes the cached tokens.
    assert result.usage == USAGE
    request = upstream.requests[-1]
    assert (request.path, request.body) == ("/v1/responses", run.body)
    assert request.headers["authorization"] == f"Bearer {FAKE_KEY}"
    assert "x-api-key" not in request.headers
    assert "anthropic-version" not in request.headers


@pytest.mark.parametrize("keep_output", [False, True])
async def test_responses_stream_relays_every_event_and_keeps_the_final_response(
    upstream: FakeUpstream, make_adapter: MakeAdapter, keep_output: bool
) -> None:
    upstream.native = frozenset({"responses"})
    adapter = make_adapter(upstream.base_url)
    events = Events()
    run = native_run("responses", stream=True, keep_output=keep_output)
    with trio.fail_after(GUARD_S):
        result = await execute_native(adapter, run, events)
    sent = responses_events(MODEL, 3)
    # Every response carries IOP's own id, never the upstream's, stored or not.
    own_id = f"resp_{run.run_id}"
    assert events.parsed() == with_alias(sent, "response", own_id)
    relayed = b"".join(events.pieces)
    for name, data in sent:
        if not name.startswith("response.") or name.count(".") > 1:
            assert sse(name, data) in relayed  # untouched bytes
    assert events.output == 3
    assert result.usage == USAGE
    if keep_output:
        assert result.response is not None
        final = json.loads(completed_response(MODEL, 3))
        assert json.loads(result.response) == {**final, "model": ALIAS, "id": own_id}
    else:
        assert result.response is None


# --- a protocol the upstream does not speak -------------------------------------------------


@pytest.mark.parametrize("status", [404, 405])
@pytest.mark.parametrize("operation", ["messages", "responses"])
async def test_a_missing_native_route_is_reported_as_unsupported(
    upstream: FakeUpstream, make_adapter: MakeAdapter, status: int, operation: Operation
) -> None:
    upstream.native_missing_status = status
    adapter = make_adapter(upstream.base_url)
    with trio.fail_after(GUARD_S), pytest.raises(NativeUnsupported) as info:
        await execute_native(adapter, native_run(operation, stream=True), Events())
    assert info.value.protocol == operation
    assert info.value.failure.status == status


async def test_a_404_about_the_model_is_not_a_missing_route(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    upstream.native = frozenset({"messages"})
    upstream.status = 404
    upstream.error_message = f"model '{MODEL}' not found"
    adapter = make_adapter(upstream.base_url)
    with trio.fail_after(GUARD_S), pytest.raises(AdapterError) as info:
        await execute_native(adapter, native_run("messages"), Events())
    assert (info.value.code, info.value.status) == ("upstream_misconfigured", 404)


# --- token counts ---------------------------------------------------------------------------


async def test_count_tokens_asks_the_upstream_when_it_speaks_messages(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    upstream.native = frozenset({"messages"})
    adapter = make_adapter(upstream.base_url)
    run = native_run("count_tokens", headers={"anthropic-beta": "b1"})
    with trio.fail_after(GUARD_S):
        assert await adapter.count_tokens_native(run) == NATIVE_COUNT
    request = upstream.requests[-1]
    assert (request.path, request.body) == ("/v1/messages/count_tokens", run.body)
    assert request.headers["anthropic-beta"] == "b1"
    assert adapter.protocol_support.counts_tokens


async def test_count_tokens_without_the_endpoint_is_learnt_once(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    upstream.native = frozenset({"messages"})
    upstream.count_tokens_route = False
    adapter = make_adapter(upstream.base_url)
    with trio.fail_after(GUARD_S):
        assert await adapter.count_tokens_native(native_run("count_tokens")) is None
    assert not adapter.protocol_support.counts_tokens
    assert adapter.protocol_support.speaks("messages")  # the protocol itself is still spoken


TEXT = "user\nhow many tokens are in this text"


@pytest.mark.parametrize(
    ("dialect", "path", "sent"),
    [
        ("llama_cpp", "/tokenize", {"content": TEXT}),
        ("vllm", "/tokenize", {"model": MODEL, "prompt": TEXT}),
        ("llama_cpp_python", "/extras/tokenize/count", {"model": MODEL, "input": TEXT}),
    ],
)
async def test_the_runtime_tokenizer_is_found_then_asked_in_its_own_dialect(
    upstream: FakeUpstream,
    make_adapter: MakeAdapter,
    dialect: str,
    path: str,
    sent: dict[str, str],
) -> None:
    upstream.tokenizer = dialect
    adapter = make_adapter(upstream.base_url)
    with trio.fail_after(GUARD_S):
        assert await adapter.tokenize_count(MODEL, TEXT) == len(fake_tokens(TEXT))
        before = upstream.arrivals
        assert await adapter.tokenize_count(MODEL, TEXT) == len(fake_tokens(TEXT))
    # Found once; from then on one request, in the dialect's own fields.
    assert upstream.arrivals == before + 1
    request = upstream.requests[-1]
    assert request.path == path  # at the server root, not under /v1
    assert json.loads(request.body) == sent


async def test_a_runtime_without_a_tokenizer_is_asked_once(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    adapter = make_adapter(upstream.base_url)
    with trio.fail_after(GUARD_S):
        assert await adapter.tokenize_count(MODEL, TEXT) is None
        asked = upstream.arrivals
        assert await adapter.tokenize_count(MODEL, TEXT) is None
    assert asked == 2  # `/tokenize`, then `/extras/tokenize/count`
    assert upstream.arrivals == asked


async def test_a_failing_tokenizer_is_asked_again_next_time(
    upstream: FakeUpstream, make_adapter: MakeAdapter
) -> None:
    upstream.tokenizer = "llama_cpp"
    upstream.status = 500
    adapter = make_adapter(upstream.base_url)
    with trio.fail_after(GUARD_S):
        assert await adapter.tokenize_count(MODEL, TEXT) is None
    upstream.status = 200
    with trio.fail_after(GUARD_S):
        assert await adapter.tokenize_count(MODEL, TEXT) == len(fake_tokens(TEXT))


async def execute_native(adapter: OpenAICompatAdapter, run: Run, events: EmitEvents) -> RunResult:
    """The run sent natively, in the form its protocol's translator gives."""
    translator = TRANSLATORS.of(run.operation)
    assert translator is not None and translator.native is not None
    return await adapter.execute_native(run, translator.native, events)


def test_a_messages_stream_begun_without_message_start_gets_one_ahead_of_it() -> None:
    """llama.cpp's server, under load, now and then begins a Messages stream at
    `content_block_start`: the caller still reads `message_start` first, with the alias
    and the prompt's estimated tokens, and the upstream's events after it as they were."""
    translator = TRANSLATORS.of("messages")
    assert translator is not None
    run = native_run("messages", stream=True)
    sent = messages_events(MODEL, 2)[1:]  # no message_start
    reply = NativeReply(run, translator.native)
    out = b"".join(reply.event(name, data)[0] for name, data in sent) + reply.release()
    events = Events()
    events.pieces.append(out)
    parsed = events.parsed()
    assert [name for name, _ in parsed] == ["message_start"] + [name for name, _ in sent]
    message = parsed[0][1]["message"]
    assert (message["model"], message["role"], message["content"]) == (ALIAS, "assistant", [])
    assert message["usage"]["input_tokens"] > 0
    assert out.endswith(b"".join(sse(name, data) for name, data in sent[1:]))
    # The upstream never said its input counts: the run reports no usage of its own and
    # is metered by estimate, never at 0 prompt tokens.
    assert reply.usage is None

    whole = messages_events(MODEL, 2)  # a stream that begins as it should is left alone
    reply = NativeReply(run, translator.native)
    out = b"".join(reply.event(name, data)[0] for name, data in whole) + reply.release()
    assert out.count(b"event: message_start") == 1
    assert reply.usage is not None and reply.usage.prompt_tokens > 0


def test_data_over_several_lines_leaves_as_several_data_lines() -> None:
    """Valid SSE an upstream may send: the decoder joined the lines with a line break,
    so the caller's event gets one `data:` line per line again, never a bare one."""
    translator = TRANSLATORS.of("messages")
    assert translator is not None and translator.native is not None
    reply = NativeReply(native_run("messages", stream=True), translator.native)
    reply.event("message_start", messages_events(MODEL, 1)[0][1])
    data = b'{\n"type": "content_block_delta",\n"index": 0, "delta": {}}'
    out, _ = reply.event("content_block_delta", data)
    assert out == (
        b"event: content_block_delta\ndata: {\ndata: "
        b'"type": "content_block_delta",\ndata: "index": 0, "delta": {}}\n\n'
    )
    assert SSEDecoder().feed(out)[0].data == data  # the caller reads the upstream's data


@pytest.mark.parametrize("operation", ["messages", "responses"])
def test_an_openai_style_error_event_in_a_native_stream_is_an_in_band_error(
    operation: Operation,
) -> None:
    translator = TRANSLATORS.of(operation)
    assert translator is not None and translator.native is not None
    reply = NativeReply(native_run(operation, stream=True), translator.native)
    with pytest.raises(InBandError, match="model overloaded"):
        reply.event("message", b'{"error": {"message": "model overloaded"}}')


@pytest.mark.parametrize("operation", ["messages", "responses"])
@pytest.mark.parametrize(
    ("body", "raised"),
    [
        (b'{"error": {"message": "model overloaded", "type": "server_error"}}', InBandError),
        (
            b'{"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}',
            InBandError,
        ),
        (b"{}", NotAnObject),
        (b'{"id": "x", "content": []}', NotAnObject),
    ],
)
def test_a_whole_body_that_is_no_reply_of_the_protocol_fails_the_run(
    operation: Operation, body: bytes, raised: type[Exception]
) -> None:
    """A 200 whose body is an error, or no reply at all, is not relayed as an answer."""
    translator = TRANSLATORS.of(operation)
    assert translator is not None and translator.native is not None
    reply = NativeReply(native_run(operation), translator.native)
    with pytest.raises(raised):
        reply.response(body)


@pytest.mark.parametrize("operation", ["messages", "responses"])
async def test_a_native_stream_that_breaks_off_after_its_end_is_whole(
    upstream: FakeUpstream, make_adapter: MakeAdapter, operation: Operation
) -> None:
    upstream.native = frozenset({operation})
    upstream.cut_after_end = True
    adapter = make_adapter(upstream.base_url)
    with trio.fail_after(GUARD_S):
        result = await execute_native(adapter, native_run(operation, stream=True), Events())
    assert result.usage == USAGE
