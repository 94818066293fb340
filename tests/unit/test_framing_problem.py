"""`iop_edge.http.framing.framing_problem` on heads as they arrive: folded header lines
found wherever their line breaks put them, and nothing past the head's end looked at."""

from __future__ import annotations

import h11
import pytest

from iop_edge.http.framing import framing_problem


def _request(head: bytes) -> h11.Request:
    """What h11 parses from `head` (it unfolds folded lines itself)."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(head)
    event = connection.next_event()
    assert isinstance(event, h11.Request), event
    return event


@pytest.mark.parametrize(
    "head",
    [
        b"POST / HTTP/1.1\r\nHost: a\r\nX-Note: one\r\n two\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nX-Note: one\r\n\ttwo\r\n\r\n",
        b"POST / HTTP/1.1\nHost: a\nX-Note: one\n two\n\n",
        b"POST / HTTP/1.1\r\nHost: a\r\nX-Note: one\n two\r\n\r\n",
    ],
    ids=["space", "tab", "bare-lf", "mixed"],
)
def test_a_folded_header_line_is_a_problem(head: bytes) -> None:
    problem = framing_problem(_request(head), head)
    assert problem is not None and "obsolete line folding" in problem


@pytest.mark.parametrize(
    "head",
    [
        b"POST / HTTP/1.1\r\nHost: a\r\nX-Note: one two\r\n\r\n",
        b'POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 8\r\n\r\n\n {"a":1}',
        b"POST / HTTP/1.1\nHost: a\n\n\tbody",
    ],
    ids=["plain", "body-after-crlf", "body-after-lf"],
)
def test_a_line_past_the_head_or_without_folding_is_none(head: bytes) -> None:
    assert framing_problem(_request(head), head) is None
