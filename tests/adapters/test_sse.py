"""The SSE decoder is a pure state machine: fed bytes in any split, it yields the same events."""

from __future__ import annotations

import pytest

from iop_node.adapters.sse import SSEDecoder, SSEError, SSEEvent

STREAM = (
    b": keep-alive comment\n"
    b'data: {"a": 1}\n'
    b"\n"
    b"event: error\r\n"
    b'data: {"error": {"message": "boom"}}\r\n'
    b"\r\n"
    b"data:first\r"
    b"data: second\r"
    b"\r"
    b"id: 7\n"
    b"retry: 100\n"
    b"\n"
    b"data: [DONE]\n\n"
)
EVENTS = [
    SSEEvent(data=b'{"a": 1}'),
    SSEEvent(data=b'{"error": {"message": "boom"}}', event="error"),
    SSEEvent(data=b"first\nsecond"),
    SSEEvent(data=b"[DONE]"),
]


def test_whole_stream_at_once() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(STREAM) == EVENTS
    assert not decoder.pending()


def _fed_in_pieces(stream: bytes, size: int) -> list[SSEEvent]:
    """The events of `stream` fed to one decoder `size` bytes at a time."""
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    for start in range(0, len(stream), size):
        events += decoder.feed(stream[start : start + size])
    return events


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 13])
def test_any_split_gives_the_same_events(size: int) -> None:
    assert _fed_in_pieces(STREAM, size) == EVENTS


def test_crlf_split_across_feeds_is_one_line_end() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: x\r") == []
    assert decoder.feed(b"\n") == []  # the LF completing CRLF is not a blank line
    assert decoder.feed(b"\r\n") == [SSEEvent(data=b"x")]


def test_payload_bytes_are_untouched() -> None:
    payload = b'{"content": "caf\\u00e9 \xc3\xa9", "n": 1.50}'
    assert SSEDecoder().feed(b"data: " + payload + b"\n\n") == [SSEEvent(data=payload)]


def test_unterminated_event_stays_pending() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"partial": tr') == []
    assert decoder.pending()
    assert decoder.feed(b"ue}\n\n") == [SSEEvent(data=b'{"partial": true}')]
    assert not decoder.pending()


def test_event_without_data_is_dropped() -> None:
    assert SSEDecoder().feed(b"event: ping\n\n: comment\n\n") == []


def test_oversized_event_is_refused() -> None:
    decoder = SSEDecoder(max_event_bytes=64)
    with pytest.raises(SSEError):
        decoder.feed(b"data: " + b"x" * 100)
    decoder = SSEDecoder(max_event_bytes=64)
    decoder.feed(b"data: " + b"x" * 40 + b"\n")
    with pytest.raises(SSEError):
        decoder.feed(b"data: " + b"x" * 40 + b"\n")


def test_line_trickling_in_over_many_feeds_is_joined_once_complete() -> None:
    payload = b'{"content": "' + b"x" * 5000 + b'"}'
    decoder = SSEDecoder()
    wire = b"data: " + payload + b"\n\n"
    events: list[SSEEvent] = []
    for start in range(0, len(wire) - 2, 100):
        events += decoder.feed(wire[start : min(start + 100, len(wire) - 2)])
    assert events == []
    assert decoder.pending()
    assert decoder.feed(b"\n\n") == [SSEEvent(data=payload)]
    assert not decoder.pending()


def test_field_forms_without_the_space_after_the_colon() -> None:
    assert SSEDecoder().feed(b"event:error\ndata:{}\ndata\n\n") == [
        SSEEvent(data=b"{}\n", event="error")
    ]


def test_oversized_line_is_refused_while_it_trickles_in() -> None:
    decoder = SSEDecoder(max_event_bytes=64)
    decoder.feed(b"data: " + b"x" * 30)
    with pytest.raises(SSEError):
        decoder.feed(b"x" * 40)


@pytest.mark.parametrize("size", [1, 2, 3, 4, len(STREAM) + 3])
def test_a_byte_order_mark_that_begins_the_stream_is_dropped(size: int) -> None:
    """Rule 6: else the first line would be a field named `\\ufeffdata`, its event lost."""
    assert _fed_in_pieces(b"\xef\xbb\xbf" + STREAM, size) == EVENTS


def test_only_the_streams_first_bytes_can_be_a_byte_order_mark() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b'data: {"a": 1}\n\n') == [SSEEvent(data=b'{"a": 1}')]
    assert decoder.feed(b"\xef\xbb\xbfdata: x\n\n") == []  # an unknown field, as it is
