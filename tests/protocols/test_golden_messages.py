"""Golden chat streams translated to Anthropic Messages streams, judged three ways: the
golden events, the `anthropic` SDK (its event types, strictly validated, and its stream
accumulator over HTTP), and what the chunks themselves say the message must carry.

The cases are named after the bug classes of translating gateways (see
`golden_cases.py` and each case's `description`)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pydantic
import pytest
from anthropic.types import RawMessageStreamEvent

from .golden_cases import Case, Expected, cases, messages_sse, parse_sse
from .replay_server import ReplayServer

CASES = cases("messages")
_events = pydantic.TypeAdapter(RawMessageStreamEvent)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_events_match_the_golden_file(case: Case) -> None:
    produced = parse_sse(messages_sse(case))
    assert produced == case.expected_events("messages", produced)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_relayed_stream_translates_the_same(case: Case) -> None:
    """Chunks an HTTP relay has read come with its reading, and text-only ones are not
    decoded again: the events are the same to the byte."""
    assert messages_sse(case, relayed=True) == messages_sse(case)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_every_event_is_an_sdk_event(case: Case) -> None:
    for event in parse_sse(messages_sse(case)):
        _events.validate_python(event["data"], strict=True)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_stream_grammar(case: Case) -> None:
    """One message_start, first; blocks open and close one at a time, at consecutive
    indices; message_delta then message_stop, last."""
    names = [event["event"] for event in parse_sse(messages_sse(case))]
    events = parse_sse(messages_sse(case))
    assert names.count("message_start") == 1 and names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    open_index: int | None = None
    next_index = 0
    for event in events[1:-2]:
        data = event["data"]
        if event["event"] == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index = data["index"], next_index + 1
        elif event["event"] == "content_block_delta":
            assert data["index"] == open_index
        else:
            assert event["event"] == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert open_index is None


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_sdk_accumulates_what_the_runtime_said(
    case: Case, replay: ReplayServer, anthropic_client: anthropic.Anthropic
) -> None:
    expected = Expected.of(case)
    replay.stream(messages_sse(case))
    with anthropic_client.messages.stream(
        model="alias-model", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        for _ in stream:
            pass
        message = stream.get_final_message()
    assert message.model == "alias-model" and message.id == "msg_g1"
    texts = [block.text for block in message.content if block.type == "text"]
    thinking = [block.thinking for block in message.content if block.type == "thinking"]
    calls = [block for block in message.content if block.type == "tool_use"]
    assert "".join(texts) == expected.text
    assert "".join(thinking) == expected.thinking
    assert [(call.name, call.input) for call in calls] == [
        (call.name, json.loads(call.arguments or "{}")) for call in expected.calls
    ]
    assert len({call.id for call in calls}) == len(calls)
    usage = expected.usage
    assert usage is not None
    assert message.usage.input_tokens == usage.prompt_tokens - usage.cached_tokens
    assert message.usage.cache_read_input_tokens == usage.cached_tokens
    assert message.usage.output_tokens == usage.completion_tokens
    if calls:
        assert message.stop_reason == "tool_use"


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_arguments_stream_as_they_arrive(case: Case) -> None:
    """Each argument fragment is one input_json_delta of its call's block, never text."""
    expected = Expected.of(case)
    events = parse_sse(messages_sse(case))
    blocks: dict[int, str] = {}
    deltas: dict[int, list[str]] = {}
    for event in events:
        data: dict[str, Any] = event["data"]
        if event["event"] == "content_block_start":
            blocks[data["index"]] = data["content_block"]["type"]
        elif (
            event["event"] == "content_block_delta" and data["delta"]["type"] == "input_json_delta"
        ):
            assert blocks[data["index"]] == "tool_use"
            deltas.setdefault(data["index"], []).append(data["delta"]["partial_json"])
    streamed = [deltas[index] for index in sorted(deltas)]
    assert len(streamed) == len(expected.calls)
    for pieces, call in zip(streamed, expected.calls, strict=True):
        assert "".join(pieces) == (call.arguments or "{}")
        assert len(pieces) == max(call.fragments, 1)


def test_thinking_never_reaches_a_text_block() -> None:
    case = next(case for case in CASES if case.name == "thinking_deltas_in_their_own_block")
    events = parse_sse(messages_sse(case))
    kinds = [
        e["data"]["content_block"]["type"] for e in events if e["event"] == "content_block_start"
    ]
    assert kinds == ["thinking", "text", "thinking", "text"]
    for event in events:
        if (
            event["event"] == "content_block_delta"
            and event["data"]["delta"]["type"] == "text_delta"
        ):
            assert "Paris" not in event["data"]["delta"]["text"]
