"""Whole (non-stream) chat completions as Messages and Responses replies, parsed by the
official SDKs (`messages.create`, `responses.create`) from a real HTTP answer."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest

from iop_node.protocols import (
    MessagesStream,
    ReplyTranslationError,
    TokenUsage,
    messages_response_from_chat,
    read_responses_request,
    responses_response_from_chat,
)
from iop_node.protocols.responses_reply import closing_members, echo_members

from .golden_cases import parse_sse
from .replay_server import ReplayServer

NOW = 1767225600.0


def _chat(
    message: dict[str, Any],
    finish: str | None = "stop",
    usage: dict[str, Any] | None = None,
    **choice: Any,
) -> bytes:
    body: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "served",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", **message},
                "finish_reason": finish,
                **choice,
            }
        ],
    }
    if usage is not None:
        body["usage"] = usage
    return json.dumps(body).encode()


USAGE = {
    "prompt_tokens": 120,
    "completion_tokens": 30,
    "total_tokens": 150,
    "prompt_tokens_details": {"cached_tokens": 100},
    "completion_tokens_details": {"reasoning_tokens": 12},
}
FULL = {
    "reasoning_content": "Think first.",
    "content": "Calling two tools.",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        },
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": ""}},
    ],
}


def _messages(chat: bytes) -> bytes:
    return messages_response_from_chat(chat, reply_model="alias", request_id="r7")


def _responses(chat: bytes, request: dict[str, Any] | None = None) -> bytes:
    body = json.dumps(request or {"model": "served", "input": "hi"}).encode()
    return responses_response_from_chat(
        chat, reply_model="alias", request_id="r7", request=body, clock=lambda: NOW
    )


def test_messages_reply(replay: ReplayServer, anthropic_client: anthropic.Anthropic) -> None:
    replay.answer(_messages(_chat(FULL, "tool_calls", USAGE)))
    message = anthropic_client.messages.create(
        model="alias", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.id == "msg_r7" and message.model == "alias" and message.role == "assistant"
    thinking, text, weather, time = message.content
    assert thinking.type == "thinking" and thinking.thinking == "Think first."
    assert text.type == "text" and text.text == "Calling two tools."
    assert weather.type == "tool_use" and (weather.id, weather.name, weather.input) == (
        "call_1",
        "get_weather",
        {"city": "Oslo"},
    )
    # A repeated runtime id is replaced by a deterministic one; no arguments is `{}`.
    assert time.type == "tool_use" and (time.id, time.input) == ("toolu_r7_1", {})
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    assert message.usage.input_tokens == 20
    assert message.usage.cache_read_input_tokens == 100
    assert message.usage.cache_creation_input_tokens == 0
    assert message.usage.output_tokens == 30


@pytest.mark.parametrize(
    ("finish", "extra", "reason", "sequence"),
    [
        ("stop", {}, "end_turn", None),
        ("length", {}, "max_tokens", None),
        ("tool_calls", {}, "tool_use", None),
        ("content_filter", {}, "refusal", None),
        ("stop", {"stop_reason": "###"}, "stop_sequence", "###"),
        ("stop", {"stop_reason": 128009}, "end_turn", None),  # a stop token, not a string
        (None, {}, "end_turn", None),
    ],
)
def test_messages_stop_reasons(
    finish: str | None, extra: dict[str, Any], reason: str, sequence: str | None
) -> None:
    reply = json.loads(_messages(_chat({"content": "x"}, finish, **extra)))
    assert (reply["stop_reason"], reply["stop_sequence"]) == (reason, sequence)


def test_messages_reply_without_usage_or_content() -> None:
    reply = json.loads(_messages(_chat({"content": None}, "stop")))
    assert reply["content"] == []
    assert reply["usage"] == {
        "input_tokens": 0,
        "output_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "cache_creation": {"ephemeral_1h_input_tokens": 0, "ephemeral_5m_input_tokens": 0},
        "output_tokens_details": None,
        "server_tool_use": None,
        "service_tier": "standard",
        "inference_geo": None,
    }


def test_a_reply_without_usage_shows_the_fallback() -> None:
    """The Node's count (an estimate, or an adapter's own) stands in for usage the
    runtime left out; the runtime's own numbers win when it has them."""
    fallback = TokenUsage(prompt_tokens=21, completion_tokens=4)
    chat = _chat({"content": "hi"}, "stop")
    usage = json.loads(
        messages_response_from_chat(chat, reply_model="a", request_id="r", usage=fallback)
    )["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (21, 4)
    request = json.dumps({"model": "served", "input": "hi"}).encode()
    usage = json.loads(
        responses_response_from_chat(
            chat, reply_model="a", request_id="r", request=request, usage=fallback
        )
    )["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (21, 4, 25)
    reported = _chat({"content": "hi"}, "stop", {"prompt_tokens": 9, "completion_tokens": 1})
    usage = json.loads(
        messages_response_from_chat(reported, reply_model="a", request_id="r", usage=fallback)
    )["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (9, 1)


@pytest.mark.parametrize("arguments", ['{"city": "Oslo"', "[1, 2]", "Oslo"])
def test_messages_tool_arguments_that_are_not_an_object(arguments: str) -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    with pytest.raises(ReplyTranslationError) as caught:
        _messages(_chat({"tool_calls": [call]}, "tool_calls"))
    assert caught.value.param == "choices[0].message.tool_calls[0].function.arguments"


def test_a_tool_call_the_output_limit_cut_ends_the_reply_incomplete_not_failed(
    replay: ReplayServer, anthropic_client: anthropic.Anthropic, openai_client: openai.OpenAI
) -> None:
    """Anthropic's `max_tokens` with an incomplete `tool_use` last, OpenAI's `incomplete`
    with the call as far as it got: the caller raises the limit and asks again."""
    cut = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"city": "Par'}}
    whole = {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}
    chat = _chat({"tool_calls": [whole, cut]}, "length")
    replay.answer(_messages(chat))
    message = anthropic_client.messages.create(
        model="alias", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.stop_reason == "max_tokens"
    assert [(block.type, block.input) for block in message.content] == [  # type: ignore[union-attr]
        ("tool_use", {}),
        ("tool_use", {}),
    ]
    replay.answer(_responses(chat))
    response = openai_client.responses.create(model="alias", input="hi")
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    last = response.output[-1]
    assert last.type == "function_call" and last.arguments == '{"city": "Par'
    assert last.status == "incomplete"


def test_a_runtime_tool_call_id_anthropic_refuses_is_replaced_alike_in_reply_and_stream() -> None:
    """vLLM's Kimi-K2 parser writes `functions.get_weather:0`; a Messages history holding
    it is a 400 at Anthropic and at every proxy that checks ids."""
    call = {
        "id": "functions.get_weather:0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": "{}"},
    }
    [block] = json.loads(_messages(_chat({"tool_calls": [call]}, "tool_calls")))["content"]
    assert block["id"] == "toolu_r7_0"
    stream = MessagesStream("alias", "r7")
    chunk = {"tool_calls": [{"index": 0, **call}]}
    body = {"id": "c", "object": "chat.completion.chunk"}
    events = parse_sse(
        stream.feed(json.dumps({**body, "choices": [{"index": 0, "delta": chunk}]}).encode())
        + stream.finish()
    )
    [start] = [e["data"] for e in events if e["event"] == "content_block_start"]
    assert start["content_block"]["id"] == "toolu_r7_0"


def test_a_reply_that_is_not_chat_completions() -> None:
    with pytest.raises(ReplyTranslationError) as caught:
        _messages(b'{"choices": "none"}')
    assert caught.value.param == "choices"
    with pytest.raises(ReplyTranslationError, match="not JSON"):
        _responses(b"<html>")


def test_responses_reply(replay: ReplayServer, openai_client: openai.OpenAI) -> None:
    tools = [
        {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
        {"type": "function", "name": "get_time"},
    ]
    request = {
        "model": "served",
        "input": "hi",
        "instructions": "Be brief.",
        "tools": tools,
        "previous_response_id": "resp_prev",
        "store": True,
        "max_output_tokens": 99,
    }
    replay.answer(_responses(_chat(FULL, "tool_calls", USAGE), request))
    response = openai_client.responses.create(model="alias", input="hi")
    assert response.id == "resp_r7" and response.model == "alias"
    assert response.status == "completed" and response.created_at == NOW
    reasoning, message, weather, time = response.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content or ()] == [
        "Think first."
    ]
    assert message.type == "message" and response.output_text == "Calling two tools."
    assert weather.type == "function_call" and (
        weather.call_id,
        weather.name,
        weather.arguments,
    ) == (
        "call_1",
        "get_weather",
        '{"city": "Oslo"}',
    )
    assert time.type == "function_call" and (time.call_id, time.arguments) == ("call_r7_1", "{}")
    assert len({item.id for item in response.output}) == 4
    # The request's settings are echoed as sent.
    assert response.instructions == "Be brief."
    assert [tool.name for tool in response.tools if tool.type == "function"] == [
        "get_weather",
        "get_time",
    ]
    assert response.previous_response_id == "resp_prev"
    assert response.max_output_tokens == 99
    assert json.loads(replay.reply.body)["store"] is True
    usage = response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (120, 30, 150)
    assert usage.input_tokens_details.cached_tokens == 100
    assert usage.output_tokens_details.reasoning_tokens == 12


def test_responses_custom_and_namespaced_calls() -> None:
    tools = [
        {"type": "custom", "name": "apply_patch"},
        {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "go"}]},
    ]
    calls = [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "apply_patch", "arguments": '{"input": "*** Begin"}'},
        },
        {"id": "b", "type": "function", "function": {"name": "ns__go", "arguments": "{}"}},
    ]
    reply = json.loads(
        _responses(_chat({"tool_calls": calls}, "tool_calls"), {"model": "m", "tools": tools})
    )
    assert reply["output"] == [
        {
            "type": "custom_tool_call",
            "id": "ctc_r7_0",
            "call_id": "a",
            "name": "apply_patch",
            "input": "*** Begin",
        },
        {
            "type": "function_call",
            "id": "fc_r7_1",
            "status": "completed",
            "call_id": "b",
            "name": "go",
            "arguments": "{}",
            "namespace": "ns",
        },
    ]


