"""Golden chat streams translated to OpenAI Responses streams, judged three ways: the
golden events, the `openai` SDK (its event types, strictly validated, and its stream
accumulator over HTTP), and what the chunks themselves say the response must carry.

The cases are named after the bug classes of translating gateways (see
`golden_cases.py` and each case's `description`)."""

from __future__ import annotations

import json
from typing import Any, get_args

import openai
import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent

from .golden_cases import Case, Expected, cases, parse_sse, responses_sse
from .replay_server import ReplayServer

CASES = cases("responses")
#: The SDK's model of each event type, to validate an event against its own type (the
#: union's error for a bad event lists every member).
_EVENT_TYPES: dict[str, pydantic.TypeAdapter[Any]] = {
    get_args(model.model_fields["type"].annotation)[0]: pydantic.TypeAdapter(model)
    for model in get_args(get_args(ResponseStreamEvent)[0])
}

_DONE_OF_DELTA = {
    "response.output_text.delta": ("response.output_text.done", "text"),
    "response.reasoning_text.delta": ("response.reasoning_text.done", "text"),
    "response.refusal.delta": ("response.refusal.done", "refusal"),
    "response.function_call_arguments.delta": (
        "response.function_call_arguments.done",
        "arguments",
    ),
    "response.custom_tool_call_input.delta": ("response.custom_tool_call_input.done", "input"),
}


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_events_match_the_golden_file(case: Case) -> None:
    produced = parse_sse(responses_sse(case))
    assert produced == case.expected_events("responses", produced)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_relayed_stream_translates_the_same(case: Case) -> None:
    """Chunks an HTTP relay has read come with its reading, and text-only ones are not
    decoded again: the events are the same to the byte."""
    assert responses_sse(case, relayed=True) == responses_sse(case)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_every_event_is_an_sdk_event(case: Case) -> None:
    for event in parse_sse(responses_sse(case)):
        _EVENT_TYPES[event["event"]].validate_python(event["data"])


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_stream_grammar(case: Case) -> None:
    """One created and one in_progress, first; sequence numbers count from 0; items are
    added and done one at a time at consecutive output indices; every delta's pieces
    add up to its done event; the terminal event is last."""
    events = parse_sse(responses_sse(case))
    names = [event["event"] for event in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names.count("response.created") == names.count("response.in_progress") == 1
    assert names[-1] in ("response.completed", "response.incomplete")
    assert [event["data"]["sequence_number"] for event in events] == list(range(len(events)))
    open_index: int | None = None
    next_index = 0
    pieces: dict[tuple[str, str, int, int], list[str]] = {}
    for event in events[2:-1]:
        name, data = event["event"], event["data"]
        assert data["output_index"] == (next_index if name.endswith("item.added") else open_index)
        if name == "response.output_item.added":
            assert open_index is None
            open_index, next_index = next_index, next_index + 1
        elif name == "response.output_item.done":
            open_index = None
        elif name in _DONE_OF_DELTA:
            done, _ = _DONE_OF_DELTA[name]
            key = (done, data["item_id"], data["output_index"], data.get("content_index", 0))
            pieces.setdefault(key, []).append(data["delta"])
        elif name.endswith(".done") and name != "response.content_part.done":
            field = next(f for d, f in _DONE_OF_DELTA.values() if d == name)
            key = (name, data["item_id"], data["output_index"], data.get("content_index", 0))
            assert "".join(pieces.pop(key, [])) == data[field]
    assert open_index is None and not pieces


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_sdk_accumulates_what_the_runtime_said(
    case: Case, replay: ReplayServer, openai_client: openai.OpenAI
) -> None:
    expected = Expected.of(case)
    replay.stream(responses_sse(case))
    with openai_client.responses.stream(model="alias-model", input="hi") as stream:
        last = None
        for event in stream:
            last = event
        # The helper's final response is the one of `response.completed`; an incomplete
        # response ends with `response.incomplete`, which carries it too.
        assert last is not None and last.type in ("response.completed", "response.incomplete")
        response = (
            stream.get_final_response() if last.type == "response.completed" else last.response
        )
    assert response.model == "alias-model" and response.id == "resp_g1"
    assert response.output_text == expected.text
    reasoning = [
        part.text
        for item in response.output
        if item.type == "reasoning"
        for part in item.content or ()
    ]
    assert "".join(reasoning) == expected.thinking
    calls = [item for item in response.output if item.type in ("function_call", "custom_tool_call")]
    assert [_call(item) for item in calls] == [
        _expected_call(call.name, call.arguments) for call in expected.calls
    ]
    assert len({item.call_id for item in calls}) == len(calls)
    usage, got = expected.usage, response.usage
    assert usage is not None and got is not None
    assert got.input_tokens == usage.prompt_tokens
    assert got.input_tokens_details.cached_tokens == usage.cached_tokens
    assert got.output_tokens == usage.completion_tokens
    assert got.output_tokens_details.reasoning_tokens == usage.reasoning_tokens
    incomplete = expected.finish_reason in ("length", "content_filter")
    assert response.status == ("incomplete" if incomplete else "completed")


def _call(item: Any) -> tuple[str, str | None, Any]:
    if item.type == "custom_tool_call":
        return (item.name, item.namespace, item.input)
    return (item.name, item.namespace, json.loads(item.arguments))


def _expected_call(chat_name: str, arguments: str) -> tuple[str, str | None, Any]:
    """The caller's view of a chat call, per the request of the Codex case (`apply_patch`
    is a custom tool; `<namespace>__<name>` a namespaced function)."""
    namespace, _, name = chat_name.rpartition("__")
    if chat_name == "apply_patch":
        return (chat_name, None, json.loads(arguments)["input"])
    return (name, namespace or None, json.loads(arguments or "{}"))


def test_exactly_one_created_event_for_a_runtime_that_repeats_its_role() -> None:
    case = next(case for case in CASES if case.name == "one_start_event")
    names = [event["event"] for event in parse_sse(responses_sse(case))]
    assert names.count("response.created") == 1
    assert names.count("response.output_item.added") == 1


def test_text_is_sent_once() -> None:
    """The text of the final object and of the done events is the deltas' text, once."""
    case = next(case for case in CASES if case.name == "text_sent_once")
    events = parse_sse(responses_sse(case))
    deltas = [e["data"]["delta"] for e in events if e["event"] == "response.output_text.delta"]
    done = [e["data"]["text"] for e in events if e["event"] == "response.output_text.done"]
    final = events[-1]["data"]["response"]["output"]
    assert "".join(deltas) == "Hello, world!"
    assert done == ["Hello, world!"]
    assert [part["text"] for item in final for part in item["content"]] == ["Hello, world!"]
