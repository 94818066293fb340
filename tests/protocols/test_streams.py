"""The stream translators beyond the golden cases: failures, empty runs, usage
precedence, and the upstream streams that cannot be translated."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest

from iop_node.protocols import (
    MessagesStream,
    ReplyTranslationError,
    ResponsesStream,
    TokenUsage,
)
from iop_node.protocols.chat_view import text_delta
from iop_node.reply import read_chunk as relay_read

from .golden_cases import parse_sse
from .replay_server import ReplayServer

REQUEST = json.dumps({"model": "served", "input": "hi", "stream": True}).encode()


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **top: Any) -> bytes:
    choices = (
        []
        if delta is None and finish is None
        else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    )
    return json.dumps(
        {"id": "c", "object": "chat.completion.chunk", "choices": choices, **top}
    ).encode()


def _call(
    index: int | None, *, id: str | None = None, name: str | None = None, args: str | None = None
) -> bytes:
    fragment: dict[str, Any] = {"function": {}}
    if index is not None:
        fragment["index"] = index
    if id is not None:
        fragment["id"] = id
    if name is not None:
        fragment["function"]["name"] = name
    if args is not None:
        fragment["function"]["arguments"] = args
    return _chunk({"tool_calls": [fragment]})


def _responses() -> ResponsesStream:
    return ResponsesStream("alias", "r1", REQUEST, clock=lambda: 1.0)


def _names(data: bytes) -> list[str]:
    return [event["event"] for event in parse_sse(data)]


# --- Messages ----------------------------------------------------------------------------


def test_messages_failure_mid_stream_is_an_error_the_sdk_raises(
    replay: ReplayServer, anthropic_client: anthropic.Anthropic
) -> None:
    stream = MessagesStream("alias", "r1")
    data = stream.feed(_chunk({"content": "Hel"})) + stream.fail(
        "the runtime went away", "upstream_stream_error"
    )
    assert _names(data)[-1] == "error"
    replay.stream(data)
    seen: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as caught:
        for event in anthropic_client.messages.create(
            model="alias", max_tokens=5, messages=[{"role": "user", "content": "hi"}], stream=True
        ):
            seen.append(event.type)
    assert seen[:2] == ["message_start", "content_block_start"]
    body: Any = caught.value.body
    assert body["error"] == {
        "type": "api_error",
        "message": "upstream_stream_error: the runtime went away",
    }


def test_messages_busy_failure_is_overloaded() -> None:
    stream = MessagesStream("alias", "r1")
    [event] = parse_sse(stream.fail("no slot", "busy"))
    assert event["data"]["error"]["type"] == "overloaded_error"


def test_messages_a_run_that_said_nothing(
    replay: ReplayServer, anthropic_client: anthropic.Anthropic
) -> None:
    stream = MessagesStream("alias", "r1", input_tokens=11)
    data = stream.finish(TokenUsage(prompt_tokens=11, completion_tokens=0))
    assert _names(data) == ["message_start", "message_delta", "message_stop"]
    replay.stream(data)
    with anthropic_client.messages.stream(
        model="alias", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
    ) as sdk:
        message = sdk.get_final_message()
    assert message.content == [] and message.stop_reason == "end_turn"
    assert message.usage.input_tokens == 11


def test_messages_usage_precedence() -> None:
    """message_start has the caller's estimate until the runtime says; the runtime's
    numbers beat the fallback passed to finish."""
    stream = MessagesStream("alias", "r1", input_tokens=50)
    start = parse_sse(stream.feed(_chunk({"content": "x"})))[0]
    assert start["data"]["message"]["usage"]["input_tokens"] == 50
    stream.feed(_chunk(usage={"prompt_tokens": 40, "completion_tokens": 2}))
    delta = parse_sse(stream.finish(TokenUsage(prompt_tokens=99, completion_tokens=99)))[-2]
    assert delta["data"]["usage"]["input_tokens"] == 40
    assert delta["data"]["usage"]["output_tokens"] == 2


def test_messages_usage_in_the_first_chunk_is_in_message_start() -> None:
    stream = MessagesStream("alias", "r1")
    first = _chunk(
        {"content": "x"},
        usage={
            "prompt_tokens": 30,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 20},
        },
    )
    start = parse_sse(stream.feed(first))[0]["data"]["message"]["usage"]
    assert (start["input_tokens"], start["cache_read_input_tokens"], start["output_tokens"]) == (
        10,
        20,
        0,
    )


def test_messages_fragments_before_the_name_are_kept_in_order() -> None:
    stream = MessagesStream("alias", "r1")
    data = stream.feed(_call(0, id="c1", args='{"a"')) + stream.feed(
        _call(0, name="f", args=": 1}")
    )
    events = parse_sse(data + stream.finish())
    start = next(e for e in events if e["event"] == "content_block_start")
    assert start["data"]["content_block"]["name"] == "f"
    pieces = [
        e["data"]["delta"]["partial_json"] for e in events if e["event"] == "content_block_delta"
    ]
    assert pieces == ['{"a"', ": 1}"]


def test_messages_interleaved_call_fragments_are_refused() -> None:
    stream = MessagesStream("alias", "r1")
    stream.feed(_call(0, id="a", name="f", args='{"x": 1}'))
    stream.feed(_call(1, id="b", name="g", args="{}"))
    with pytest.raises(ReplyTranslationError) as caught:
        stream.feed(_call(0, args=', "y": 2'))
    assert caught.value.param == "choices[0].delta.tool_calls[0].function.arguments"


@pytest.mark.parametrize("make", [lambda: MessagesStream("alias", "r1"), _responses])
def test_a_call_begun_before_the_last_ones_arguments_are_whole_is_named_so(
    make: Callable[[], Any],
) -> None:
    """An upstream interleaving two calls' arguments: the error says that, not that the
    first call's arguments are not JSON."""
    stream = make()
    stream.feed(_call(0, id="a", name="f", args='{"ci'))
    with pytest.raises(ReplyTranslationError) as caught:
        stream.feed(_call(1, id="b", name="g", args="{}"))
    assert "began tool call 1 before the arguments of tool call 0 formed a JSON object" in (
        str(caught.value)
    )


