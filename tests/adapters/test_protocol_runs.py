"""Messages, Responses and `count_tokens` runs through the Node's runner to an HTTP
upstream (the fake, on a real socket): native when it speaks the protocol, translated
when it does not, and the 404 that teaches the Node which (design §14)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from iop_node.adapters.base import Emit, RunResult
from iop_node.adapters.ollama import OllamaAdapter
from iop_node.adapters.openai_compat import OpenAICompatAdapter
from iop_node.health import HealthMonitor
from iop_node.runs import runner
from iop_node.runs.protocol_run.messages import MessagesTranslator
from iop_node.runs.protocol_run.responses import ResponsesTranslator
from iop_node.runs.protocol_run.translator import Translator
from schemas.config import AdapterSettings, ProviderConfig
from schemas.protocols import CallerProtocol
from schemas.tokens import estimate_input_tokens, template_tokens, text_tokens
from schemas.wire import FailureCode, Operation, ProviderStatus, Run, RunDone, RunFailed, Usage
from tests.node_runs import run_to_end, sse_events

from .conftest import MODEL
from .fake_data import PROMPT_TOKENS
from .fake_protocols import CACHED_TOKENS, NATIVE_COUNT, fake_tokens, messages_events
from .fake_upstream import LLAMA_CPP, FakeUpstream

ALIAS = "team-alias"
#: The fake's counts on the wire: the cached tokens it reports are a part of the prompt.
USAGE = Usage(
    prompt_tokens=PROMPT_TOKENS,
    completion_tokens=3,
    total_tokens=PROMPT_TOKENS + 3,
    cached_tokens=CACHED_TOKENS,
)
CHAT_USAGE = Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=3, total_tokens=PROMPT_TOKENS + 3)
MESSAGES_BODY: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 64,
    "system": "be brief",
    "messages": [{"role": "user", "content": "hi"}],
}
RESPONSES_BODY: dict[str, Any] = {"model": MODEL, "instructions": "be brief", "input": "hi"}


def make_adapter(
    upstream: FakeUpstream, protocols: list[CallerProtocol] | None = None
) -> OpenAICompatAdapter:
    """A `vllm`-type provider: by default it is assumed to speak all three protocols."""
    return OpenAICompatAdapter(
        ProviderConfig(
            id="p1",
            type="vllm",
            models=[MODEL],
            capacity=4,
            adapter=AdapterSettings(base_url=upstream.base_url, protocols=protocols),
        )
    )


@pytest.fixture
async def upstream(nursery: trio.Nursery) -> FakeUpstream:
    fake = FakeUpstream()
    await nursery.start(fake.serve)
    return fake


def protocol_run(
    operation: Operation,
    body: dict[str, Any] | None = None,
    *,
    stream: bool = False,
    keep_output: bool = False,
    hold_tail: bool = False,
) -> Run:
    if body is None:
        body = RESPONSES_BODY if operation == "responses" else MESSAGES_BODY
    payload = {**body, "stream": True} if stream else body
    return Run(
        run_id="r1",
        provider_id="p1",
        target=MODEL,
        operation=operation,
        body=json.dumps(payload).encode(),
        stream=stream,
        reply_model=ALIAS,
        request_id="req_1",
        keep_output=keep_output,
        hold_tail=hold_tail,
    )


def paths(upstream: FakeUpstream) -> list[str]:
    return [request.path for request in upstream.requests]


# --- native ---------------------------------------------------------------------------------


@pytest.mark.parametrize("operation", ["messages", "responses"])
async def test_a_native_stream_goes_to_the_protocols_endpoint(
    upstream: FakeUpstream, operation: Operation
) -> None:
    upstream.native = frozenset({"messages", "responses"})
    adapter = make_adapter(upstream)
    try:
        chunks, end = await run_to_end(adapter, protocol_run(operation, stream=True))
    finally:
        await adapter.aclose()
    assert paths(upstream) == [f"/v1/{operation}"]
    events = sse_events(chunks)
    assert events[-1][0] == ("message_stop" if operation == "messages" else "response.completed")
    assert all(b"[DONE]" not in chunk for chunk in chunks)
    models = [
        value[key]["model"]
        for _, value in events
        for key in ("message", "response")
        if isinstance(value.get(key), dict)
    ]
    assert models and set(models) == {ALIAS}
    assert end == RunDone(run_id="r1", usage=USAGE, usage_source="provider")


async def test_a_native_non_stream_answer_has_the_alias(upstream: FakeUpstream) -> None:
    upstream.native = frozenset({"responses"})
    adapter = make_adapter(upstream, ["chat", "responses"])
    try:
        chunks, end = await run_to_end(adapter, protocol_run("responses"))
    finally:
        await adapter.aclose()
    assert chunks == []
    assert isinstance(end, RunDone) and end.response is not None
    assert json.loads(end.response)["model"] == ALIAS
    assert (end.usage, end.usage_source) == (USAGE, "provider")


@pytest.mark.parametrize("operation", ["messages", "responses"])
async def test_a_native_answer_without_an_alias_keeps_the_upstreams_model(
    upstream: FakeUpstream, operation: CallerProtocol
) -> None:
    upstream.native = frozenset({operation})
    adapter = make_adapter(upstream, ["chat", operation])
    run = msgspec.structs.replace(protocol_run(operation), reply_model="")
    try:
        _, end = await run_to_end(adapter, run)
    finally:
        await adapter.aclose()
    assert isinstance(end, RunDone) and end.response is not None
    assert json.loads(end.response)["model"] == MODEL


@pytest.mark.parametrize("operation", ["messages", "responses"])
async def test_ollama_speaks_both_protocols_natively_under_v1(
    upstream: FakeUpstream, operation: Operation
) -> None:
    upstream.native = frozenset({"messages", "responses"})
    adapter = OllamaAdapter(
        ProviderConfig(
            id="p1",
            type="ollama",
            models=[MODEL],
            capacity=2,
            adapter=AdapterSettings(base_url=upstream.base_url),
        )
    )
    try:
        _, end = await run_to_end(adapter, protocol_run(operation))
    finally:
        await adapter.aclose()
    assert paths(upstream) == [f"/v1/{operation}"]
    assert isinstance(end, RunDone) and end.response is not None
    assert json.loads(end.response)["model"] == ALIAS
    assert end.usage == USAGE


# --- the stream's last events travel with its end ------------------------------------------

#: What a held-back stream's end carries: native, the events that end it; translated,
#: everything the translator writes when the chat stream is over.
HELD_NATIVE: dict[str, list[str]] = {
    "messages": ["message_delta", "message_stop"],
    "responses": ["response.completed"],
}
HELD_TRANSLATED: dict[str, list[str]] = {
    "messages": ["content_block_stop", "message_delta", "message_stop"],
    "responses": [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ],
}


@pytest.mark.parametrize("path", ["native", "translated"])
@pytest.mark.parametrize("operation", ["messages", "responses"])
async def test_with_hold_tail_the_last_events_come_inside_run_done(
    upstream: FakeUpstream, operation: CallerProtocol, path: str
) -> None:
    """A caller may hang up the moment it reads them: the Edge must have the run's end
    first, so they travel in it, and nothing else about the stream changes."""
    native = path == "native"
    upstream.native = frozenset({operation}) if native else frozenset()
    adapter = make_adapter(upstream, ["chat", operation] if native else ["chat"])
    keep = operation == "responses"
    try:
        plain, plain_end = await run_to_end(
            adapter, protocol_run(operation, stream=True, keep_output=keep)
        )
        held, end = await run_to_end(
            adapter, protocol_run(operation, stream=True, keep_output=keep, hold_tail=True)
        )
    finally:
        await adapter.aclose()
    assert isinstance(end, RunDone) and end.tail is not None
    tail = [name for name, _ in sse_events([end.tail])]
    assert tail == (HELD_NATIVE if native else HELD_TRANSLATED)[operation]
    before = [name for name, _ in sse_events(held)]
    assert not set(before) & set(HELD_NATIVE[operation])
    assert before + tail == [name for name, _ in sse_events(plain)]
    assert isinstance(plain_end, RunDone) and plain_end.tail is None
    assert (end.usage, end.usage_source) == (plain_end.usage, plain_end.usage_source)
    if keep:  # the stored response is the one the last event carries
        assert end.response is not None
        assert json.loads(end.response) == sse_events([end.tail])[-1][1]["response"]


async def test_a_held_message_delta_reaches_the_caller_when_the_stream_breaks_off(
    upstream: FakeUpstream,
) -> None:
    """Held back for the end, the stop reason and usage still go out ahead of a failure,
    as the upstream sent them."""
    upstream.native = frozenset({"messages"})
    upstream.drop_after_chunks = len(messages_events(MODEL, upstream.chunks)) - 1
    adapter = make_adapter(upstream, ["chat", "messages"])
    try:
        chunks, end = await run_to_end(
            adapter, protocol_run("messages", stream=True, hold_tail=True)
        )
    finally:
        await adapter.aclose()
    assert isinstance(end, RunFailed) and end.code == FailureCode.UPSTREAM_STREAM_ERROR
    events = sse_events(chunks)
    assert events[-1][0] == "message_delta"
    assert events[-1][1]["usage"]["output_tokens"] == upstream.chunks


async def test_last_events_too_large_to_travel_beside_the_response_go_ahead_as_a_chunk(
    upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stored Responses stream repeats its whole output in the tail and the response:
    when one message cannot hold both, the events go ahead of the end, not lost."""
    upstream.native = frozenset({"responses"})
    adapter = make_adapter(upstream, ["chat", "responses"])
    run = protocol_run("responses", stream=True, keep_output=True, hold_tail=True)
    try:
        _, sized = await run_to_end(adapter, run)
        assert isinstance(sized, RunDone) and sized.tail and sized.response
        limit = max(len(sized.tail), len(sized.response)) + 1
        monkeypatch.setattr(runner, "MAX_PAYLOAD_BYTES", limit)
        chunks, end = await run_to_end(adapter, run)
    finally:
        await adapter.aclose()
    assert isinstance(end, RunDone) and end.tail is None
    assert chunks[-1] == sized.tail and end.response == sized.response


