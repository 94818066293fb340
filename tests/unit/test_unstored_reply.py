"""A Responses reply whose response was not stored says `store: false`
(iop_edge.core.responses.unstored_reply): only `store` changes, every other member is the JSON it
was, and what is not a response is left alone."""

from __future__ import annotations

import json

from iop_edge.core.responses.unstored_reply import unstored_body, unstored_events

RESPONSE = (
    b'{"id":"resp_1","store":true,'
    b'"output":[{"type":"message","text":"caf\\u00e9 1.50"}],"usage":null}'
)


def test_a_body_says_store_false_and_keeps_the_rest_byte_for_byte() -> None:
    changed = unstored_body(RESPONSE)
    assert json.loads(changed) == {**json.loads(RESPONSE), "store": False}
    assert b'"text":"caf\\u00e9 1.50"' in changed  # raw JSON, not re-encoded


def test_what_is_not_a_response_object_is_left_alone() -> None:
    for body in (b"[1, 2]", b"not json", b'{"id": "x"}'):
        assert unstored_body(body) is body


def test_the_final_events_response_says_store_false() -> None:
    delta = (
        b"event: response.output_text.delta\n"
        b'data: {"type":"response.output_text.delta","delta":"store"}\n\n'
    )
    completed = (
        b'event: response.completed\ndata: {"type":"response.completed","response":'
        + RESPONSE
        + b',"sequence_number":7}\n\n'
    )
    out = unstored_events(delta + completed)
    first, second, rest = out.split(b"\n\n")
    assert first + b"\n\n" == delta  # an event without a response is untouched
    name, data = second.split(b"\n")
    assert name == b"event: response.completed"
    event = json.loads(data.removeprefix(b"data: "))
    assert event["response"]["store"] is False
    assert event["sequence_number"] == 7 and event["response"]["id"] == "resp_1"
    assert rest == b""
