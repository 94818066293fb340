"""The output estimate (`schemas.tokens.OutputTally`) used when a provider reports no usage."""

from __future__ import annotations

import json

import pytest

from schemas.tokens import TOKEN_CHUNK_CHARS, OutputTally, output_chars


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


def test_a_token_sized_chunk_is_one_token() -> None:
    """Engines stream about a token per chunk: each short chunk is one token, whatever
    its length up to `TOKEN_CHUNK_CHARS` (so not characters / 4)."""
    tally = OutputTally()
    for piece in ("H", "ello", " understanding", "x" * TOKEN_CHUNK_CHARS):
        tally.add(_delta(content=piece))
    tally.add(_delta())  # the finish chunk carries nothing
    assert (tally.pieces, tally.tokens()) == (4, 4)


def test_a_longer_piece_counts_its_characters() -> None:
    tally = OutputTally()
    tally.add(_delta(content="x" * 40))  # several tokens in one chunk
    whole = json.dumps({"choices": [{"message": {"content": "short answer"}}]}).encode()
    tally.add(whole, whole=True)  # a whole response: characters only
    assert tally.tokens() == 10 + 3


def test_an_unreadable_chunk_still_counts_as_output() -> None:
    tally = OutputTally()
    tally.add(b"data the relay could not read")
    assert tally.tokens() == 1


def test_nothing_delivered_is_zero() -> None:
    assert OutputTally().tokens() == 0