def test_responses_incomplete_and_refusal() -> None:
    reply = json.loads(_responses(_chat({"content": "It is"}, "length")))
    assert reply["status"] == "incomplete"
    assert reply["incomplete_details"] == {"reason": "max_output_tokens"}
    assert reply["output"][0]["status"] == "incomplete"
    refused = json.loads(_responses(_chat({"content": None, "refusal": "No."}, "content_filter")))
    assert refused["incomplete_details"] == {"reason": "content_filter"}
    assert refused["output"][0]["content"] == [{"type": "refusal", "refusal": "No."}]


def test_responses_defaults_echoed_for_a_bare_request() -> None:
    reply = json.loads(_responses(_chat({"content": "x"})))
    assert reply["tools"] == [] and reply["tool_choice"] == "auto"
    assert reply["parallel_tool_calls"] is True and reply["store"] is True
    assert reply["text"] == {"format": {"type": "text"}}
    assert reply["completed_at"] == int(NOW)


def test_responses_custom_call_without_its_string_argument() -> None:
    tools = [{"type": "custom", "name": "apply_patch"}]
    call = {
        "id": "a",
        "type": "function",
        "function": {"name": "apply_patch", "arguments": '{"n": 1}'},
    }
    with pytest.raises(ReplyTranslationError) as caught:
        _responses(_chat({"tool_calls": [call]}, "tool_calls"), {"model": "m", "tools": tools})
    assert caught.value.param == "choices[0].message.tool_calls[0].function.arguments"