# --- learned: the upstream does not speak it ------------------------------------------------


@pytest.mark.parametrize("status", [404, 405])
async def test_a_missing_native_endpoint_is_learnt_and_the_run_translated(
    upstream: FakeUpstream, status: int
) -> None:
    upstream.native_missing_status = status
    adapter = make_adapter(upstream)
    try:
        chunks, end = await run_to_end(adapter, protocol_run("messages", stream=True))
        assert paths(upstream) == ["/v1/messages", "/v1/chat/completions"]
        assert not adapter.protocol_support.speaks("messages")
        assert adapter.protocol_support.speaks("responses")  # not asked yet: still assumed
        # The caller got a whole Messages stream, translated from the chat stream (whose
        # chunks carry reasoning and text each: thinking and text blocks take turns).
        events = sse_events(chunks)
        names = [name for name, _ in events]
        assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
        assert events[0][1]["message"]["model"] == ALIAS
        deltas = [value["delta"] for name, value in events if name == "content_block_delta"]
        assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == "tok0 tok1 tok2 "
        assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == (
            "why0why1why2"
        )
        assert events[-2][1]["delta"]["stop_reason"] == "end_turn"
        # Translated: the fake's chat answers report no cache.
        assert end == RunDone(run_id="r1", usage=CHAT_USAGE, usage_source="provider")
        # The chat request asked for the usage chunk (which no caller saw as a chunk).
        chat = json.loads(upstream.requests[-1].body)
        assert chat["stream_options"] == {"include_usage": True}
        assert chat["messages"][0] == {"role": "system", "content": "be brief"}

        # From now on, straight to chat: the native endpoint is not asked again.
        await run_to_end(adapter, protocol_run("messages", stream=True))
        assert paths(upstream)[2:] == ["/v1/chat/completions"]
    finally:
        await adapter.aclose()