def test_messages_a_call_never_named_is_refused() -> None:
    stream = MessagesStream("alias", "r1")
    stream.feed(_call(0, id="a", args="{}"))
    with pytest.raises(ReplyTranslationError, match="never said which tool"):
        stream.finish()


def test_messages_an_ended_stream_takes_nothing_more() -> None:
    stream = MessagesStream("alias", "r1")
    stream.finish()
    with pytest.raises(RuntimeError, match="already ended"):
        stream.feed(_chunk({"content": "x"}))
    with pytest.raises(RuntimeError, match="already ended"):
        stream.finish()
    with pytest.raises(RuntimeError, match="already ended"):
        stream.fail("m", "c")


def test_a_call_the_output_limit_cut_ends_the_stream_as_a_limit_not_a_failure() -> None:
    """Messages: the `tool_use` block closes as it stands, `max_tokens`; Responses: the
    call item is `incomplete`, and so is the response."""
    cut = [_call(0, id="a", name="f", args='{"path": "a.t'), _chunk(finish="length")]
    messages = MessagesStream("alias", "r1")
    events = parse_sse(b"".join(messages.feed(chunk) for chunk in cut) + messages.finish())
    names = [event["event"] for event in events]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["data"]["delta"]["stop_reason"] == "max_tokens"
    responses = _responses()
    events = parse_sse(b"".join(responses.feed(chunk) for chunk in cut) + responses.finish())
    final = events[-1]
    assert final["event"] == "response.incomplete"
    [item] = final["data"]["response"]["output"]
    assert (item["status"], item["arguments"]) == ("incomplete", '{"path": "a.t')


@pytest.mark.parametrize("arguments", ['{"path": "a.txt"', '["a.txt"]', "path=a.txt"])
def test_malformed_call_arguments_end_no_stream_normally(arguments: str) -> None:
    """Arguments relayed as they came that do not add up to a JSON object are found when
    the call closes: at the end, or when the next block or item begins. The stream can
    then only fail (an error event), never stop as if the call were sound."""
    param = "choices[0].delta.tool_calls[0].function.arguments"
    for stream in (MessagesStream("alias", "r1"), _responses()):
        stream.feed(_call(0, id="a", name="f", args=arguments))
        with pytest.raises(ReplyTranslationError, match="not a JSON object") as caught:
            stream.finish()
        assert caught.value.param == param
        assert _names(stream.fail(str(caught.value), "upstream_stream_error"))[-1] in (
            "error",
            "response.failed",
        )
    for stream in (MessagesStream("alias", "r1"), _responses()):
        stream.feed(_call(0, id="a", name="f", args=arguments))
        with pytest.raises(ReplyTranslationError) as caught:
            stream.feed(_call(1, id="b", name="g", args="{}"))
        assert caught.value.param == param


@pytest.mark.parametrize(
    ("chunk", "param"),
    [
        (b"data: nope", None),
        (b'{"choices": [{"delta": {"content": 5}}]}', "choices[0].delta.content"),
    ],
)
def test_a_chunk_that_is_not_chat_completions(chunk: bytes, param: str | None) -> None:
    for stream in (MessagesStream("alias", "r1"), _responses()):
        with pytest.raises(ReplyTranslationError) as caught:
            stream.feed(chunk)
        assert caught.value.param == param


# --- Responses ---------------------------------------------------------------------------


def test_responses_failure_mid_stream(replay: ReplayServer, openai_client: openai.OpenAI) -> None:
    stream = _responses()
    data = stream.feed(_chunk({"content": "Hel"})) + stream.fail(
        "the runtime went away", "upstream_stream_error"
    )
    replay.stream(data)
    events = list(openai_client.responses.create(model="alias", input="hi", stream=True))
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    failed = events[-1]
    assert failed.type == "response.failed"
    response = failed.response
    assert response.status == "failed" and response.error is not None
    assert response.error.code == "server_error"
    assert response.error.message == "upstream_stream_error: the runtime went away"
    [item] = response.output
    assert item.type == "message" and item.status == "incomplete"
    assert json.loads(stream.final_response()) == json.loads(data.split(b"data: ")[-1])["response"]


