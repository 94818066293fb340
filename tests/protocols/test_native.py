"""Native replies on their way to the caller: the alias in `model`, usage read, every
other byte as the upstream wrote it."""

from __future__ import annotations

import json
from typing import Any

import pydantic
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseCompletedEvent

from iop_node.protocols import MessagesNative, ResponsesNative, TokenUsage

_anthropic_event = pydantic.TypeAdapter(RawMessageStreamEvent)

MESSAGE_START = (
    b'{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant",'
    b'"model":"served/Qwen3","content":[],"stop_reason":null,"stop_sequence":null,'
    b'"usage":{"input_tokens":25,"cache_creation_input_tokens":5,'
    b'"cache_read_input_tokens":300,"output_tokens":1}}}'
)
DELTA = (
    b'{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi \\u00e9"}}'
)
MESSAGE_DELTA = (
    b'{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},'
    b'"usage":{"output_tokens":42}}'
)


def test_messages_stream() -> None:
    native = MessagesNative("alias")
    start = native.event(MESSAGE_START, "message_start")
    event: Any = _anthropic_event.validate_json(start)
    assert event.message.model == "alias"
    assert json.loads(start)["message"]["usage"] == json.loads(MESSAGE_START)["message"]["usage"]
    assert native.usage == TokenUsage(prompt_tokens=330, completion_tokens=1, cached_tokens=300)
    # The bulk is not read at all when the event name is known, and untouched without it.
    assert native.event(DELTA, "content_block_delta") is DELTA
    assert native.event(DELTA) is DELTA
    assert native.event(MESSAGE_DELTA, "message_delta") is MESSAGE_DELTA
    # Counts are cumulative: the input counts of message_start stay.
    assert native.usage == TokenUsage(prompt_tokens=330, completion_tokens=42, cached_tokens=300)


def test_messages_stream_without_event_names() -> None:
    native = MessagesNative("alias")
    assert json.loads(native.event(MESSAGE_START))["message"]["model"] == "alias"
    native.event(MESSAGE_DELTA)
    assert native.usage is not None and native.usage.completion_tokens == 42


def test_messages_body() -> None:
    body = (
        b'{"id":"msg_1","type":"message","role":"assistant","model":"served","content":'
        b'[{"type":"text","text":"ok"}],"stop_reason":"end_turn","stop_sequence":null,'
        b'"usage":{"input_tokens":7,"output_tokens":2}}'
    )
    native = MessagesNative("alias")
    message = Message.model_validate_json(native.response(body))
    assert message.model == "alias" and message.content[0].type == "text"
    assert native.usage == TokenUsage(prompt_tokens=7, completion_tokens=2)


def test_what_is_not_an_object_passes_as_it_is() -> None:
    for native in (MessagesNative("alias"), ResponsesNative("alias")):
        assert native.event(b"[DONE]") == b"[DONE]"
        assert native.response(b"oops") == b"oops"
        assert native.usage is None