async def test_what_was_learnt_is_reported_in_the_next_status(upstream: FakeUpstream) -> None:
    adapter = make_adapter(upstream)
    reports: list[list[ProviderStatus]] = []

    async def report(statuses: list[ProviderStatus], probed: list[str]) -> None:
        reports.append(statuses)

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(HealthMonitor({"p1": adapter}, report).run)
            assert [status.protocols for status in reports[-1]] == [
                ["chat", "messages", "responses"]
            ]
            await run_to_end(adapter, protocol_run("responses"))
            await trio.testing.wait_all_tasks_blocked()
            # Reported at once, not at the next probe ten seconds from now.
            assert len(reports) == 2
            assert [status.protocols for status in reports[-1]] == [["chat", "messages"]]
            assert reports[-1][0].health == "available"
            nursery.cancel_scope.cancel()
    finally:
        await adapter.aclose()


async def test_an_explicit_protocol_list_is_trusted(upstream: FakeUpstream) -> None:
    adapter = make_adapter(upstream, ["chat", "messages"])
    try:
        chunks, end = await run_to_end(adapter, protocol_run("messages", stream=True))
    finally:
        await adapter.aclose()
    # The operator said the runtime speaks Messages: its 404 is the run's failure, seen
    # by the Edge (another provider may serve it), and nothing is learnt.
    assert chunks == []
    assert isinstance(end, RunFailed)
    assert (end.code, end.status, end.retryable) == ("upstream_misconfigured", 404, True)
    assert adapter.protocol_support.speaks("messages")
    assert paths(upstream) == ["/v1/messages"]