def test_responses_failure_before_any_chunk() -> None:
    stream = _responses()
    with pytest.raises(RuntimeError, match="not ended"):
        stream.final_response()
    events = parse_sse(stream.fail("no slot", "busy"))
    assert [e["event"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]
    assert events[-1]["data"]["response"]["error"]["code"] == "rate_limit_exceeded"


def test_responses_final_response_is_the_completed_one(
    replay: ReplayServer, openai_client: openai.OpenAI
) -> None:
    stream = _responses()
    data = stream.feed(_chunk({"content": "Hi"})) + stream.finish(
        TokenUsage(prompt_tokens=3, completion_tokens=1)
    )
    completed = parse_sse(data)[-1]["data"]["response"]
    assert json.loads(stream.final_response()) == completed
    assert completed["usage"]["input_tokens"] == 3
    replay.answer(stream.final_response())
    assert openai_client.responses.retrieve("resp_r1").output_text == "Hi"


def test_responses_refusal_is_a_part_of_the_message() -> None:
    stream = _responses()
    data = stream.feed(_chunk({"content": "I"})) + stream.feed(_chunk({"refusal": "cannot."}))
    events = parse_sse(data + stream.finish())
    names = [e["event"] for e in events]
    assert names.count("response.output_item.added") == 1
    refusal = next(e["data"] for e in events if e["event"] == "response.refusal.delta")
    assert refusal["content_index"] == 1 and refusal["delta"] == "cannot."
    [message] = events[-1]["data"]["response"]["output"]
    assert message["content"] == [
        {"type": "output_text", "text": "I", "annotations": [], "logprobs": []},
        {"type": "refusal", "refusal": "cannot."},
    ]


def test_responses_interleaved_call_fragments_are_refused() -> None:
    stream = _responses()
    stream.feed(_call(0, id="a", name="f", args='{"x": 1}'))
    stream.feed(_call(1, id="b", name="g", args="{}"))
    with pytest.raises(ReplyTranslationError):
        stream.feed(_call(0, args=', "y": 2'))


def test_responses_an_ended_stream_takes_nothing_more() -> None:
    stream = _responses()
    stream.fail("m", "upstream_error")
    with pytest.raises(RuntimeError, match="already ended"):
        stream.feed(_chunk({"content": "x"}))


def test_responses_custom_call_without_its_argument_fails_cleanly() -> None:
    request = {"model": "m", "input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]}
    stream = ResponsesStream("alias", "r1", json.dumps(request).encode())
    stream.feed(_call(0, id="a", name="apply_patch", args='{"n": 1}'))
    with pytest.raises(ReplyTranslationError, match="one string argument"):
        stream.finish()
    events = parse_sse(stream.fail("bad tool call", "upstream_error"))
    assert [e["event"] for e in events] == ["response.failed"]
    assert events[0]["data"]["response"]["status"] == "failed"


# --- chunks a relay has read -------------------------------------------------------------


def test_a_relay_reading_of_text_is_used_as_it_is() -> None:
    """The text of a relayed chunk comes from the relay's reading (the translator does
    not decode it again); anything more than text is read whole."""
    text = _chunk({"content": "Hi"})
    assert text_delta(relay_read(text)) == (None, "Hi", None)
    for more in (
        _chunk({"content": "Hi"}, "stop"),
        _call(0, id="c1", name="f", args="{}"),
        _chunk({"content": "Hi"}, usage={"prompt_tokens": 1, "completion_tokens": 1}),
        _chunk({"content": [{"type": "text", "text": "Hi"}]}),
        _chunk(),
    ):
        assert text_delta(relay_read(more)) is None


def test_a_relayed_chunk_that_is_broken_fails_as_one_read_whole() -> None:
    chunk = _chunk({"content": [{"type": "text", "text": "Hi"}]})
    for stream in (MessagesStream("alias", "r1"), _responses()):
        with pytest.raises(ReplyTranslationError) as caught:
            stream.feed(chunk, relay_read(chunk))
        assert caught.value.param == "choices[0].delta.content"


@pytest.mark.parametrize("stored", [True, False])
def test_responses_every_lifecycle_event_of_a_stored_response_says_store_true(
    stored: bool,
) -> None:
    """`responses_reply` Rule 1: the body says `store: false` (the Edge is the store); a
    response the Edge stores says `store: true` in each event that carries it."""
    body = json.dumps({"model": "served", "input": "hi", "stream": True, "store": False})
    stream = ResponsesStream("alias", "r1", body.encode(), clock=lambda: 1.0, stored=stored)
    data = stream.feed(_chunk({"content": "Hi"})) + stream.finish(
        TokenUsage(prompt_tokens=3, completion_tokens=1)
    )
    lifecycle = [e for e in parse_sse(data) if "response" in e["data"]]
    assert [e["event"] for e in lifecycle] == [
        "response.created",
        "response.in_progress",
        "response.completed",
    ]
    assert all(e["data"]["response"]["store"] is stored for e in lifecycle)
    assert json.loads(stream.final_response())["store"] is stored