def _response(status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": status,
        "model": "served",
        "output": [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "usage": usage,
    }


USAGE = {
    "input_tokens": 90,
    "input_tokens_details": {"cached_tokens": 64, "cache_write_tokens": 0},
    "output_tokens": 12,
    "output_tokens_details": {"reasoning_tokens": 5},
    "total_tokens": 102,
}


def test_responses_stream() -> None:
    native = ResponsesNative("alias")
    created = json.dumps(
        {
            "type": "response.created",
            "sequence_number": 0,
            "response": _response("in_progress", None),
        }
    ).encode()
    assert json.loads(native.event(created, "response.created"))["response"]["model"] == "alias"
    assert native.usage is None
    delta = b'{"type":"response.output_text.delta","sequence_number":3,"delta":"x"}'
    assert native.event(delta, "response.output_text.delta") is delta
    completed = json.dumps(
        {
            "type": "response.completed",
            "sequence_number": 9,
            "response": _response("completed", USAGE),
        }
    ).encode()
    out = native.event(completed)
    event = ResponseCompletedEvent.model_validate_json(out)
    assert event.response.model == "alias" and event.response.tools[0].type == "function"
    assert native.usage == TokenUsage(
        prompt_tokens=90, completion_tokens=12, cached_tokens=64, reasoning_tokens=5
    )
    assert native.final_response is not None
    assert Response.model_validate_json(native.final_response) == event.response


def test_responses_body() -> None:
    native = ResponsesNative("alias")
    response = Response.model_validate_json(
        native.response(json.dumps(_response("completed", USAGE)).encode())
    )
    assert response.model == "alias"
    assert native.usage is not None and native.usage.prompt_tokens == 90


def test_an_empty_alias_leaves_the_model_alone() -> None:
    """`run.reply_model` empty: the upstream's `model` stays, byte for byte; the usage is
    read all the same."""
    messages = MessagesNative("")
    assert messages.event(MESSAGE_START, "message_start") is MESSAGE_START
    assert messages.usage is not None and messages.usage.prompt_tokens == 330
    body = json.dumps(_response("completed", USAGE)).encode()
    responses = ResponsesNative("")
    assert responses.response(body) is body
    completed = json.dumps(
        {
            "type": "response.completed",
            "sequence_number": 1,
            "response": _response("completed", USAGE),
        }
    ).encode()
    assert responses.event(completed, "response.completed") is completed
    assert responses.final_response is not None
    assert json.loads(responses.final_response)["model"] == "served"
    assert responses.usage is not None and responses.usage.completion_tokens == 12


def _lifecycle(kind: str, status: str, **members: Any) -> bytes:
    response = {**_response(status, USAGE if status == "completed" else None), **members}
    return json.dumps({"type": kind, "sequence_number": 0, "response": response}).encode()


def test_a_stored_response_says_store_true_as_its_caller_asked() -> None:
    """The Edge stores the run's response, so the runtime was sent `store: false` and
    echoes it; the caller asked for `store: true` and sees it, in every lifecycle event,
    the final response kept for the store and a whole body alike."""
    native = ResponsesNative("alias", stored=True)
    for kind, status in (
        ("response.created", "in_progress"),
        ("response.in_progress", "in_progress"),
        ("response.completed", "completed"),
    ):
        shaped = json.loads(native.event(_lifecycle(kind, status, store=False), kind))
        assert shaped["response"]["store"] is True and shaped["response"]["model"] == "alias"
    assert native.final_response is not None
    assert Response.model_validate_json(native.final_response).store is True
    body = json.dumps({**_response("completed", USAGE), "store": False}).encode()
    assert Response.model_validate_json(native.response(body)).store is True
    # Already true: nothing to rewrite (with no alias to write either, the bytes stay).
    keep_model = ResponsesNative("", stored=True)
    already = json.dumps({**_response("completed", USAGE), "store": True}).encode()
    assert keep_model.response(already) is already
    # A reply that says nothing of `store` is not given one.
    silent = json.dumps(_response("completed", USAGE)).encode()
    assert "store" not in json.loads(keep_model.response(silent))


def test_a_response_not_stored_keeps_the_store_false_its_caller_sent() -> None:
    native = ResponsesNative("alias")
    created = native.event(_lifecycle("response.created", "in_progress", store=False))
    assert json.loads(created)["response"]["store"] is False
    body = json.dumps({**_response("completed", USAGE), "store": False}).encode()
    assert Response.model_validate_json(native.response(body)).store is False


def test_a_continued_response_echoes_the_previous_response_id_the_edge_took_out() -> None:
    """The runtime got the conversation without `previous_response_id` and echoes `null`;
    the caller sees the id it sent, in every lifecycle event and a whole body alike. A
    run that continues nothing leaves the runtime's bytes as they are."""
    native = ResponsesNative("", previous_response_id="resp_before")
    for kind, status in (("response.created", "in_progress"), ("response.completed", "done")):
        event = json.loads(_lifecycle(kind, status, store=False))
        event["response"]["previous_response_id"] = None
        shaped = json.loads(native.event(json.dumps(event).encode(), kind))
        assert shaped["response"]["previous_response_id"] == "resp_before"
    assert json.loads(native.final_response or b"{}")["previous_response_id"] == "resp_before"
    body = json.dumps({**_response("completed", USAGE), "previous_response_id": None}).encode()
    assert json.loads(native.response(body))["previous_response_id"] == "resp_before"
    untouched = ResponsesNative("")
    assert untouched.response(body) is body


def test_a_stream_that_numbers_nothing_gets_its_indexes_filled_in() -> None:
    """llama.cpp's server sends Responses events without `sequence_number`,
    `output_index` or `content_index`: each is filled in, in the order the events came
    (items by when they were added, parts by the last one added to their item)."""
    native = ResponsesNative("alias")
    sent = [
        {"type": "response.created", "response": _response("in_progress", None)},
        {"type": "response.output_item.added", "item": {"id": "rs_1", "type": "reasoning"}},
        {"type": "response.output_item.added", "item": {"id": "msg_1", "type": "message"}},
        {"type": "response.content_part.added", "item_id": "msg_1", "part": {}},
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "a"},
        {"type": "response.content_part.added", "item_id": "msg_1", "part": {}},
        {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "b"},
        {"type": "response.output_item.added", "item": {"id": "fc_1", "type": "function_call"}},
        {"type": "response.function_call_arguments.delta", "item_id": "fc_1", "delta": "{}"},
        {"type": "response.output_item.done", "item": {"id": "msg_1", "type": "message"}},
    ]
    got = [json.loads(native.event(json.dumps(event).encode(), event["type"])) for event in sent]
    assert [event["sequence_number"] for event in got] == list(range(len(sent)))
    assert [event.get("output_index") for event in got] == [None, 0, 1, 1, 1, 1, 1, 2, 2, 1]
    assert [event.get("content_index") for event in got] == (
        [None, None, None, 0, 0, 1, 1, None, None, None]
    )
    assert got[0]["response"]["model"] == "alias"  # shaped as ever


def test_a_stream_that_numbers_its_events_is_relayed_as_it_is() -> None:
    native = ResponsesNative("alias")
    created = {"type": "response.created", "sequence_number": 0}
    native.event(json.dumps(created).encode(), "response.created")
    delta = b'{"type":"response.output_text.delta","item_id":"m","delta":"x"}'
    assert native.event(delta, "response.output_text.delta") is delta