# --- translated -----------------------------------------------------------------------------


async def test_keep_output_returns_the_final_response_of_a_translated_stream(
    upstream: FakeUpstream,
) -> None:
    adapter = make_adapter(upstream, ["chat"])
    try:
        chunks, end = await run_to_end(
            adapter, protocol_run("responses", stream=True, keep_output=True)
        )
    finally:
        await adapter.aclose()
    events = sse_events(chunks)
    completed = events[-1]
    assert completed[0] == "response.completed"
    assert isinstance(end, RunDone) and end.response is not None
    final = json.loads(end.response)
    assert final == completed[1]["response"]  # what the caller saw last, stored as is
    assert (final["id"], final["model"], final["status"]) == ("resp_req_1", ALIAS, "completed")
    text = [
        part["text"]
        for item in final["output"]
        if item["type"] == "message"
        for part in item["content"]
    ]
    assert "".join(text) == "tok0 tok1 tok2 "
    assert final["usage"]["input_tokens"] == PROMPT_TOKENS


async def test_a_runtime_that_reports_no_usage_gets_an_estimate(nursery: trio.Nursery) -> None:
    upstream = FakeUpstream(**LLAMA_CPP)  # ignores `stream_options`: no usage chunk
    await nursery.start(upstream.serve)
    adapter = make_adapter(upstream, ["chat"])
    try:
        chunks, end = await run_to_end(adapter, protocol_run("messages", stream=True))
    finally:
        await adapter.aclose()
    chat = json.loads(upstream.requests[-1].body)
    prompt = estimate_input_tokens(chat)
    assert isinstance(end, RunDone)
    # Three text chunks and the final one: the tally's one token per short chunk.
    assert end.usage == Usage(prompt_tokens=prompt, completion_tokens=3, total_tokens=prompt + 3)
    assert end.usage_source == "estimated"
    delta = [value for name, value in sse_events(chunks) if name == "message_delta"]
    assert delta[0]["usage"]["output_tokens"] == 3


class _ChatWithoutUsage:
    """A chat-only adapter whose runtime answers without a `usage` (and reports none)."""

    provider = ProviderConfig(id="p1", type="cli", models=[MODEL], capacity=1)

    async def execute(self, run: Run, emit: Emit) -> RunResult:
        message = {"role": "assistant", "content": "four words of text"}
        body = {"object": "chat.completion", "choices": [{"index": 0, "message": message}]}
        return RunResult(response=json.dumps(body).encode())

    async def probe(self) -> ProviderStatus:
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("operation", ["messages", "responses"])
async def test_a_whole_reply_without_usage_shows_the_estimate(operation: Operation) -> None:
    """The caller's body carries what the run is metered at, not zeros."""
    chunks, end = await run_to_end(_ChatWithoutUsage(), protocol_run(operation))
    assert chunks == []
    assert isinstance(end, RunDone) and end.usage is not None and end.response is not None
    assert end.usage_source == "estimated" and end.usage.prompt_tokens > 0
    usage = json.loads(end.response)["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (
        end.usage.prompt_tokens,
        end.usage.completion_tokens,
    )
    assert usage["output_tokens"] > 0


