"""Every body and stream event IOP writes on the translated path, and its own error bodies,
checked against the official SDKs' models and the members the specifications require
(`conformance`): whole replies of every kind, every golden stream's events in both
protocols, failed streams, and the Edge's own errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from iop_edge.http.errors import ApiError
from iop_edge.http.protocols.messages import MESSAGES
from iop_edge.http.protocols.responses import RESPONSES
from iop_edge.runtime.runs.dispatch import RunPlan
from iop_node.protocols import (
    MessagesStream,
    ResponsesStream,
    TokenUsage,
    messages_response_from_chat,
    responses_response_from_chat,
)
from schemas.protocols import error_body

from .conformance import (
    check_message,
    check_messages_error,
    check_messages_event,
    check_response,
    check_responses_event,
)
from .golden_cases import cases, messages_sse, parse_sse, responses_sse

NOW = 1767225600.0

#: A Responses request as Codex-like callers send it: function tools without `strict`,
#: one with no description, settings left to their defaults.
REQUEST: dict[str, Any] = {
    "model": "m",
    "input": "What is the weather in Oslo?",
    "tools": [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
        {"type": "function", "name": "get_time", "parameters": {"type": "object"}},
    ],
}
USAGE = {
    "prompt_tokens": 120,
    "completion_tokens": 30,
    "total_tokens": 150,
    "prompt_tokens_details": {"cached_tokens": 100},
    "completion_tokens_details": {"reasoning_tokens": 12},
}
TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}

#: Whole chat replies of every kind a runtime sends: (message, finish_reason, usage).
REPLIES: dict[str, tuple[dict[str, Any], str | None, dict[str, Any] | None]] = {
    "text": ({"content": "It is sunny."}, "stop", USAGE),
    "tool_call": ({"content": None, "tool_calls": [TOOL_CALL]}, "tool_calls", USAGE),
    "text_and_tool_calls": (
        {
            "reasoning_content": "The user wants weather.",
            "content": "Let me look.",
            "tool_calls": [
                TOOL_CALL,
                {"id": "", "type": "function", "function": {"name": "get_time", "arguments": ""}},
            ],
        },
        "tool_calls",
        USAGE,
    ),
    "refusal": ({"content": None, "refusal": "I cannot."}, "content_filter", None),
    "cut_at_max_tokens": ({"content": "It is"}, "length", None),
    "empty": ({"content": None}, "stop", None),
}


def _chat(message: dict[str, Any], finish: str | None, usage: dict[str, Any] | None) -> bytes:
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "served",
        "choices": [
            {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}
        ],
    }
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body).encode()


# --- whole replies ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", REPLIES)
def test_a_translated_response_has_every_member_the_schema_requires(kind: str) -> None:
    chat = _chat(*REPLIES[kind])
    response = json.loads(
        responses_response_from_chat(
            chat,
            reply_model="alias",
            request_id="r1",
            request=json.dumps(REQUEST).encode(),
            usage=TokenUsage(prompt_tokens=9, completion_tokens=3),
            clock=lambda: NOW,
        )
    )
    check_response(response)
    assert (response["presence_penalty"], response["frequency_penalty"]) == (0.0, 0.0)
    weather, time_tool = response["tools"]
    assert weather["strict"] is None and weather["parameters"] == REQUEST["tools"][0]["parameters"]
    assert time_tool["description"] is None


@pytest.mark.parametrize("kind", REPLIES)
def test_a_translated_message_has_every_member_the_sdks_declare(kind: str) -> None:
    chat = _chat(*REPLIES[kind])
    message = json.loads(
        messages_response_from_chat(
            chat,
            reply_model="alias",
            request_id="r1",
            usage=TokenUsage(prompt_tokens=9, completion_tokens=3),
        )
    )
    check_message(message)
    assert message["stop_reason"] is not None  # non-stream: always says why it stopped
    usage = message["usage"]
    if REPLIES[kind][2] is USAGE:
        assert usage["output_tokens_details"] == {"thinking_tokens": 12}
        assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (20, 100)


def test_the_response_echoes_the_previous_response_id_passed_beside_the_body() -> None:
    """The Edge takes `previous_response_id` out of the body (it sends the conversation
    instead); the response still names the response it continues."""
    chat = _chat({"content": "Hi."}, "stop", USAGE)
    body = json.dumps({"model": "m", "input": [], "store": False}).encode()
    response = json.loads(
        responses_response_from_chat(
            chat,
            reply_model="alias",
            request_id="r2",
            request=body,
            stored=True,
            previous_response_id="resp_earlier",
        )
    )
    check_response(response)
    assert (response["previous_response_id"], response["store"]) == ("resp_earlier", True)
    stream = ResponsesStream("alias", "r2", body, previous_response_id="resp_earlier")
    chunk = json.dumps(
        {"choices": [{"index": 0, "delta": {"content": "Hi."}, "finish_reason": "stop"}]}
    ).encode()
    events = parse_sse(stream.feed(chunk) + stream.finish())
    lifecycle = [e["data"]["response"] for e in events if "response" in e["data"]]
    assert [r["previous_response_id"] for r in lifecycle] == ["resp_earlier"] * 3


# --- streams ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", cases("responses"), ids=lambda case: case.name)
def test_every_translated_responses_event_validates(case: Any) -> None:
    events = parse_sse(responses_sse(case))
    for event in events:
        check_responses_event(event["data"])
    assert events[-1]["data"]["response"]["completed_at"] is not None or (
        events[-1]["event"] == "response.incomplete"
    )


@pytest.mark.parametrize("case", cases("messages"), ids=lambda case: case.name)
def test_every_translated_messages_event_validates(case: Any) -> None:
    for event in parse_sse(messages_sse(case)):
        check_messages_event(event["data"])


def test_message_start_carries_the_prompts_tokens_and_message_delta_the_runtimes() -> None:
    stream = MessagesStream("alias", "r3", input_tokens=42)
    chunk = json.dumps(
        {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": "stop"}]}
    ).encode()
    events = parse_sse(
        stream.feed(chunk) + stream.finish(TokenUsage(prompt_tokens=40, completion_tokens=1))
    )
    for event in events:
        check_messages_event(event["data"])
    assert events[0]["data"]["message"]["usage"]["input_tokens"] == 42
    delta = next(e["data"] for e in events if e["event"] == "message_delta")
    assert (delta["usage"]["input_tokens"], delta["usage"]["output_tokens"]) == (40, 1)


def test_failed_streams_validate() -> None:
    chunk = json.dumps(
        {"choices": [{"index": 0, "delta": {"content": "Hal"}, "finish_reason": None}]}
    ).encode()
    responses = ResponsesStream("alias", "r4", json.dumps(REQUEST).encode())
    events = parse_sse(
        responses.feed(chunk) + responses.fail("upstream went away", "upstream_error")
    )
    for event in events:
        check_responses_event(event["data"])
    assert events[-1]["data"]["response"]["status"] == "failed"
    messages = MessagesStream("alias", "r4")
    events = parse_sse(messages.feed(chunk) + messages.fail("upstream went away", "busy"))
    for event in events[:-1]:
        check_messages_event(event["data"])
    check_messages_error(events[-1]["data"])
    assert events[-1]["data"]["request_id"] == "r4"


# --- the Edge's own errors ----------------------------------------------------------------


def test_error_bodies_carry_the_request_id() -> None:
    error = ApiError(404, "The model 'x' does not exist", code="model_not_found")
    body = json.loads(MESSAGES.error_body(error, "req_9"))
    check_messages_error(body)
    assert body["request_id"] == "req_9"
    check_messages_error(json.loads(error_body("messages", 503, "draining")))


def _plan(**fields: Any) -> RunPlan:
    return RunPlan(
        run_id="req_5",
        model_id="m",
        operation="responses",
        body={**REQUEST, "store": False},
        stream=True,
        long=False,
        caller_wants_usage=True,
        protocol="responses",
        **fields,
    )


def test_the_edges_own_stream_failures_validate() -> None:
    error = ApiError(502, "the Node went away", code="node_lost")
    plan = _plan(keep_output=True, previous_response_id="resp_before")
    framed = RESPONSES.stream_error(error, plan=plan, sequence=7, request_id="req_5")
    (event,) = parse_sse(framed)
    check_responses_event(event["data"])
    response = event["data"]["response"]
    # the request asked to store it; a failed response is not stored, and says so
    assert (response["store"], response["previous_response_id"]) == (False, "resp_before")
    assert response["error"] == {"code": "server_error", "message": "node_lost: the Node went away"}
    framed = MESSAGES.stream_error(error, plan=plan, sequence=7, request_id="req_5")
    (event,) = parse_sse(framed)
    check_messages_error(event["data"])
    assert event["data"]["request_id"] == "req_5"
