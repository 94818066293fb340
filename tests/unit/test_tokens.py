"""The output estimate (`schemas.tokens.OutputTally`) used when a provider reports no usage."""

from __future__ import annotations

import json

import pytest

from schemas.tokens import OutputTally, output_chars


def _delta(**fields: object) -> bytes:
    return json.dumps({"choices": [{"index": 0, "delta": fields}]}).encode()


@pytest.mark.parametrize(
    ("payload", "chars"),
    [
        (_delta(content="hello"), 5),
        (_delta(role="assistant", content=""), 0),
        (_delta(reasoning_content="hmm"), 3),
        (_delta(reasoning="hm"), 2),
        (_delta(refusal="no"), 2),
        (_delta(tool_calls=[{"index": 0, "function": {"name": "f", "arguments": '{"a":1}'}}]), 7),
        (_delta(content=[{"type": "text", "text": "part"}]), 4),
        (json.dumps({"choices": [{"index": 0, "text": "once"}]}).encode(), 4),
        (json.dumps({"choices": [{"message": {"content": "whole answer"}}]}).encode(), 12),
        (json.dumps({"choices": [], "usage": {"prompt_tokens": 1}}).encode(), 0),
        (b'{"choices": "not a list"}', None),
        (b"not json", None),
    ],
)
def test_output_chars_reads_every_kind_of_generated_text(payload: bytes, chars: int | None) -> None:
    assert output_chars(payload) == chars


def test_each_chunk_with_text_is_at_least_one_token() -> None:
    """Engines stream about a token per chunk: five one-letter chunks are five tokens,
    not ceil(5 / 4)."""
    tally = OutputTally()
    for letter in "Hello":
        tally.add(_delta(content=letter))
    tally.add(_delta())  # the finish chunk carries nothing
    assert (tally.pieces, tally.chars, tally.tokens()) == (5, 5, 5)


def test_long_chunks_count_their_characters() -> None:
    tally = OutputTally()
    tally.add(_delta(content="x" * 40))
    assert tally.tokens() == 10


def test_an_unreadable_chunk_still_counts_as_output() -> None:
    tally = OutputTally()
    tally.add(b"data the relay could not read")
    assert tally.tokens() == 1


def test_nothing_delivered_is_zero() -> None:
    assert OutputTally().tokens() == 0