async def test_a_request_that_cannot_be_translated_fails_naming_the_field(
    upstream: FakeUpstream,
) -> None:
    adapter = make_adapter(upstream, ["chat"])
    body = {
        **MESSAGES_BODY,
        "messages": [{"role": "user", "content": [{"type": "hologram", "data": "x"}]}],
    }
    try:
        chunks, end = await run_to_end(adapter, protocol_run("messages", body, stream=True))
    finally:
        await adapter.aclose()
    assert chunks == []
    assert isinstance(end, RunFailed)
    assert (end.code, end.status, end.retryable) == ("invalid_request", 400, False)
    assert end.param == "messages[0].content[0].type"
    assert end.message.startswith("messages[0].content[0].type: ")
    assert end.usage is None  # nothing ran: nothing is metered
    assert upstream.requests_total == 0


# --- count_tokens ---------------------------------------------------------------------------


async def test_count_tokens_asks_a_messages_upstream_itself(upstream: FakeUpstream) -> None:
    upstream.native = frozenset({"messages"})
    adapter = make_adapter(upstream)
    try:
        chunks, end = await run_to_end(adapter, protocol_run("count_tokens"))
    finally:
        await adapter.aclose()
    assert chunks == []
    assert end == RunDone(
        run_id="r1",
        usage=Usage(),
        response=json.dumps({"input_tokens": NATIVE_COUNT}, separators=(",", ":")).encode(),
        usage_source="provider",
    )
    assert paths(upstream) == ["/v1/messages/count_tokens"]


RENDERED = "system\nbe brief\nuser\nhi"
#: The chat template's share of the translated request (a system and a user message).
TEMPLATE = template_tokens(
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
)


@pytest.mark.parametrize("dialect", ["llama_cpp", "vllm", "llama_cpp_python"])
async def test_count_tokens_uses_the_runtime_tokenizer(
    upstream: FakeUpstream, dialect: str
) -> None:
    upstream.tokenizer = dialect  # and Messages is not spoken: its routes are 404
    adapter = make_adapter(upstream)
    try:
        _, end = await run_to_end(adapter, protocol_run("count_tokens"))
    finally:
        await adapter.aclose()
    expected = len(fake_tokens(RENDERED)) + TEMPLATE
    assert isinstance(end, RunDone) and end.response is not None
    assert json.loads(end.response) == {"input_tokens": expected}
    assert (end.usage, end.usage_source) == (Usage(), "provider")
    assert paths(upstream)[0] == "/v1/messages/count_tokens"  # asked once, then learnt
    assert not adapter.protocol_support.counts_tokens


async def test_count_tokens_without_a_tokenizer_is_estimated(upstream: FakeUpstream) -> None:
    adapter = make_adapter(upstream, ["chat"])
    try:
        _, end = await run_to_end(adapter, protocol_run("count_tokens"))
    finally:
        await adapter.aclose()
    assert isinstance(end, RunDone) and end.response is not None
    expected = text_tokens(RENDERED) + TEMPLATE
    assert json.loads(end.response) == {"input_tokens": expected}
    assert (end.usage, end.usage_source) == (Usage(), "estimated")
    assert paths(upstream) == ["/tokenize", "/extras/tokenize/count"]


@pytest.mark.parametrize(
    ("translator", "chat_param", "caller_param"),
    [
        (ResponsesTranslator(), "messages", "input"),
        (ResponsesTranslator(), "messages[3].content", "input"),  # items do not correspond
        (ResponsesTranslator(), "max_completion_tokens", "max_output_tokens"),
        (ResponsesTranslator(), "response_format.json_schema", "text.format"),
        (ResponsesTranslator(), "temperature", "temperature"),  # the same in both
        (MessagesTranslator(), "messages[1].content[0]", "messages"),
        (MessagesTranslator(), "stop", "stop_sequences"),
        (MessagesTranslator(), "top_p", "top_p"),
    ],
)
def test_a_refusals_param_is_said_in_the_callers_terms(
    translator: Translator, chat_param: str, caller_param: str
) -> None:
    assert translator.caller_param(chat_param) == caller_param