def test_a_request_read_once_replies_as_its_body_does() -> None:
    """The Node reads a run's Responses body once and hands the reading to the reply's
    translator: the reply is byte for byte the one made from the body itself."""
    tools = [
        {"type": "custom", "name": "apply_patch"},
        {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "go"}]},
    ]
    body = json.dumps({"model": "m", "input": "hi", "tools": tools, "top_p": 0.5}).encode()
    chat = _chat({"content": "x", "tool_calls": [FULL["tool_calls"][0]]}, "tool_calls")
    read = read_responses_request(body)
    replies = [
        responses_response_from_chat(
            chat, reply_model="alias", request_id="r7", request=request, clock=lambda: NOW
        )
        for request in (body, read)
    ]
    assert replies[0] == replies[1]
    assert json.loads(replies[1])["top_p"] == 0.5


def test_the_echo_closes_a_response_object_in_openais_order() -> None:
    echo = echo_members(b'{"model":"m","store":false,"metadata":{"a":"b"},"user":null}')
    assert echo.startswith(b',"instructions":null,') and echo.endswith(b',"user":null}')
    fields = json.loads(b'{"id":"x"' + echo)
    assert list(fields)[:3] == ["id", "instructions", "max_output_tokens"]
    assert (fields["store"], fields["metadata"], fields["top_p"]) == (False, {"a": "b"}, 1.0)
    # a body that is not a JSON object echoes the defaults
    assert json.loads(b'{"id":"x"' + echo_members(b"[1, 2]"))["store"] is True


@pytest.mark.parametrize(
    ("encoded", "members"),
    [(b'{"a":1}', b',"a":1}'), (b'{"a":1,"b":[{}]}', b',"a":1,"b":[{}]}'), (b"{}", b"}")],
)
def test_closing_members(encoded: bytes, members: bytes) -> None:
    assert closing_members(encoded) == members
    assert json.loads(b'{"z":0' + members) == {"z": 0, **json.loads(encoded)}


@pytest.mark.parametrize("encoded", [b"[]", b"", b'"{}"', b"{"])
def test_closing_members_of_what_is_not_an_object(encoded: bytes) -> None:
    with pytest.raises(ValueError, match="not an encoded JSON object"):
        closing_members(encoded)


@pytest.mark.parametrize("stored", [True, False])
def test_a_stored_response_says_store_true_whatever_the_body_says(stored: bool) -> None:
    """The Edge stores the response (`run.keep_output`), so it sent the Node the body with
    `store: false`: the response says `store: true`, as the caller asked; one the Edge
    does not store echoes the body's `store` (the caller's false)."""
    body = {"model": "m", "input": "hi", "store": False}
    reply = responses_response_from_chat(
        _chat({"content": "x"}),
        reply_model="alias",
        request_id="r1",
        request=read_responses_request(json.dumps(body).encode()),
        clock=lambda: NOW,
        stored=stored,
    )
    assert json.loads(reply)["store"] is stored
    assert (
        json.loads(b'{"id":"x"' + echo_members(b'{"store":false}', stored=stored))["store"]
        is stored
    )
